"""Every Python snippet in README.md runs, against the test fixtures (real Ray and MLflow server).

The convention for README's ```python blocks (this test enforces it; follow it when editing):

- **No marker: a complete program.** The block runs exactly as written, the way a user would
  run it as ``python snippet.py``: a fresh Python process whose raydeck settings point at the
  session's MLflow server and whose Ray is the session's cluster (``RAY_ADDRESS``), in an empty
  working directory. It must exit 0. So it imports what it uses and holds real values: write
  ``loss = 1.0 / (step + 1)  # your training step``, not ``{"loss": ...}``.
- **``<!-- snippet: in HARNESS -->`` on the line right before the fence: a fragment.** It uses
  names it does not define (a model, a tracker, the loop around it). ``HARNESS`` names an entry
  of :data:`HARNESSES` below, a runnable program that defines those names, runs the fragment
  where README says it runs (e.g. inside a Ray Train worker) and checks what README promises it
  does. To document a new fragment, pick a harness or add one here, listing the names it
  provides. ``...`` may appear only where Python takes it as a statement that does nothing.

Blocks in other languages (bash, yaml) are not run here: the CLI and job tests run those
commands. A ``<!-- snippet: ... -->`` marker that is not directly above a ```python block fails
the test, so markers cannot go stale silently.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPET_TIMEOUT_S = 540
MARKER = re.compile(r"^<!-- snippet: (.*) -->$")

# Each harness is a program with a {snippet} placeholder, indented where the fragment goes.
HARNESSES: dict[str, str] = {
    # Provides, inside a Ray Train worker's training function: raydeck, tracker (this run's),
    # model and optimizer (torch), epochs (2) and train_one_epoch(model, optimizer) -> metrics.
    # Checks: every epoch is in the run once, with its checkpoint recorded.
    "train_fn": '''
import torch
from mlflow.tracking import MlflowClient
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer

import raydeck


def train_one_epoch(model, optimizer):
    loss = model(torch.ones(8, 4)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return {"train_loss": loss.item()}


def train_fn(config):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    epochs = 2
    with raydeck.get_tracker() as tracker:
        {snippet}


driver = raydeck.get_tracker(run_name="readme-train-fn")
TorchTrainer(train_fn, scaling_config=ScalingConfig(num_workers=1),
             run_config=driver.run_config()).fit()
driver.finish()
run = MlflowClient(raydeck.load_settings().tracking.uri).get_run(driver.run_id)
steps = sorted(m.step for m in MlflowClient(raydeck.load_settings().tracking.uri)
               .get_metric_history(driver.run_id, "train_loss"))
assert steps == [0, 1], steps
assert run.data.tags["raydeck.checkpoint.latest_epoch"] == "1", run.data.tags
''',
}


@dataclass(frozen=True)
class Snippet:
    line: int  # README line of the opening fence
    code: str
    marker: str  # "" for a complete program

    @property
    def harness(self) -> str | None:
        return self.marker.removeprefix("in ").strip() if self.marker.startswith("in ") else None


def _snippets() -> list[Snippet]:
    lines = README.read_text().splitlines()
    found, index = [], 0
    while index < len(lines):
        line = lines[index]
        marker = MARKER.match(line)
        if marker and (index + 1 >= len(lines) or lines[index + 1].strip() != "```python"):
            raise AssertionError(f"README.md:{index + 1}: a snippet marker must be directly "
                                 "above a ```python block")
        if line.strip() == "```python":
            end = lines.index("```", index + 1)
            previous = MARKER.match(lines[index - 1]) if index else None
            found.append(Snippet(index + 1, "\n".join(lines[index + 1:end]) + "\n",
                                 previous.group(1).strip() if previous else ""))
            index = end
        index += 1
    return found


SNIPPETS = _snippets()


def test_readme_has_snippets_and_every_marker_is_valid() -> None:
    assert len(SNIPPETS) >= 2
    for snippet in SNIPPETS:
        where = f"README.md:{snippet.line}"
        if snippet.marker:
            assert snippet.harness in HARNESSES, (
                f"{where}: marker {snippet.marker!r} must be 'in <harness>' with a harness of "
                f"{sorted(HARNESSES)}")
        compile(snippet.code, where, "exec")  # every block is valid Python on its own


def _program(snippet: Snippet) -> str:
    if snippet.harness is None:
        return snippet.code
    harness = textwrap.dedent(HARNESSES[snippet.harness])
    slot = next(line for line in harness.splitlines() if line.strip() == "{snippet}")
    indent = slot[:len(slot) - len(slot.lstrip())]
    return harness.replace(slot, textwrap.indent(snippet.code, indent).rstrip("\n"))


@pytest.mark.slow
@pytest.mark.timeout(SNIPPET_TIMEOUT_S + 60)
@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: f"README.md:{s.line}")
def test_readme_snippet_runs(snippet: Snippet, ray_cluster: None, tmp_path: Path) -> None:
    import ray

    script = tmp_path / "snippet.py"
    script.write_text(_program(snippet))
    # HOME: Ray Train's default storage (~/ray_results) of a snippet stays in its directory.
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
           "HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S)
    assert done.returncode == 0, (
        f"README.md:{snippet.line} failed (exit {done.returncode}):\n{script.read_text()}\n"
        f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-5000:]}")
