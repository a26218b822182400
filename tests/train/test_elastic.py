"""Elastic training: a preset may name a worker range, Ray Train runs the job at the size the
cluster has room for, and the MLflow run records the world size each epoch was trained at.

The unit tests check the preset rules (validation, feasibility at the minimum, the range in
tables) without a cluster. The cluster test joins a node to the session's cluster and runs the
reference digits job with a preset of one to four three-CPU workers, one per node: four could
never start, the elastic job starts with the two the cluster holds and records that world size;
then the node is removed under it, and Ray Train restarts the job smaller from its committed
checkpoint with nothing lost or logged twice; the node is gone again afterwards. (One job proves
both: an earlier separate run at the size that fits, on the session's head alone, proved
nothing this one does not, for about 30 s.)

What Ray 2.60's elastic policy sizes by: the nodes' *total* resources, shared among the jobs that
ask Ray's AutoscalingCoordinator (elastic Train jobs, Ray Data), not what other work holds now.
A job started while a placement group held 3 of the 4 CPUs still asked for 2 workers and waited
out Ray Train's worker-group start timeout (60 s) again and again, so the test sizes by totals.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raydeck.errors import InfeasibleResourcesError, PresetError
from raydeck.scheduling.policies.core import Gang
from raydeck.tracking.proxy.cross_rank import CrossRank
from raydeck.train.feasibility import check_feasible
from raydeck.train.presets import Preset, get_preset, load_presets, presets_markdown
from tests.fixtures.processes import ManagedProcess, wait_until
from tests.fixtures.ray_head import (
    HEAD_STARTUP_TIMEOUT_S,
    MARKER_ENV,
    SLOW_MACHINE_ENV,
    WORKER_NODE_ATTEMPTS,
    joined,
    new_marker,
    reap,
    worker_node_process,
)
from tests.train.test_fault_tolerance import LATEST_EPOCH_TAG, RESUMED_TAG, run_through_a_fault

WORLD_SIZE_METRIC = "raydeck/world_size"
# One worker per node: three CPUs a worker, the session's head has 4 and the joined node 3, so
# two of the preset's up to four fit.
NODE_CPUS = 3
SPREAD_PRESET = (f"spread-1-4:\n  num_workers: [1, 4]\n  cpus_per_worker: {NODE_CPUS}\n"
                 "  placement_strategy: SPREAD\n")
WORKERS_THAT_FIT = 2
# One epoch before the node goes, the one it interrupts (trained again), one after.
SHRINK_EPOCHS = 3
SHRINK_RUN_TIMEOUT_S = 240.0


@pytest.mark.timeout(60)
def test_an_elastic_preset_maps_to_rays_elastic_scaling_config() -> None:
    preset = get_preset("cpu-1-2")
    assert (preset.elastic, preset.min_workers, preset.max_workers) == (True, 1, 2)
    config = preset.scaling_config()
    assert config.num_workers == (1, 2) and config.elasticity_enabled
    fixed = get_preset("cpu-2")
    assert (fixed.elastic, fixed.min_workers, fixed.max_workers) == (False, 2, 2)
    assert not fixed.scaling_config().elasticity_enabled


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("num_workers", "message"), [
    ((0, 2), r"num_workers=\[0, 2\]: min_workers=0 must be >= 1"),
    ((3, 2), r"num_workers=\[3, 2\]: min_workers=3 must be <= max_workers=2; write \[2, 3\]"),
    ((1, 2, 3), r"num_workers=\[1, 2, 3\] must be a worker count or a range \[min_workers, "
                r"max_workers\]"),
    ((1, 2.5), r"num_workers=\[1, 2.5\] must be a worker count or a range"),
    ("2", r"num_workers='2' must be an integer or a range \[min_workers, max_workers\]"),
])
def test_a_bad_worker_range_names_the_field_and_the_fix(num_workers: Any, message: str) -> None:
    with pytest.raises(PresetError, match=rf"^preset 'bad': {message}"):
        Preset("bad", num_workers)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("suffix", [".yaml", ".toml"])
def test_a_presets_file_names_a_range_as_a_list(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"presets{suffix}"
    path.write_text("team-elastic:\n  num_workers: [2, 8]\n" if suffix == ".yaml"
                    else "[team-elastic]\nnum_workers = [2, 8]\n")
    preset = load_presets(path)["team-elastic"]
    assert preset.num_workers == (2, 8) and preset.workers_label == "2-8"
    path.write_text("team-elastic:\n  num_workers: [8, 2]\n" if suffix == ".yaml"
                    else "[team-elastic]\nnum_workers = [8, 2]\n")
    with pytest.raises(PresetError, match="min_workers=8 must be <= max_workers=2"):
        load_presets(path)


NODES = [{"CPU": 4.0}, {"CPU": 4.0}]


@pytest.mark.timeout(60)
def test_an_elastic_preset_is_feasible_when_its_minimum_is() -> None:
    # The maximum (16) is more than the cluster ever has; the minimum fits: Ray Train starts
    # with what there is room for.
    preset = Preset("wide", (2, 16))
    answer = check_feasible(preset, node_totals=NODES, node_available=NODES)
    assert answer.runs_now
    assert answer.message.startswith("at least 2 (up to 16) worker(s) x (1 CPU), PACK")
    busy = [{"CPU": 1.0}, {"CPU": 0.0}]
    assert not check_feasible(preset, node_totals=NODES, node_available=busy).runs_now
    with pytest.raises(InfeasibleResourcesError, match=r"asks for at least 9 \(up to 16\)"):
        check_feasible(Preset("too-wide", (9, 16)), node_totals=NODES, node_available=NODES)


@pytest.mark.timeout(60)
def test_tables_show_the_range_and_the_queue_admits_an_elastic_gang_at_its_minimum() -> None:
    assert "| `cpu-1-2` | 1-2 | 1 |" in presets_markdown()
    assert "| `cpu-2` | 2 | 1 |" in presets_markdown()
    # The queue admits an elastic job when its minimum fits
    # (tests/scheduling/test_queue_elastic.py).
    gang = Gang.of(get_preset("cpu-1-4"))
    assert (gang.workers, gang.max_workers, gang.elastic) == (1, 4, True)
    assert (Gang.of(get_preset("cpu-2")).max_workers, Gang.of(get_preset("cpu-2")).elastic) == (
        0, False)


@pytest.mark.timeout(60)
def test_cross_rank_views_aggregate_the_ranks_of_the_group_that_trained_a_step() -> None:
    views = CrossRank()
    # Two ranks trained step 3; rank 1's value never came (its worker was lost).
    assert views.feed("run", [("loss/rank_0", 1.0, 10, 3)], rank=0, world_size=2) == []
    # The job restarted with one worker, which trains step 3 again: its view is its own,
    # never mixed with the lost group's rank 0.
    done = views.feed("run", [("loss/rank_0", 5.0, 20, 3)], rank=0, world_size=1)
    assert done == [("loss/mean", 5.0, 20, 3), ("loss/min", 5.0, 20, 3),
                    ("loss/max", 5.0, 20, 3), ("loss/straggler_rank", 0.0, 20, 3)]


def _history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


# Ray Train waits this long for a worker group's placement group before it tries again at the
# size the cluster then has (Ray's default: 60 s); see below why a restart waits for it.
PLACEMENT_WAIT_S = "10"


def _alive_nodes() -> int:
    import ray

    return sum(1 for node in ray.nodes() if node["Alive"])


def _refresh_elastic_view() -> None:
    """Make the cluster's AutoscalingCoordinator read the nodes now.

    Ray 2.60's elastic policy sizes a job by this actor's view of the nodes, which it refreshes
    every 20 s (``_AutoscalingCoordinatorActor.TICK_INTERVAL_S``); a job started within 20 s of
    a node joining would start without it. ``recompute=True`` is the coordinator's own way to
    refresh at once (Ray Data internals: the test uses it, raydeck does not).
    """
    import ray
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    ray.get(get_or_create_autoscaling_coordinator().get_reserved_resources.remote(
        "raydeck-test-node-view", recompute=True), timeout=60)


@pytest.fixture
def joined_node(ray_cluster: None, tmp_path: Path) -> Iterator[ManagedProcess]:
    """A second node (3 CPUs) joined to the session's cluster with ``ray start --address``, as
    a second machine would; the test may stop it. After the test the session's cluster is its
    head alone again, and nothing the node started is left."""
    import ray

    # `ray start` records the cluster it joined in /tmp/ray/ray_current_cluster, where Ray's rule
    # for `ray.init()` without an address finds it: a later test's `raydeck demo` would join the
    # session's cluster instead of starting its own, and after the session a dead address
    # would make every plain `ray.init()` on the machine wait for it. Put back as it was.
    address_file = Path("/tmp/ray/ray_current_cluster")
    recorded = address_file.read_text() if address_file.exists() else None
    marker = new_marker()
    started: list[ManagedProcess] = []
    try:
        for attempt in range(1, WORKER_NODE_ATTEMPTS + 1):
            started.append(worker_node_process(
                ray.get_runtime_context().gcs_address, NODE_CPUS,
                {**os.environ, **SLOW_MACHINE_ENV, MARKER_ENV: marker},
                tmp_path / f"ray-node-{attempt}.log",
            ).start())
            if joined(started[-1], lambda: _alive_nodes() == 2, marker, 1,
                      "the second node to join"):
                break
            started[-1].stop()
            reap(marker)
        node = started[-1]
        assert node.alive() and _alive_nodes() == 2, node.log_tail()
        _refresh_elastic_view()
        yield node
    finally:
        for node in started:
            node.stop()
        reap(marker)
        if recorded is None:
            address_file.unlink(missing_ok=True)
        else:
            address_file.write_text(recorded)
        wait_until(lambda: _alive_nodes() == 1, HEAD_STARTUP_TIMEOUT_S,
                   "the session's cluster to be its head alone again", interval_s=0.5)
        _refresh_elastic_view()  # the next elastic job sizes by the head alone


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_node_removed_under_an_elastic_job_shrinks_it_and_loses_nothing(
    joined_node: ManagedProcess, mlflow_client: Any, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job starts with the workers that fit (two of up to four); Ray Train restarts the
    group at the size the remaining nodes hold, from the latest committed checkpoint, in the
    same MLflow run; every epoch is logged once, with the world size it was trained at.

    The restart first asks for the old size: the elastic policy's view of the nodes is up to
    20 s old (see :func:`_refresh_elastic_view`), so it still counts the removed node, and the
    two-worker placement group waits ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` before Ray Train
    tries again with what it then sees. The driver's value reaches Ray Train's controller.
    """
    from raydeck.examples.digits import run_digits

    presets = tmp_path / "presets.yaml"
    presets.write_text(SPREAD_PRESET)
    monkeypatch.setenv("RAYDECK_PRESETS_FILE", str(presets))
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", PLACEMENT_WAIT_S)
    with pytest.raises(InfeasibleResourcesError):
        check_feasible(get_preset("spread-1-4", presets).with_workers(4))
    key = f"elastic-shrink-{uuid.uuid4().hex[:8]}"
    shrunk = run_through_a_fault(
        mlflow_client, key, lambda: run_digits(preset="spread-1-4",
                                               config={"epochs": SHRINK_EPOCHS},
                                               run_name="elastic-shrink", run_id=key),
        0, joined_node.stop, SHRINK_RUN_TIMEOUT_S)
    committed, resumed_from = shrunk.committed_before_fault, shrunk.resumed_from
    print(f"\nelastic shrink: node removed after committed epoch {committed}; training restarted "
          f"with the remaining node from epoch {resumed_from} {shrunk.fault_to_resume_s:.1f} s "
          f"after the removal; job {shrunk.wall_s:.0f} s")

    run = shrunk.run
    assert run is not None and run.info.run_id == shrunk.result.run_id
    assert run.info.status == "FINISHED"
    assert run.data.params["num_workers"] == "1-4"
    assert committed <= resumed_from <= committed + 1 < SHRINK_EPOCHS
    assert run.data.tags[LATEST_EPOCH_TAG] == str(SHRINK_EPOCHS - 1)
    assert run.data.tags[RESUMED_TAG] == str(resumed_from)
    for metric in ("train_loss", "val_loss", "val_accuracy", WORLD_SIZE_METRIC):
        assert [step for step, _ in _history(mlflow_client, run.info.run_id, metric)] == list(
            range(SHRINK_EPOCHS)), metric
    # The two workers that fit up to the checkpoint it resumed from, one from there on.
    assert _history(mlflow_client, run.info.run_id, WORLD_SIZE_METRIC) == [
        (epoch, float(WORKERS_THAT_FIT) if epoch <= resumed_from else 1.0)
        for epoch in range(SHRINK_EPOCHS)]
