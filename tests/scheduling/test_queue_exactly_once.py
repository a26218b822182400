"""Issue 25, defect 7: exactly once across a head restart. A restarted head's job server has
forgotten every job; before the real :class:`JobQueue` runs a forgotten started job again it
asks the job's own witness (its MLflow run in a real MLflow server, or its driver's word that
training ran to its end), so a job that finished while the head was down is recorded
succeeded, not run twice, and one that did not is requeued. The head-restart test in
tests/scheduling/test_queue.py does the same on a real cluster.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from raydeck.jobs.submission import METADATA_RUN_ID
from raydeck.scheduling.policies.core import Resources
from raydeck.scheduling.queue.job_queue import JobQueue, JobSpec
from raydeck.scheduling.queue.store import Store
from raydeck.scheduling.queue.witness import MlflowRuns
from raydeck.tracking.proxy.writer import RUN_KEY_TAG, TransientWriteError
from tests.fixtures.fake_job_server import FakeJobServer
from tests.fixtures.mlflow_server import MlflowServer

pytestmark = pytest.mark.timeout(60)


def _spec(job_id: str, run_key: str) -> JobSpec:
    return JobSpec(job_id, "a", 0, "custom", Resources(cpus=1), job_id, "python job.py", {},
                   metadata={METADATA_RUN_ID: run_key})


def _started(tmp_path: Path, keys: dict[str, str], **queue_options: Any
             ) -> tuple[Store, JobQueue]:
    """A queue that started one job per ``keys`` entry (job id -> run key)."""
    store = Store(f"sqlite:///{tmp_path / 'q.db'}")
    queue = JobQueue(store, FakeJobServer(), **queue_options)
    for job_id, key in keys.items():
        queue.submit(_spec(job_id, key))
    assert sorted(queue.tick()) == sorted(keys)
    queue.tick()  # the job server has them: running
    return store, queue


def test_a_job_whose_run_finished_while_the_head_was_down_is_not_run_again(
        tmp_path: Path, mlflow_server: MlflowServer, mlflow_client: Any) -> None:
    suffix = uuid.uuid4().hex[:8]
    keys = {job: f"{job}-{suffix}" for job in ("done", "died", "trained", "old")}
    runs = MlflowRuns(mlflow_server.uri)
    experiment = mlflow_client.create_experiment(f"exactly-once-{suffix}")
    # "old" logs under a run id whose run FINISHED before this attempt started (queued again
    # under its old run id): that is not this attempt's witness.
    old_run = mlflow_client.create_run(experiment, tags={RUN_KEY_TAG: keys["old"]})
    mlflow_client.set_terminated(old_run.info.run_id, "FINISHED")
    store, queue = _started(tmp_path, keys, run_finished=runs)
    # While the head goes down: "done" trains to its end and its run ends FINISHED; "died"
    # dies with the head, its run still RUNNING; "trained" tells the queue training ran to
    # its end (the queue's own record), then its exit is lost with the head.
    for job in ("done", "died"):
        run = mlflow_client.create_run(experiment, tags={RUN_KEY_TAG: keys[job]})
        if job == "done":
            mlflow_client.set_terminated(run.info.run_id, "FINISHED")
    queue.completed("trained", store.get("trained").token)  # type: ignore[union-attr]

    restarted = FakeJobServer()  # the restarted head's job server knows no job
    queue = JobQueue(store, restarted, run_finished=runs)
    queue.tick()

    assert restarted.submitted == ["died-r1", "old-r1"]  # only these run again
    for job in ("done", "trained"):
        row = store.get(job)
        assert row is not None and row.state == "succeeded" and row.attempt == 0, row
    assert store.get("done").reason == (  # type: ignore[union-attr]
        f"succeeded while the job server was away: its MLflow run {keys['done']} ended "
        "FINISHED")
    assert store.get("trained").reason == (  # type: ignore[union-attr]
        "succeeded while the job server was away: its driver reported that training ran to "
        "its end")
    died = store.get("died")
    assert died is not None and died.state == "starting" and died.attempt == 1
    assert "lost when the cluster's head restarted" in died.reason


def test_while_mlflow_cannot_say_a_forgotten_job_keeps_its_place(tmp_path: Path) -> None:
    """Neither yes nor no: the queue neither runs it again nor records it finished, and asks
    again at the next tick."""
    answers: list[bool | Exception] = [TransientWriteError("connection refused"), False]

    def run_finished(key: str, since: float) -> bool:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    store, _ = _started(tmp_path, {"job": "job-run"})
    restarted = FakeJobServer()
    queue = JobQueue(store, restarted, run_finished=run_finished)
    queue.tick()
    row = store.get("job")
    assert row is not None and row.state == "running" and restarted.submitted == []
    queue.tick()  # MLflow answers: the run did not finish
    assert restarted.submitted == ["job-r1"] and not answers
