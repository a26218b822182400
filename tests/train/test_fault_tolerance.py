"""A worker or the driver dies mid-run: training resumes from the latest committed checkpoint, in
the same MLflow run, and the run's history holds every epoch (every logged step, for Lightning)
exactly once.

The jobs are the reference digits jobs, run on the session's Ray cluster. A worker's rank 0 is
killed with SIGKILL (a crash, no cleanup) while it waits at a gate right after Ray Train
committed its first checkpoint (``tests/fixtures/gated_digits.py``): what it logged after the
commit is still in its buffer, and what Lightning logs only after the epoch's callbacks (the
epoch's ``train_loss_epoch``) not logged at all, so the test fails unless the checkpoint holds
them. The driver test kills the driver once the run records a committed checkpoint of epoch 1.
Each test prints the time from the kill to the restarted workers tagging the run as resumed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.processes import ManagedProcess, wait_until

EPOCHS = 5
KILL_AFTER_EPOCH = 1
RUN_TIMEOUT_S = 500.0
POLL_INTERVAL_S = 0.1
RESUMED_TAG = "raydeck.checkpoint.resumed_from_epoch"
LATEST_EPOCH_TAG = "raydeck.checkpoint.latest_epoch"
REPO = Path(__file__).resolve().parents[2]


def _find_run(client: Any, key: str) -> Any:
    experiment = client.get_experiment_by_name(os.environ.get("RAYDECK_TRACKING_EXPERIMENT",
                                                              "raydeck"))
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id],
                              filter_string=f"tags.`raydeck.run_key` = '{key}'")
    assert len(runs) <= 1, f"{len(runs)} MLflow runs for one run id"
    return runs[0] if runs else None


def _tag(client: Any, key: str, name: str) -> str | None:
    run = _find_run(client, key)
    return run.data.tags.get(name) if run is not None else None


def _wait_for_committed_epoch(client: Any, key: str, epoch: int, alive: Callable[[], bool]
                              ) -> int:
    """Until the run records a committed checkpoint of ``epoch`` (or later); returns the epoch."""
    seen: dict[str, int] = {}

    def committed() -> bool:
        if not alive():
            raise AssertionError("the job ended before a checkpoint was committed")
        value = _tag(client, key, LATEST_EPOCH_TAG)
        seen["epoch"] = int(value) if value is not None else -1
        return seen["epoch"] >= epoch

    wait_until(committed, RUN_TIMEOUT_S, f"committed checkpoint of epoch {epoch}",
               interval_s=POLL_INTERVAL_S)
    return seen["epoch"]


def _wait_for_resume(client: Any, key: str) -> tuple[int, float]:
    """Until the restarted workers tag the run as resumed; returns (epoch, seconds waited)."""
    started = time.monotonic()
    wait_until(lambda: _tag(client, key, RESUMED_TAG) is not None, RUN_TIMEOUT_S,
               "training resumed", interval_s=POLL_INTERVAL_S)
    return int(_tag(client, key, RESUMED_TAG) or -1), time.monotonic() - started


def _steps(client: Any, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


@dataclass
class FaultedRun:
    """A digits job that went through a fault after a committed checkpoint and finished."""

    key: str
    result: Any
    run: Any
    committed_before_fault: int
    resumed_from: int
    fault_to_resume_s: float
    wall_s: float


def run_through_a_fault(client: Any, key: str, job: Callable[[], Any], after_epoch: int,
                        fault: Callable[[], None], timeout_s: float,
                        ready: Callable[[Callable[[], bool]], int] | None = None) -> FaultedRun:
    """Run ``job`` (a digits run of run id ``key``) in a driver thread; once the checkpoint of
    epoch ``after_epoch`` or later is committed (or ``ready(alive)``, given, returns the
    committed epoch), call ``fault``; wait for the training to resume and the job to end (its
    error, if it raised, is raised here)."""
    outcome: dict[str, Any] = {}

    def train() -> None:
        try:
            outcome["result"] = job()
        except BaseException as exc:
            outcome["error"] = exc

    started = time.monotonic()
    thread = threading.Thread(target=train, name=f"{key}-driver")
    thread.start()
    try:
        committed = (ready(thread.is_alive) if ready is not None else
                     _wait_for_committed_epoch(client, key, after_epoch, thread.is_alive))
        fault()
        resumed_from, fault_to_resume_s = _wait_for_resume(client, key)
    finally:
        thread.join(timeout_s)
    if "error" in outcome:
        raise outcome["error"]
    assert not thread.is_alive(), "the job did not finish"
    return FaultedRun(key=key, result=outcome["result"], run=_find_run(client, key),
                      committed_before_fault=committed, resumed_from=resumed_from,
                      fault_to_resume_s=fault_to_resume_s, wall_s=time.monotonic() - started)


def _run_and_kill_a_worker(kind: str, client: Any, run_name: str, tmp_path: Path
                           ) -> FaultedRun:
    """A digits job of ``kind`` (torch or lightning) whose rank 0 is SIGKILLed right after Ray
    Train committed its first checkpoint: each rank waits at a gate there
    (``tests/fixtures/gated_digits.py``), before anything it logged after the commit has left
    the process, so whatever the checkpoint holds must come back from it."""
    from raydeck.examples.digits import run_digits
    from tests.fixtures.gated_digits import held

    key = f"{run_name}-{uuid.uuid4().hex[:8]}"
    gate = tmp_path / "gate"
    rank_zero = Path(f"{gate}.{kind}.0")

    def at_gate(alive: Callable[[], bool]) -> int:
        def there() -> bool:
            if not alive():
                raise AssertionError("the job ended before its first checkpoint")
            return rank_zero.exists() and rank_zero.read_text() != ""

        wait_until(there, RUN_TIMEOUT_S, "rank 0 at the gate after the first checkpoint",
                   interval_s=POLL_INTERVAL_S)
        return 0

    def kill_rank_zero() -> None:
        os.kill(int(rank_zero.read_text()), signal.SIGKILL)
        gate.touch()  # the restarted attempt passes it

    try:
        killed = run_through_a_fault(
            client, key, lambda: run_digits(preset="cpu-2", config={"epochs": EPOCHS},
                                            run_name=run_name, run_id=key,
                                            train_fn=held(kind, str(gate), None)),
            0, kill_rank_zero, RUN_TIMEOUT_S, ready=at_gate)
    finally:
        gate.touch()
    print(f"\n{run_name}: rank 0 killed after committed epoch 0; training resumed from epoch "
          f"{killed.resumed_from} {killed.fault_to_resume_s:.1f} s after the kill; "
          f"job {killed.wall_s:.0f} s")
    return killed


def _assert_resumed_once_in_the_same_run(killed: FaultedRun) -> None:
    run = killed.run
    assert run is not None and run.info.run_id == killed.result.run_id
    assert run.info.status == "FINISHED"
    # Resumed from the checkpoint that was the latest committed one when the worker died: the
    # one the run recorded before the kill, or the next if it was committing at that moment.
    assert killed.committed_before_fault <= killed.resumed_from <= killed.committed_before_fault + 1
    assert killed.resumed_from < EPOCHS - 1, "the kill came too late to test a resume"
    tags = run.data.tags
    assert tags[LATEST_EPOCH_TAG] == str(EPOCHS - 1)
    assert tags[f"raydeck.checkpoint.epoch_{killed.resumed_from}"]
    assert killed.result.val_accuracy > 0.8


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_torch_worker_resumes_with_each_epoch_once(
    ray_cluster: None, mlflow_client: Any, tmp_path: Path
) -> None:
    killed = _run_and_kill_a_worker("torch", mlflow_client, "ft-torch", tmp_path)
    _assert_resumed_once_in_the_same_run(killed)
    # The world size goes with each checkpoint's points: once per epoch across the restart too.
    for key in ("train_loss", "val_loss", "val_accuracy", "samples_per_s", "raydeck/world_size"):
        assert _steps(mlflow_client, killed.run.info.run_id, key) == list(range(EPOCHS)), key


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_lightning_worker_resumes_with_each_step_once(
    ray_cluster: None, mlflow_client: Any, tmp_path: Path
) -> None:
    killed = _run_and_kill_a_worker("lightning", mlflow_client, "ft-lightning", tmp_path)
    _assert_resumed_once_in_the_same_run(killed)
    run_id = killed.run.info.run_id
    epoch_end_steps = _steps(mlflow_client, run_id, "val_accuracy")
    assert len(epoch_end_steps) == EPOCHS == len(set(epoch_end_steps))
    for key in ("val_loss", "train_loss_epoch"):
        assert _steps(mlflow_client, run_id, key) == epoch_end_steps, key
    # Step-level values: one per logged step, none lost between the checkpoints.
    step_values = _steps(mlflow_client, run_id, "train_loss_step")
    assert len(step_values) == len(set(step_values))
    assert step_values == list(range(step_values[0], epoch_end_steps[-1] + 1,
                                     step_values[1] - step_values[0]))
    assert killed.run.data.params["hidden"] == "128"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_resumes_in_the_same_mlflow_run_after_its_driver_died(
    ray_cluster: None, mlflow_client: Any, tmp_path: Path
) -> None:
    import ray

    key = f"ft-driver-{uuid.uuid4().hex[:8]}"
    command = [sys.executable, "jobs/digits_torch.py", "--epochs", str(EPOCHS), "--run-id", key]
    env = {"RAY_ADDRESS": ray.get_runtime_context().gcs_address, "PYTHONUNBUFFERED": "1"}

    first = ManagedProcess(command, tmp_path / "first.log", env=env, cwd=REPO).start()
    try:
        committed = _wait_for_committed_epoch(mlflow_client, key, KILL_AFTER_EPOCH, first.alive)
    finally:
        first.kill()
    # The proxy notices the dead driver and marks the run KILLED; resuming reopens it.
    wait_until(lambda: _find_run(mlflow_client, key).info.status == "KILLED", 120,
               "run marked KILLED after its driver died")

    second = ManagedProcess(command, tmp_path / "second.log", env=env, cwd=REPO).start()
    assert second.proc is not None
    try:
        returncode = second.proc.wait(RUN_TIMEOUT_S)
    finally:
        second.kill()
    assert returncode == 0, second.log_tail()
    run = _find_run(mlflow_client, key)
    assert run.info.status == "FINISHED"
    resumed_from = int(run.data.tags[RESUMED_TAG])
    assert committed <= resumed_from < EPOCHS - 1
    for metric in ("train_loss", "val_accuracy"):
        assert _steps(mlflow_client, run.info.run_id, metric) == list(range(EPOCHS)), metric
