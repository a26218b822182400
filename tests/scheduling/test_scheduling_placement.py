"""Placement-aware admission: where a gang's workers go on each node's free resources, which
queued jobs a policy starts on a fragmented cluster, the queue starting a strict gang alone
(Ray chooses the nodes), and a queue database from before the gang columns opening with every
job kept. Cases computed by hand; Ray's own placement of the same
gangs is checked on a real two-node fake-GPU cluster in ``test_scaling_gpu_packing``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection
from pathlib import Path

import pytest

from raydeck.errors import ConfigError
from raydeck.scheduling.policies.core import Capacity, Fifo, Gang, QueuedJob, Resources
from raydeck.scheduling.policies.registry import make_policy
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.job_queue import JobQueue, JobSpec, Launcher
from raydeck.scheduling.queue.launcher import JobState
from raydeck.scheduling.queue.reconcile import CLAIM_S
from raydeck.scheduling.queue.store import JobRow, Store
from raydeck.train.feasibility import place

pytestmark = pytest.mark.timeout(60)

HALF_GPU = {"CPU": 1.0, "GPU": 0.5}


def _nodes(*free: tuple[float, float]) -> list[dict[str, float]]:
    return [{"CPU": cpus, "GPU": gpus} for cpus, gpus in free]


def test_strict_pack_takes_the_fullest_node_that_holds_the_whole_gang() -> None:
    nodes = _nodes((8, 3), (4, 2), (8, 1))
    # Nodes 0 (room for 6) and 1 (room for 4) hold four half-GPU workers: node 1 (best fit).
    assert place(HALF_GPU, 4, "STRICT_PACK", nodes) == [1, 1, 1, 1]
    assert place(HALF_GPU, 5, "STRICT_PACK", nodes) == [0] * 5
    assert place(HALF_GPU, 7, "STRICT_PACK", nodes) is None


def test_strict_spread_needs_a_node_each_and_pack_and_spread_take_any_room() -> None:
    nodes = _nodes((4, 2), (4, 0.5), (4, 0))
    assert place(HALF_GPU, 2, "STRICT_SPREAD", nodes) == [0, 1]
    assert place(HALF_GPU, 3, "STRICT_SPREAD", nodes) is None
    # PACK fills the roomiest node first; SPREAD takes one per node in turn.
    assert place(HALF_GPU, 5, "PACK", nodes) == [0, 0, 0, 0, 1]
    assert place(HALF_GPU, 3, "SPREAD", nodes) == [0, 0, 1]
    assert place(HALF_GPU, 6, "PACK", nodes) is None


def test_quarter_gpu_shares_pack_onto_a_partly_used_gpu() -> None:
    # Half of one GPU is used: its other half takes two quarter workers, the free GPU four.
    quarter = {"CPU": 1.0, "GPU": 0.25}
    assert place(quarter, 6, "STRICT_PACK", _nodes((8, 1.5))) == [0] * 6
    assert place(quarter, 7, "STRICT_PACK", _nodes((8, 1.5))) is None
    # A whole-GPU worker still finds the whole free GPU.
    assert place({"CPU": 1.0, "GPU": 1.0}, 1, "STRICT_PACK", _nodes((8, 1.5))) == [0]


def _job(job_id: str, gang: Gang | None, submitted_s: float = 0.0) -> QueuedJob:
    needs = gang.needs if gang else Resources(cpus=4, gpus=2)
    return QueuedJob(job_id, "a", 0, needs, submitted_s, 60.0, gang)


STRICT = Gang(4, Resources(cpus=1, gpus=0.5), "STRICT_PACK")
PACKED = Gang(4, Resources(cpus=1, gpus=0.5), "PACK")


def test_a_gang_that_fits_the_free_total_but_no_node_waits_and_blocks_fifo() -> None:
    # One GPU free on each of two nodes: two GPUs in total, but no node holds four halves.
    free = Capacity(Resources(cpus=8, gpus=2), (Resources(4, 1), Resources(4, 1)))
    total = Resources(cpus=8, gpus=4)
    assert not free.fits(_job("strict", STRICT))
    assert free.fits(_job("packed", PACKED)) and free.fits(_job("anywhere", None))
    # FIFO: the strict gang at the head waits, and nothing behind it jumps ahead.
    queue = [_job("strict", STRICT, 0.0), _job("packed", PACKED, 1.0)]
    assert Fifo().decide(queue, [], free, total, now=2.0) == []
    # Without node information (the simulator) the pool alone decides.
    assert [j.id for j in Fifo().decide(queue, [], Capacity(free.pool), total, 2.0)] == [
        "strict"]


def test_jobs_started_in_one_decision_take_their_nodes_room() -> None:
    free = Capacity(Resources(cpus=8, gpus=4), (Resources(4, 2), Resources(4, 2)))
    queue = [_job(f"strict-{i}", STRICT, float(i)) for i in range(3)]
    started = make_policy("fifo").decide(queue, [], free, Resources(8, 4), now=5.0)
    assert [j.id for j in started] == ["strict-0", "strict-1"]
    after_first = free.after(started[0])
    assert after_first is not None
    left = after_first.after(started[1])
    assert left is not None and left.pool == Resources(0, 0)
    assert left.nodes == (Resources(0, 0), Resources(0, 0))


def test_a_gang_names_its_bad_field() -> None:
    with pytest.raises(ConfigError, match="workers=0"):
        Gang(0, Resources(cpus=1))
    with pytest.raises(ConfigError, match="placement 'STRICT' is not one of"):
        Gang(2, Resources(cpus=1), "STRICT")


def test_a_queue_database_from_before_the_gang_columns_keeps_its_jobs(tmp_path: Path) -> None:
    path = tmp_path / "queue.db"
    with sqlite3.connect(path) as db:  # the table as raydeck created it before preemption
        db.execute(
            "CREATE TABLE raydeck_queue_jobs (id VARCHAR(160) PRIMARY KEY, team VARCHAR(64), "
            "priority INTEGER, cpus FLOAT, gpus FLOAT, preset VARCHAR(64), key VARCHAR(64), "
            "entrypoint TEXT, runtime_env TEXT, metadata_json TEXT, package_uri VARCHAR(200), "
            "estimate_s FLOAT, state VARCHAR(16), reason TEXT, submitted_at FLOAT, "
            "started_at FLOAT, ended_at FLOAT)")
        db.execute("INSERT INTO raydeck_queue_jobs VALUES ('old', 'a', 1, 4, 2, 'gpu-pack', 'k', "
                   "'python x.py', '{}', '{}', '', 60, 'queued', '', 1.0, NULL, NULL)")
    store = Store(f"sqlite:///{path}")
    (old,) = store.jobs("queued")
    assert (old.id, old.workers, old.placement, old.attempt, old.preemptions) == (
        "old", 0, "", 0, 0)
    store.update("old", workers=4, placement="PACK")
    reopened = Store(f"sqlite:///{path}").get("old")
    assert reopened is not None and (reopened.workers, reopened.placement) == (4, "PACK")


class _TwoNodes(Launcher):
    """A job server on two nodes: a job takes its room on a node only once the test says Ray
    placed it (as a driver creates its placement group seconds after it started)."""

    def __init__(self) -> None:
        # A job outside the queue holds 6 of node 0's 8 CPUs.
        self.free = [Resources(cpus=2), Resources(cpus=4)]
        self.running: list[str] = []
        self.placed_jobs: set[str] = set()

    def submit(self, row: JobRow, package: bytes | None) -> None:
        self.running.append(row.id)

    def statuses(self, submission_ids: Collection[str]) -> dict[str, JobState]:
        return {s: JobState("RUNNING") for s in submission_ids if s in self.running}

    def log_tail(self, submission_id: str) -> str:
        return ""

    def stop(self, submission_id: str) -> None:
        raise AssertionError("nothing is stopped here")

    def resources(self) -> tuple[tuple[Resources, ...], tuple[Resources, ...]]:
        return tuple(self.free), (Resources(cpus=8), Resources(cpus=4))

    def placed(self, submission_id: str) -> bool:
        return submission_id in self.placed_jobs

    def place(self, job_id: str, node: int, cpus: float) -> None:
        self.placed_jobs.add(job_id)
        self.free[node] = self.free[node] - Resources(cpus=cpus)


def _spec(job_id: str, gang: Gang, priority: int = 0) -> JobSpec:
    return JobSpec(job_id, "a", priority, "custom", gang.needs, job_id, "python job.py", {},
                   gang=gang)


STRICT_3 = Gang(2, Resources(cpus=1.5), "STRICT_PACK")
ONE_CPU = Gang(1, Resources(cpus=1))


def test_a_strict_gang_starts_alone_and_what_follows_waits_until_ray_placed_it(
        tmp_path: Path) -> None:
    """Two nodes with 2 and 4 CPUs free: the strict gang (2 x 1.5 CPU) fits only node 1. Started
    beside it, two 1-CPU jobs could be put there by Ray first (it chooses the nodes), and the
    gang would wait in Ray: they start only once Ray has placed the gang."""
    cluster, clock = _TwoNodes(), [0.0]
    queue = JobQueue(Store(f"sqlite:///{tmp_path / 'q.db'}"), cluster, clock=lambda: clock[0])
    queue.configure(Identity.here(), "priority")
    for spec in (_spec("big", STRICT_3, priority=5), _spec("s1", ONE_CPU), _spec("s2", ONE_CPU)):
        queue.submit(spec)
    assert queue.tick() == ["big"]
    clock[0] = 10.0
    assert queue.tick() == []  # not placed yet
    why = {entry.job.id: entry.why for entry in queue.listing()}
    assert why["s1"] == "waits for Ray to place big first (a STRICT_ gang starts alone)"
    assert why["s2"] == "behind s1 (priority order)"
    cluster.place("big", node=1, cpus=3)
    assert queue.tick() == ["s1", "s2"]


def test_a_strict_gang_waits_for_the_jobs_started_before_it_to_be_placed(
        tmp_path: Path) -> None:
    cluster, clock = _TwoNodes(), [0.0]
    queue = JobQueue(Store(f"sqlite:///{tmp_path / 'q.db'}"), cluster, clock=lambda: clock[0])
    queue.configure(Identity.here(), "fifo")
    queue.submit(_spec("s1", ONE_CPU))
    assert queue.tick() == ["s1"]
    queue.submit(_spec("big", STRICT_3))
    clock[0] = 10.0
    assert queue.tick() == []  # s1 may still land on node 1 and take the gang's room
    cluster.place("s1", node=0, cpus=1)
    assert queue.tick() == ["big"]
    # A job that never asks Ray for a placement group holds the next one back CLAIM_S at most.
    queue.submit(_spec("s2", ONE_CPU))
    clock[0] = 10.0 + CLAIM_S - 1
    assert queue.tick() == []
    clock[0] = 10.0 + CLAIM_S
    assert queue.tick() == ["s2"]
