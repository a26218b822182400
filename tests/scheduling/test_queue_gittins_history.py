"""Issue 28: ``gittins`` in the real queue ranks jobs by the durations of finished runs in
MLflow (a real MLflow server): the job key's own runs when it has them, the cluster's
otherwise, read outside the queue's lock (at a submission, and at a tick for jobs never read)
and kept (:class:`~raydeck.scheduling.queue.history.CachedHistory`). Issue 52: the service each job
attained and the history ``las``' levels adapt to are in the queue's database, so a configure or
a restarted queue ranks as before. The job server is the fake."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from raydeck._internal.contract import JOB_DIGEST_TAG, PREEMPTIONS_TAG
from raydeck.scheduling.policies.core import Resources
from raydeck.scheduling.queue.history import CachedHistory, MlflowHistory
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.job_queue import JobQueue, JobSpec
from raydeck.scheduling.queue.store import Store
from tests.fixtures.fake_job_server import FakeJobServer
from tests.fixtures.mlflow_server import MlflowServer

pytestmark = pytest.mark.timeout(90)


def _spec(job_id: str, key: str) -> JobSpec:
    # Each needs the fake server's whole node: one runs at a time.
    return JobSpec(job_id, "a", 0, "custom", Resources(cpus=4), key, "python job.py", {})


def _finished_run(client: Any, experiment: str, key: str, seconds: float,
                  preempted: bool = False) -> None:
    tags = {JOB_DIGEST_TAG: key, **({PREEMPTIONS_TAG: "1"} if preempted else {})}
    run = client.create_run(experiment, start_time=1_000_000, tags=tags)
    client.set_terminated(run.info.run_id, "FINISHED", end_time=1_000_000 + int(seconds * 1000))


def _queued_order(queue: JobQueue) -> list[str]:
    return [e.job.id for e in queue.listing() if e.position is not None]


def test_gittins_ranks_by_each_jobs_mlflow_history_and_the_cluster_otherwise(
        tmp_path: Path, mlflow_server: MlflowServer, mlflow_client: Any) -> None:
    short, long, unknown = (uuid.uuid4().hex for _ in range(3))
    experiment = mlflow_client.create_experiment(f"gittins-{short[:8]}")
    for _ in range(2):
        _finished_run(mlflow_client, experiment, short, 50)
        _finished_run(mlflow_client, experiment, long, 5000)
    # A preempted run's span includes its wait in the queue: never a duration.
    _finished_run(mlflow_client, experiment, short, 100_000, preempted=True)
    history = MlflowHistory(mlflow_server.uri)
    store, server = Store(f"sqlite:///{tmp_path / 'q.db'}"), FakeJobServer()
    queue = JobQueue(store, server, history=history, cluster=history.cluster)
    queue.configure(Identity.here(), "gittins")
    queue.submit(_spec("blocker", "not-a-job-key"))
    assert queue.tick() == ["blocker"]
    for job_id, key in (("long", long), ("short", short), ("new", unknown)):
        queue.submit(_spec(job_id, key))  # each submission reads its key's runs
    # FIFO would say long, short, new. Short's own runs rank it ahead of long; new, without
    # runs of its own, is ranked on the cluster's (ours and the session's other jobs': all
    # shorter on average than long's, so it is ahead of long too).
    queue.tick()  # reads the cluster's runs
    cluster = history.cluster()
    assert 50.0 in cluster and 5000.0 in cluster and 100_000.0 not in cluster
    assert set(_queued_order(queue)[:2]) == {"short", "new"}
    assert _queued_order(queue)[2] == "long"
    # A restarted queue has read nothing yet: its first tick reads the queued jobs' keys.
    restarted = JobQueue(store, server, history=history, cluster=history.cluster)
    restarted.cancel("new", Identity.here())
    assert _queued_order(restarted) == ["long", "short"]  # nothing read: first come first
    restarted.tick()
    assert _queued_order(restarted) == ["short", "long"]
    blocker = store.get("blocker")
    assert blocker is not None
    server.exit(blocker.submission_id, 0)
    assert restarted.tick() == ["short"]

def test_the_cache_keeps_what_it_read_when_mlflow_fails() -> None:
    answers: dict[str, list[float]] = {"k": [30.0, 10.0]}
    cluster = [[20.0, 5.0]]
    now = [0.0]

    def read(key: str) -> list[float]:
        return answers[key]  # KeyError: MLflow down

    def read_cluster() -> list[float]:
        return cluster.pop()  # IndexError after the first read: MLflow down

    cache = CachedHistory(read, read_cluster, clock=lambda: now[0], ttl_s=60)
    assert (cache.runs("k"), cache.cluster()) == ([], [])  # nothing asked yet
    cache.refresh(["k"])
    assert (cache.runs("k"), cache.cluster()) == ([10.0, 30.0], [5.0, 20.0])
    answers.clear()
    now[0] = 61.0  # the cluster is stale: read again, fails, keeps the old
    cache.refresh(["k"])  # "k" was read: not asked again
    assert (cache.runs("k"), cache.cluster()) == ([10.0, 30.0], [5.0, 20.0])
    answers["j"] = [7.0]
    cache.refresh(["j"])  # within ttl_s of the failure: nothing asked
    assert cache.runs("j") == []
    now[0] = 122.0
    cluster.append([1.0])
    cache.refresh(["j"])
    assert (cache.runs("j"), cache.cluster()) == ([7.0], [1.0])
    with pytest.raises(KeyError):
        cache("k")  # a submission's read raises for predict's fallback; the old stays
    assert cache.runs("k") == [10.0, 30.0]


# Issue 52: attained service and the history las' levels adapt to are the queue's store's.

def _cpu_job(job_id: str) -> JobSpec:
    # The fake server's whole node: one at a time, the service in CPU-seconds (4 a second).
    return JobSpec(job_id, "a", 0, "custom", Resources(cpus=4), job_id, "python job.py", {})


def _ranks(queue: JobQueue) -> list[tuple[str, str]]:
    return [(e.job.id, e.rank) for e in queue.listing() if e.position is not None]


def _attained(store: Store, job_id: str) -> float:
    row = store.get(job_id)
    assert row is not None
    return row.attained_s


def _checkpointed(queue: JobQueue, store: Store, job_id: str) -> bool:
    row = store.get(job_id)
    assert row is not None
    return queue.checkpointed(job_id, row.token)


@pytest.mark.timeout(30)
def test_attained_service_outlives_a_configure_and_a_restarted_queue(tmp_path: Path) -> None:
    """A job preempted past las' first level keeps its service: a configure (a new policy) and
    a new queue on the same database (the actor restarted) still rank it behind a newer job,
    where a policy that kept it in memory put it back in the first level, ahead by FIFO."""
    path, server, clock = tmp_path / "q.db", FakeJobServer(), [1e6]
    store = Store(f"sqlite:///{path}")
    queue = JobQueue(store, server, clock=lambda: clock[0])
    queue.configure(Identity.here(), "las", thresholds_s=(60.0, 600.0))
    queue.submit(_cpu_job("long"))
    assert queue.tick() == ["long"]
    clock[0] += 20.0  # 80 CPU-s: past 60
    assert _checkpointed(queue, store, "long") is False
    queue.submit(_cpu_job("short"))
    assert queue.tick() == [] and _checkpointed(queue, store, "long") is True
    server.exit("long", 75)
    assert queue.tick() == ["short"]
    clock[0] += 1.0
    queue.submit(_cpu_job("new"))
    assert _ranks(queue) == [("new", "Q0 of 3"), ("long", "Q1 of 3")]
    queue.configure(Identity.here(), aging_s=7200.0)
    assert _ranks(queue) == [("new", "Q0 of 3"), ("long", "Q1 of 3")]
    restarted = JobQueue(Store(f"sqlite:///{path}"), server, clock=lambda: clock[0])
    assert _ranks(restarted) == [("new", "Q0 of 3"), ("long", "Q1 of 3")]
    assert _attained(store, "long") == 80.0  # in the job's row
    server.exit("short", 0)
    assert restarted.tick() == ["new"]
    server.exit("new", 0)
    assert restarted.tick() == ["long"]
    clock[0] += 10.0
    long = store.get("long")
    assert long is not None
    server.exit(long.submission_id, 0)
    restarted.tick()
    assert _attained(store, "long") == 80.0 + 40.0  # both attempts, never less
    # The history: short's 1 s, long's total (new held nothing: the clock stood still).
    assert store.services() == [4.0, 120.0]


@pytest.mark.timeout(30)
def test_las_levels_adapt_to_the_queues_ended_jobs_and_explicit_ones_win(
        tmp_path: Path) -> None:
    """By default las' levels are quantiles of the services of the jobs the queue saw end (its
    database's); ``--thresholds`` pins them; the title says which."""
    store, server, clock = Store(f"sqlite:///{tmp_path / 'q.db'}"), FakeJobServer(), [1e6]
    queue = JobQueue(store, server, clock=lambda: clock[0])
    queue.configure(Identity.here(), "las")
    assert queue.describe() == ("policy las; aging 1h; thresholds adaptive: 1h,10h GPU-time "
                                "until 20 jobs have ended (0 have); min run 10m")
    for minute in range(1, 21):  # 20 jobs of 1 to 20 CPU-minutes
        queue.submit(_cpu_job(f"done-{minute}"))
        assert queue.tick() == [f"done-{minute}"]
        clock[0] += 15.0 * minute  # 4 CPUs
        server.exit(f"done-{minute}", 0)
    queue.tick()
    assert store.services() == [60.0 * minute for minute in range(1, 21)]
    restarted = JobQueue(store, server, clock=lambda: clock[0])
    assert restarted.describe() == ("policy las; aging 1h; thresholds adaptive: 19m,20m "
                                    "GPU-time; min run 10m")
    restarted.submit(_cpu_job("long"))
    assert restarted.tick() == ["long"]
    clock[0] += 290.0  # 19.3 CPU-minutes: a long job here, not under 1 CPU-hour levels
    assert [e.rank for e in restarted.listing() if e.job.id == "long"] == ["Q1 of 3"]
    restarted.configure(Identity.here(), thresholds_s=(3600.0, 36000.0))
    assert restarted.describe() == "policy las; aging 1h; thresholds 1h,10h GPU-time; min run 10m"
    assert [e.rank for e in restarted.listing() if e.job.id == "long"] == ["Q0 of 3"]
