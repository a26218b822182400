"""Issue 52, item 6: a job's own calls to the queue (its checkpoints, its stop, its completion)
carry the token the queue issued to its current attempt, set in the attempt's runtime env. Any
other process, an earlier attempt of the same job included, is refused: it cannot mark the job
completed (so a head restart's witness does not then record it succeeded), and its checkpoint
calls are told to stop and record nothing. The real :class:`JobQueue` and store, the in-memory
job server recording each attempt's env as Ray's launcher sets it. That a real job sends its
attempt's token through the real actor is what tests/scheduling/test_queue.py's jobs on a Ray
head show: a job whose calls lacked it would be told to stop at its first checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from raydeck._internal.contract import QUEUE_JOB_ENV, QUEUE_TOKEN_ENV
from raydeck.errors import ConfigError
from raydeck.scheduling.policies.core import Resources
from raydeck.scheduling.queue.job_queue import JobQueue, JobSpec
from raydeck.scheduling.queue.ray_jobs import queue_env
from raydeck.scheduling.queue.store import JobRow, Store
from tests.fixtures.fake_job_server import FakeJobServer

pytestmark = pytest.mark.timeout(60)


class _Server(FakeJobServer):
    """The in-memory job server, keeping each attempt's runtime env as Ray's launcher sets it
    (``raydeck.scheduling.queue.ray_jobs``): what the job's processes read."""

    def __init__(self) -> None:
        super().__init__()
        self.envs: dict[str, dict[str, str]] = {}

    def submit(self, row: JobRow, package: bytes | None) -> None:
        super().submit(row, package)
        self.envs[row.submission_id] = queue_env(row)

    def token(self, submission_id: str) -> str:
        return self.envs[submission_id][QUEUE_TOKEN_ENV]


def _spec(job_id: str) -> JobSpec:
    return JobSpec(job_id, "a", 0, "custom", Resources(cpus=1), job_id, "python job.py", {})


def _started(tmp_path: Path, server: _Server) -> tuple[Store, JobQueue]:
    store = Store(f"sqlite:///{tmp_path / 'q.db'}")
    queue = JobQueue(store, server)
    queue.submit(_spec("B"))
    assert queue.tick() == ["B"]
    queue.tick()  # running
    return store, queue


def _row(store: Store, job_id: str) -> JobRow:
    row = store.get(job_id)
    assert row is not None
    return row


def test_only_the_current_attempt_reports_its_checkpoints_stop_and_completion(
        tmp_path: Path) -> None:
    server = _Server()
    store, queue = _started(tmp_path, server)
    token = server.token("B")
    assert token == _row(store, "B").token and len(token) >= 40
    refused = (r"^completed B: refused, the call does not carry the token of its current "
               r"attempt B; only that attempt's own process reports it \(RAYDECK_QUEUE_TOKEN "
               r"in its runtime env\)$")
    for forged in ("", "guess", token[:-1], 42):
        with pytest.raises(ConfigError, match=refused):
            queue.completed("B", forged)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"^preempted B: refused"):
            queue.preempted("B", forged)  # type: ignore[arg-type]
        assert queue.checkpointed("B", forged) is True  # type: ignore[arg-type]
    row = _row(store, "B")
    assert row.checkpoint_at is None and row.completed_at is None and row.state == "running"
    assert queue.checkpointed("B", token) is False
    assert queue.preempted("B", token) is None
    queue.completed("B", token)
    assert _row(store, "B").completed_at is not None


def test_nobody_but_the_job_marks_it_completed_so_a_head_restart_runs_it_again(
        tmp_path: Path) -> None:
    """Issue 52: any process could mark any job completed, and the head-restart witness then
    recorded it as succeeded."""
    server = _Server()
    store, queue = _started(tmp_path, server)
    first = server.token("B")
    with pytest.raises(ConfigError, match=r"^completed B: refused"):
        queue.completed("B", "not-the-jobs")

    restarted = _Server()  # the restarted head's job server knows no job
    queue = JobQueue(store, restarted)
    queue.tick()
    assert restarted.submitted == ["B-r1"]  # run again, not recorded succeeded
    row = _row(store, "B")
    assert row.state == "starting" and row.attempt == 1
    second = restarted.token("B-r1")
    assert second == row.token and second != first

    # The first attempt, if it still runs somewhere, reports nothing of the second: its
    # checkpoints are told to stop, its completion is refused.
    assert queue.checkpointed("B", first) is True
    with pytest.raises(ConfigError, match=r"^completed B: refused, the call does not carry the "
                                          r"token of its current attempt B-r1;"):
        queue.completed("B", first)
    assert _row(store, "B").checkpoint_at is None and _row(store, "B").completed_at is None

    # The current attempt's own word is the witness.
    queue.completed("B", second)
    again = _Server()
    JobQueue(store, again).tick()
    row = _row(store, "B")
    assert again.submitted == [] and row.state == "succeeded" and row.attempt == 1
    assert row.reason.endswith("its driver reported that training ran to its end")


def test_each_attempt_gets_its_own_token_and_a_retried_submission_keeps_it(
        tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'q.db'}")
    JobQueue(store, _Server()).submit(_spec("B"))
    queued = _row(store, "B").token
    store.update("B", state="queued", reason="submission failed 1x")  # same attempt
    assert _row(store, "B").token == queued
    store.update("B", attempt=1)
    assert _row(store, "B").token not in ("", queued)
    assert queue_env(_row(store, "B")) == {QUEUE_JOB_ENV: "B",
                                           QUEUE_TOKEN_ENV: _row(store, "B").token}
