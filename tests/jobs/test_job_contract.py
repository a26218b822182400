"""raydeck submit's job contract: `python JOB ARGS...` with the arguments after `--` untouched;
the preset, run name and run id in RAYDECK_PRESET, RAYDECK_RUN_NAME, RAYDECK_RUN_ID."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from raydeck.jobs.submission import (
    PRESET_ENV,
    RUN_ID_ENV,
    RUN_NAME_ENV,
    JobRequest,
    contract_conflicts,
    submitted_runtime_env,
)

# A script that knows nothing of raydeck: its own argparse, no --preset or --run-name.
PLAIN_SCRIPT = '''
import argparse, json, os
parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, required=True)
parser.add_argument("--tag")
args = parser.parse_args()
print(json.dumps({"lr": args.lr, "tag": args.tag,
                  **{k: os.environ.get(k) for k in
                     ("RAYDECK_PRESET", "RAYDECK_RUN_NAME", "RAYDECK_RUN_ID")}}))
'''


def _request(*args: str, job_file: str = "train.py") -> JobRequest:
    return JobRequest(job_file=job_file, preset="cpu-1", run_name="nightly", run_id="nightly-1",
                      runtime_env={"working_dir": ".", "env_vars": {"A": "1"}}, args=args)


def test_the_entrypoint_is_the_job_file_and_exactly_the_arguments_after_the_separator() -> None:
    args = ("--lr", "0.1", "--tag", "two words", "--preset=mine")
    request = _request(*args)
    assert shlex.split(request.entrypoint) == ["python", "train.py", *args]
    assert _request().entrypoint == "python train.py"
    env = submitted_runtime_env(request)["env_vars"]
    assert env["A"] == "1"
    assert (env[PRESET_ENV], env[RUN_NAME_ENV], env[RUN_ID_ENV]) == ("cpu-1", "nightly",
                                                                     "nightly-1")


@pytest.mark.timeout(60)
def test_a_plain_argparse_script_runs_with_the_entrypoint_and_reads_the_variables(
    tmp_path: Path,
) -> None:
    import json

    (tmp_path / "train.py").write_text(PLAIN_SCRIPT)
    request = _request("--lr", "0.5", "--tag", "a b")
    command = shlex.split(request.entrypoint)
    env = {**os.environ, **submitted_runtime_env(request)["env_vars"]}
    done = subprocess.run([sys.executable, *command[1:]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"lr": 0.5, "tag": "a b", "RAYDECK_PRESET": "cpu-1",
                                       "RAYDECK_RUN_NAME": "nightly",
                                       "RAYDECK_RUN_ID": "nightly-1"}


def test_an_option_given_to_submit_and_after_the_separator_names_both() -> None:
    assert contract_conflicts(("--lr", "1", "--preset", "cpu-4"), preset=None) == []
    assert contract_conflicts(("--lr", "1"), preset="cpu-1", run_name="n") == []
    assert contract_conflicts(("--preset", "cpu-4"), preset="cpu-1") == [
        "--preset given twice: --preset cpu-1 to raydeck submit and --preset cpu-4 after `--` "
        "for the job"]
    both = contract_conflicts(("--run-name=b", "--preset"), preset="cpu-1", run_name="a")
    assert both == [
        "--run-name given twice: --run-name a to raydeck submit and --run-name b after `--` for "
        "the job",
        "--preset given twice: --preset cpu-1 to raydeck submit and --preset  after `--` for "
        "the job"]


def _submit(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("RAYDECK_", "RAY_"))}
    return subprocess.run([sys.executable, "-m", "raydeck.cli", "submit", *args], cwd=tmp_path,
                          env=clean, capture_output=True, text=True, timeout=110)


@pytest.mark.timeout(120)
def test_submit_refuses_a_preset_given_twice_and_dry_runs_the_contract(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(PLAIN_SCRIPT)
    (tmp_path / "env.yaml").write_text("working_dir: .\n")
    twice = _submit(tmp_path, "train.py", "--runtime-env", "env.yaml", "--preset", "cpu-1",
                    "--dry-run", "--", "--lr", "1", "--preset", "cpu-4")
    assert twice.returncode == 2, twice.stdout + twice.stderr
    assert "error: --preset given twice: --preset cpu-1 to raydeck submit and --preset cpu-4 " \
           "after `--`" in " ".join(twice.stderr.split())

    shown = _submit(tmp_path, "train.py", "--runtime-env", "env.yaml", "--preset", "cpu-1",
                    "--run-name", "nightly", "--dry-run", "--", "--lr", "1", "--tag", "x y")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == "entrypoint: python train.py --lr 1 --tag 'x y'"
    assert '"RAYDECK_PRESET": "cpu-1"' in shown.stdout
    assert '"RAYDECK_RUN_NAME": "nightly"' in shown.stdout


def test_the_repositorys_jobs_read_the_contract_variables_as_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from raydeck.examples.digits import job_arguments

    monkeypatch.delenv(PRESET_ENV, raising=False)
    monkeypatch.delenv(RUN_NAME_ENV, raising=False)
    alone = job_arguments("d", "digits-torch").parse_args([])
    assert (alone.preset, alone.run_name) == ("cpu-2", "digits-torch")
    monkeypatch.setenv(PRESET_ENV, "cpu-1")
    monkeypatch.setenv(RUN_NAME_ENV, "nightly")
    submitted = job_arguments("d", "digits-torch").parse_args(["--epochs", "3"])
    assert (submitted.preset, submitted.run_name, submitted.epochs) == ("cpu-1", "nightly", 3)
    explicit = job_arguments("d", "digits-torch").parse_args(["--preset", "cpu-4"])
    assert explicit.preset == "cpu-4"
