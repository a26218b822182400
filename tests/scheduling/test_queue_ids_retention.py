"""Issue 25, defect 6: the real :class:`JobQueue` in front of a fake job server that keeps
every job it ran, as Ray's does. An id the job server already has is refused, not adopted; a
queued job that ended leaves its id free to queue again (under a new submission id); ended
jobs and unused packages are deleted after ``RETENTION_S``; fair share's decay survives any
gap in out-of-order history.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from raydeck.errors import ConfigError
from raydeck.scheduling.policies.core import FairShare, QueuedJob, Resources, RunningJob
from raydeck.scheduling.queue.configuration import REPLAY_S
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.job_queue import RETENTION_S, JobQueue, JobSpec
from raydeck.scheduling.queue.store import Store
from tests.fixtures.fake_job_server import FakeJobServer

pytestmark = pytest.mark.timeout(60)

DAY = 86400.0


def _spec(job_id: str, package_uri: str = "") -> JobSpec:
    return JobSpec(job_id, "a", 0, "custom", Resources(cpus=1), job_id, "python job.py", {},
                   package_uri=package_uri)


def _queue(tmp_path: Path, server: FakeJobServer, clock: list[float]) -> JobQueue:
    return JobQueue(Store(f"sqlite:///{tmp_path / 'q.db'}"), server, clock=lambda: clock[0])


def _run_to_the_end(queue: JobQueue, server: FakeJobServer, job_id: str) -> None:
    assert queue.tick() == [job_id]
    server.exit(server.submitted[-1], 0)
    queue.tick()


def test_an_id_the_job_server_already_has_is_refused_not_adopted(tmp_path: Path) -> None:
    server, clock = FakeJobServer(), [100.0]
    server.jobs["raydeck-run1"] = "FAILED"  # started outside the queue
    queue = _queue(tmp_path, server, clock)
    with pytest.raises(ConfigError, match=r"^job raydeck-run1: the job server already has a "
                                          r"job raydeck-run1 \(FAILED\) that the queue did "
                                          r"not start; queue it under another id"):
        queue.submit(_spec("raydeck-run1"))
    assert queue.listing() == [] and queue.tick() == []


def test_an_ended_jobs_id_is_queued_again_under_a_new_submission_id(tmp_path: Path) -> None:
    server, clock = FakeJobServer(), [100.0]
    queue = _queue(tmp_path, server, clock)
    queue.submit(_spec("nightly"))
    with pytest.raises(ConfigError, match=r"^job nightly is already in the queue \(queued\); "
                                          r"`raydeck cancel nightly` takes it out"):
        queue.submit(_spec("nightly"))
    _run_to_the_end(queue, server, "nightly")
    again = queue.submit(_spec("nightly"))
    assert (again.state, again.submission_id) == ("queued", "nightly-r1")
    _run_to_the_end(queue, server, "nightly")
    assert server.submitted == ["nightly", "nightly-r1"]
    queue.submit(_spec("nightly"))  # ended again: once more, as the next submission id
    assert queue.tick() == ["nightly"] and server.submitted[-1] == "nightly-r2"


def test_ended_jobs_and_unused_packages_are_deleted_after_the_retention(
        tmp_path: Path) -> None:
    server, clock = FakeJobServer(), [100.0]
    queue = _queue(tmp_path, server, clock)
    queue.submit(_spec("old", "gcs://_ray_pkg_old.zip"), b"old zip")
    _run_to_the_end(queue, server, "old")
    clock[0] += RETENTION_S - DAY
    queue.submit(_spec("recent", "gcs://_ray_pkg_recent.zip"), b"recent zip")
    _run_to_the_end(queue, server, "recent")
    queue.submit(_spec("waiting", "gcs://_ray_pkg_waiting.zip"), b"waiting zip")
    clock[0] += 2 * DAY + 1  # past "old"'s retention, within "recent"'s; the hourly prune is due
    queue.tick()
    store = Store(f"sqlite:///{tmp_path / 'q.db'}")
    assert store.get("old") is None and store.package("gcs://_ray_pkg_old.zip") is None
    assert store.get("recent") is not None and store.package("gcs://_ray_pkg_recent.zip")
    assert store.get("waiting") is not None and store.package("gcs://_ray_pkg_waiting.zip")
    # A queue starting now replays only what ended within REPLAY_S.
    assert [r.id for r in store.ended_since(clock[0] - REPLAY_S)] == []
    assert [r.id for r in store.ended_since(clock[0] - 3 * DAY)] == ["recent"]


def test_fair_share_survives_history_out_of_order_by_any_number_of_half_lives(
        tmp_path: Path) -> None:
    policy = FairShare(half_life_s=1.0)
    job = QueuedJob("j", "a", 0, Resources(cpus=1), 0.0, 1.0)
    policy.ended(RunningJob(job, 1e9 - 10), 1e9)
    policy.ended(RunningJob(job, 0.0), 10.0)  # ended 1e9 half-lives earlier: used to overflow
    assert policy.usage("a", 1e9) == pytest.approx(10.0 * job.needs.weight())
    assert math.isfinite(policy.usage("a", 0.0))  # a clock read out of order neither
    # The queue starts over such history (its replay is by submission time, not end time).
    store = Store(f"sqlite:///{tmp_path / 'q.db'}")
    server, clock = FakeJobServer(), [REPLAY_S]
    queue = _queue(tmp_path, server, clock)
    queue.configure(Identity.here(), "fairshare")
    for job_id, submitted, ended in (("late", 0.0, REPLAY_S - 1), ("early", 1.0, 2.0)):
        queue.submit(_spec(job_id))
        store.update(job_id, state="succeeded", submitted_at=submitted, started_at=submitted,
                     ended_at=ended)
    assert _queue(tmp_path, server, clock).listing() == []
