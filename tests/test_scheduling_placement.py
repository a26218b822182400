"""Placement-aware admission: where a gang's workers go on each node's free resources, which
queued jobs a policy starts on a fragmented cluster, and a queue database from before the gang
columns opening with every job kept. Cases computed by hand; Ray's own placement of the same
gangs is checked on a real two-node fake-GPU cluster in ``test_scaling_gpu_packing``.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from raydeck.errors import ConfigError
from raydeck.scaling import place
from raydeck.scheduling.policies import Capacity, Fifo, Gang, QueuedJob, Resources, make_policy
from raydeck.scheduling.store import Store

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
