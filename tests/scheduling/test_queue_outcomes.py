"""A cancel always stops, and an outcome is always true: the real :class:`JobQueue` and store in
front of the fake job server (which keeps every job, as Ray's does, and a driver's exit code).

Issue 52: a submission that timed out but reached Ray went back to ``queued`` and a cancel then
marked it cancelled without stopping it; a cancel racing a requeue stopped the old attempt and
left the new one running; a job that crashed while it was asked to stop (before it was told)
was recorded as preempted and run again; an id reused after the retention period was refused as
a job "the queue did not start".
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from raydeck.scheduling.policies.core import QueuedJob, Resources, RunningJob
from raydeck.scheduling.policies.registry import make_policy
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.job_queue import RETENTION_S, JobQueue, JobSpec
from raydeck.scheduling.queue.reconcile import PREEMPT_GRACE_S
from raydeck.scheduling.queue.store import JobRow, Store
from tests.fixtures.fake_job_server import FakeJobServer

pytestmark = pytest.mark.timeout(60)

HOUR = 3600.0


class _LosingServer(FakeJobServer):
    """A job server whose answer to the submissions named in ``lose`` never arrives: the job
    is accepted, and the caller sees a timeout (as a request that timed out after Ray got it).
    ``during_stop``: run once when a stop arrives, before it takes effect (a tick racing a
    cancel)."""

    def __init__(self) -> None:
        super().__init__()
        self.lose: set[str] = set()
        self.during_stop: list[object] = []

    def submit(self, row: JobRow, package: bytes | None) -> None:
        super().submit(row, package)
        if row.submission_id in self.lose:
            raise requests.ReadTimeout("read timed out (the job server got the job)")

    def stop(self, submission_id: str) -> None:
        while self.during_stop:
            action = self.during_stop.pop(0)
            assert callable(action)
            action()
        super().stop(submission_id)


def _spec(job_id: str, priority: int = 0, cpus: float = 4) -> JobSpec:
    return JobSpec(job_id, "a", priority, "custom", Resources(cpus=cpus), job_id,
                   "python job.py", {}, estimate_s=HOUR)


def _queue(tmp_path: Path, server: FakeJobServer, clock: list[float]) -> JobQueue:
    return JobQueue(Store(f"sqlite:///{tmp_path / 'q.db'}"), server, clock=lambda: clock[0])


def _row(tmp_path: Path, job_id: str) -> JobRow:
    row = Store(f"sqlite:///{tmp_path / 'q.db'}").get(job_id)
    assert row is not None
    return row


def _preempting(tmp_path: Path, server: FakeJobServer, clock: list[float]) -> JobQueue:
    """B (the whole node) running with a checkpoint and asked to stop for H (priority 5)."""
    queue = _queue(tmp_path, server, clock)
    queue.configure(Identity.here(), "priority")
    queue.submit(_spec("B"))
    assert queue.tick() == ["B"]
    clock[0] += HOUR
    assert queue.checkpointed("B", server.tokens["B"]) is False
    queue.submit(_spec("H", priority=5))
    assert queue.tick() == []
    assert _row(tmp_path, "B").state == "preempting"
    return queue


def test_a_crash_while_asked_to_stop_is_a_failure_with_its_exit_code_and_log(
        tmp_path: Path) -> None:
    server, clock = FakeJobServer(), [0.0]
    queue = _preempting(tmp_path, server, clock)
    server.exit("B", 1)  # crashed before its next checkpoint: never told to stop
    clock[0] += 10
    assert queue.tick() == ["H"]
    row = _row(tmp_path, "B")
    assert (row.state, row.exit_code, row.preemptions) == ("failed", 1, 0)
    assert row.reason == "exited with code 1; its log ends: driver exited with 1"
    assert [e.job.id for e in queue.listing()] == ["H"]  # ended: in the listing of all only
    (entry,) = [e for e in queue.listing(ended=True) if e.job.id == "B"]
    assert (entry.job.state, entry.job.exit_code, entry.why) == ("failed", 1, row.reason)
    assert entry.job.log_tail == "driver exited with 1"
    assert server.submitted == ["B", "H"]  # never started again


def test_a_job_told_to_stop_that_then_crashes_is_a_failure_not_a_preemption(
        tmp_path: Path) -> None:
    server, clock = FakeJobServer(), [0.0]
    queue = _preempting(tmp_path, server, clock)
    clock[0] += 60
    assert queue.checkpointed("B", server.tokens["B"]) is True
    server.exit("B", 137)  # killed (OOM) while stopping, not with the preempted code
    assert queue.tick() == ["H"]
    row = _row(tmp_path, "B")
    assert (row.state, row.exit_code) == ("failed", 137)


def test_only_the_queues_own_stop_after_the_grace_period_counts_as_a_preemption(
        tmp_path: Path) -> None:
    server, clock = FakeJobServer(), [0.0]
    queue = _preempting(tmp_path, server, clock)
    clock[0] += PREEMPT_GRACE_S + 1
    assert queue.tick() == []  # the queue stops B: no checkpoint within the grace period
    assert server.jobs["B"] == "STOPPED"
    clock[0] += 1
    assert queue.tick() == ["H"]
    row = _row(tmp_path, "B")
    assert (row.state, row.preemptions) == ("queued", 1)

    (tmp_path / "other").mkdir()
    other, clock2 = FakeJobServer(), [0.0]
    queue2 = _preempting(tmp_path / "other", other, clock2)
    other.stop("B")  # someone ran `ray job stop B` while it was asked to stop
    assert queue2.tick() == ["H"]
    assert _row(tmp_path / "other", "B").state == "stopped"


def test_a_submission_whose_answer_was_lost_is_taken_as_started_never_run_twice(
        tmp_path: Path) -> None:
    server, clock = _LosingServer(), [0.0]
    server.lose.add("L")
    queue = _queue(tmp_path, server, clock)
    queue.submit(_spec("L"))
    assert queue.tick() == []  # its answer was lost: queued again to retry
    assert (_row(tmp_path, "L").state, server.jobs["L"]) == ("queued", "RUNNING")
    clock[0] += 1
    queue.tick()  # the job server has it: started, not submitted again
    clock[0] += HOUR
    queue.tick()
    assert _row(tmp_path, "L").state == "running" and server.submitted == ["L"]
    server.exit("L", 0)
    queue.tick()
    assert _row(tmp_path, "L").state == "succeeded"


def test_cancelling_a_job_whose_submission_answer_was_lost_stops_it(tmp_path: Path) -> None:
    server, clock = _LosingServer(), [0.0]
    server.lose.add("L")
    queue = _queue(tmp_path, server, clock)
    queue.submit(_spec("L"))
    queue.tick()
    assert _row(tmp_path, "L").state == "queued"
    assert queue.cancel("L", Identity.here()).state == "cancelled"
    assert server.jobs["L"] == "STOPPED"


def test_a_cancel_racing_a_requeue_stops_the_new_attempt_too(tmp_path: Path) -> None:
    server, clock = _LosingServer(), [0.0]
    queue = _preempting(tmp_path, server, clock)
    queue.cancel("H", Identity.here())  # B's room is its own again
    clock[0] += 60
    assert queue.checkpointed("B", server.tokens["B"]) is True
    server.exit("B", 75)
    # While `raydeck cancel B` is stopping attempt 0, the tick requeues B and starts B-r1.
    server.during_stop.append(lambda: queue.tick())
    assert queue.cancel("B", Identity.here()).state == "cancelled"
    assert server.submitted[-1] == "B-r1" and server.jobs["B-r1"] == "STOPPED"


def test_an_attempt_still_running_for_a_cancelled_job_is_stopped_by_the_next_tick(
        tmp_path: Path) -> None:
    server, clock = FakeJobServer(), [0.0]
    queue = _queue(tmp_path, server, clock)
    queue.submit(_spec("A"))
    assert queue.tick() == ["A"]
    # The state a lost race leaves: recorded cancelled while its attempt still runs.
    Store(f"sqlite:///{tmp_path / 'q.db'}").update("A", state="cancelled", ended_at=clock[0])
    clock[0] += 1
    queue.tick()
    assert server.jobs["A"] == "STOPPED"


def test_an_id_reused_after_the_retention_period_runs_as_its_next_attempt(
        tmp_path: Path) -> None:
    server, clock = FakeJobServer(), [100.0]
    queue = _queue(tmp_path, server, clock)
    queue.submit(_spec("nightly", cpus=1))
    assert queue.tick() == ["nightly"]
    server.exit("nightly", 0)
    queue.tick()
    clock[0] += RETENTION_S + 2 * HOUR
    queue.tick()  # deletes the ended row; Ray still lists the job
    assert Store(f"sqlite:///{tmp_path / 'q.db'}").get("nightly") is None
    again = queue.submit(_spec("nightly", cpus=1))
    assert again.submission_id == "nightly-r1"
    assert queue.tick() == ["nightly"] and server.submitted == ["nightly", "nightly-r1"]


@pytest.mark.parametrize("policy", ["priority", "las"])
def test_a_checkpoint_at_clock_zero_counts_as_a_checkpoint(policy: str) -> None:
    """A clock reading of 0.0 is a time, not "never": of two victims, the one that would lose
    less work since its checkpoint goes first, the one that checkpointed at 0.0 last."""
    at_zero = RunningJob(QueuedJob("zero", "a", 0, Resources(cpus=1), 0.0, HOUR), 0.0, 0.0)
    recent = RunningJob(QueuedJob("recent", "a", 0, Resources(cpus=1), 0.0, HOUR), 0.0, 90.0)
    chosen = make_policy(policy)
    assert sorted([at_zero, recent], key=lambda v: chosen.victim_key(v, 100.0))[0] is recent


def test_a_checkpoint_at_the_clock_reading_of_the_request_was_not_told_to_stop(
        tmp_path: Path) -> None:
    """Found by the model-based test: B checkpoints, and at the same clock reading the queue
    asks it to stop for H. B was answered "go on", so when it then exits 0 it succeeded; it
    was taken as told (checkpoint time >= request time) and run again."""
    server, clock = FakeJobServer(), [0.0]
    queue = _queue(tmp_path, server, clock)
    queue.configure(Identity.here(), "priority")
    queue.submit(_spec("B"))
    assert queue.tick() == ["B"]
    clock[0] += HOUR
    queue.submit(_spec("H", priority=5))
    assert queue.checkpointed("B", server.tokens["B"]) is False  # not asked yet
    assert queue.tick() == []  # asked now, at the checkpoint's clock reading
    assert _row(tmp_path, "B").state == "preempting"
    server.exit("B", 0)  # it trained to its end without a checkpoint since
    assert queue.tick() == ["H"]
    row = _row(tmp_path, "B")
    assert (row.state, row.preemptions) == ("succeeded", 0)
    assert server.submitted == ["B", "H"]
