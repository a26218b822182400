"""A slow MLflow or job server delays only the call that waits on it (issue 25, defect 4): the
real :class:`JobQueue` with a duration history and a job server that block until the test
lets them go, as MLflow's client (retrying for minutes) and Ray's job client (no HTTP timeout)
did. While one call waits, ``raydeck queue`` and a job's checkpoint call answer; a job server
that hangs costs a bounded wait (:class:`TimedLauncher`). That every request to the job server
has a timeout of its own is tests/scheduling/test_queue_job_server.py's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import pytest

from raydeck.errors import ConfigError
from raydeck.scheduling.policies.core import Resources
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.job_queue import JobQueue, JobSpec
from raydeck.scheduling.queue.launcher import JobState, Launcher, TimedLauncher
from raydeck.scheduling.queue.store import JobRow, Store

pytestmark = pytest.mark.timeout(60)


class _JobServer(Launcher):
    """One 4-CPU node; a call named in ``hang`` blocks until ``release`` is set."""

    def __init__(self) -> None:
        self.jobs: dict[str, str] = {}
        self.tokens: dict[str, str] = {}  # each job's attempt token, as its runtime env has it
        self.hang: set[str] = set()
        self.hanging = threading.Event()  # a call is blocked now
        self.release = threading.Event()

    def _maybe_hang(self, call: str) -> None:
        if call in self.hang:
            self.hanging.set()
            self.release.wait(30)

    def submit(self, row: JobRow, package: bytes | None) -> None:
        self._maybe_hang("submit")
        self.jobs[row.submission_id] = "RUNNING"
        self.tokens[row.id] = row.token

    def statuses(self, submission_ids: Collection[str]) -> dict[str, JobState]:
        self._maybe_hang("status")
        return {s: JobState(self.jobs[s]) for s in submission_ids if s in self.jobs}

    def log_tail(self, submission_id: str) -> str:
        return ""

    def stop(self, submission_id: str) -> None:
        self._maybe_hang("stop")
        self.jobs[submission_id] = "STOPPED"

    def resources(self) -> tuple[tuple[Resources, ...], tuple[Resources, ...]]:
        return (Resources(cpus=4),), (Resources(cpus=4),)

    def placed(self, submission_id: str) -> bool:
        return True


def _spec(job_id: str) -> JobSpec:
    return JobSpec(job_id, "a", 0, "custom", Resources(cpus=1), job_id, "python job.py", {})


def _in_background(call: Callable[[], Any]) -> threading.Thread:
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


def test_a_slow_mlflow_during_submit_blocks_no_other_call(tmp_path: Path) -> None:
    server, predicting, release = _JobServer(), threading.Event(), threading.Event()

    def history(key: str) -> list[float]:  # MLflow retrying a refused connection
        if key == "slow":
            predicting.set()
            release.wait(30)
        return []

    queue = JobQueue(Store(f"sqlite:///{tmp_path / 'q.db'}"), server, history=history)
    queue.submit(_spec("running"))
    assert queue.tick() == ["running"]
    submitting = _in_background(lambda: queue.submit(_spec("slow")))
    assert predicting.wait(10)
    # Each call answers while the submit is still blocked on MLflow: none waits for it.
    assert [e.job.id for e in queue.listing()] == ["running"] and submitting.is_alive()
    assert queue.checkpointed("running", server.tokens["running"]) is False
    assert submitting.is_alive()
    queue.tick()
    assert submitting.is_alive()
    release.set()
    submitting.join(10)
    assert [e.job.id for e in queue.listing()] == ["running", "slow"]


def test_a_tick_waiting_on_the_job_server_blocks_no_client_call(tmp_path: Path) -> None:
    server = _JobServer()
    queue = JobQueue(Store(f"sqlite:///{tmp_path / 'q.db'}"), server)
    queue.submit(_spec("running"))
    assert queue.tick() == ["running"]
    server.hang = {"status"}
    ticking = _in_background(queue.tick)
    assert server.hanging.wait(10)  # the tick is reading the job's status
    # Each call answers while the tick is still blocked on the job server.
    assert queue.checkpointed("running", server.tokens["running"]) is False and ticking.is_alive()
    assert [e.job.state for e in queue.listing()] == ["starting"] and ticking.is_alive()
    assert queue.cancel("running", Identity.here()).state == "cancelled" and ticking.is_alive()
    server.release.set()
    ticking.join(10)
    assert not ticking.is_alive()
    # The status the tick read before the cancel is not applied over it.
    assert queue.listing() == [] and server.jobs["running"] == "STOPPED"


def test_a_job_server_that_hangs_costs_a_bounded_wait(tmp_path: Path) -> None:
    server, clock = _JobServer(), [100.0]
    queue = JobQueue(Store(f"sqlite:///{tmp_path / 'q.db'}"), TimedLauncher(server, 0.3),
                     clock=lambda: clock[0])
    queue.submit(_spec("running"))
    assert queue.tick() == ["running"]
    queue.submit(_spec("hung"))
    server.hang = {"submit", "stop"}
    # Unbounded, the submit would go through once the server answered (after 30 s).
    assert queue.tick() == []
    (hung,) = [e for e in queue.listing() if e.job.id == "hung"]
    assert hung.job.state == "queued"
    assert hung.why.startswith("submission failed 1x (LauncherTimeout: the job server did not "
                               "answer submitting hung within 0.3 s)")
    with pytest.raises(ConfigError, match="cannot stop job running now: LauncherTimeout"):
        queue.cancel("running", Identity.here())
    server.release.set()
