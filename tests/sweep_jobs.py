"""Sweep jobs of the test suite: fast trials whose behaviour a test controls through the config.

Each trial trains nothing: its "model" is one parameter holding a score that grows by the
trial's ``lr`` per iteration, so values are deterministic (a replayed iteration reports the same
value), a PBT exploit visibly continues the source's score, and an iteration costs
milliseconds. The trials still use the real API (``raydeck.tune.restore``/``report`` with a
model and optimizer checkpoint), Ray Tune and the tracking proxy.

Importable by Ray workers: the suite's drivers run from the repository root, whose path Ray
hands to every worker of their job.
"""

from __future__ import annotations

import itertools
import os
import signal
from pathlib import Path
from typing import Any

import torch

REPORTS = ("val_accuracy", "score")


class ScoreModel(torch.nn.Module):
    """One parameter: the accumulated score. ``kill_file`` set: saving it kills the driver."""

    def __init__(self) -> None:
        super().__init__()
        self.score = torch.nn.Parameter(torch.zeros(()))
        self.kill_file: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.score

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        # raydeck.tune.report saves the model after it logged the iteration and before Tune
        # hears of it: killing the driver here is a kill in the middle of a report.
        if self.kill_file:
            _kill_driver_once(self.kill_file)
        return super().state_dict(*args, **kwargs)


def _kill_driver_once(pid_file: str) -> None:
    marker = f"{pid_file}.killed"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    os.killpg(int(Path(pid_file).read_text()), signal.SIGKILL)


def score_trial(config: dict[str, Any], data: Any = None) -> None:
    """Report ``val_accuracy`` (= the score, capped below 1) every iteration.

    Config: ``lr`` (score gained per iteration), ``fail_at`` (raise at that iteration),
    ``kill_driver_at`` and ``driver_pid_file`` (kill the sweep's driver inside that report).
    """
    import raydeck.tune

    model = ScoreModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=float(config["lr"]))
    done = raydeck.tune.restore(model, optimizer)
    for iteration in itertools.count(done + 1):
        if config.get("fail_at") == iteration:
            raise ValueError(f"diverged at iteration {iteration} (lr={config['lr']})")
        with torch.no_grad():
            model.score += float(config["lr"])
        score = float(model.score)
        model.kill_file = (config.get("driver_pid_file")
                           if iteration == config.get("kill_driver_at") else None)
        raydeck.tune.report({"val_accuracy": min(score, 0.999), "score": score},
                            model=model, optimizer=optimizer)


def score_job() -> Any:
    from raydeck.tune import SweepJob

    return SweepJob(train_fn=score_trial, reports=REPORTS,
                    model_factory=lambda config: ScoreModel())
