"""Issue 28: ``gittins`` in the real queue ranks jobs by the durations of finished runs in
MLflow (a real MLflow server): the job key's own runs when it has them, the cluster's
otherwise, read outside the queue's lock (at a submission, and at a tick for jobs never read)
and kept (:class:`~raydeck.scheduling.queue.history.CachedHistory`). The job server is the fake."""

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
