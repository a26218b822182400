"""Elastic training: a preset may name a worker range, Ray Train runs the job at the size the
cluster has room for, and the MLflow run records the world size each epoch was trained at.

The unit tests check the preset rules (validation, feasibility at the minimum, the range in
tables) without a cluster. The cluster test runs the reference digits job on the session's Ray
cluster (4 CPUs) with a preset of one to four two-CPU workers: a fixed four-worker preset could
never start, the elastic one runs with the two workers the cluster holds.

What Ray 2.60's elastic policy sizes by: the nodes' *total* resources, shared among the jobs that
ask Ray's AutoscalingCoordinator (elastic Train jobs, Ray Data), not what other work holds now.
A job started while a placement group held 3 of the 4 CPUs still asked for 2 workers and waited
out Ray Train's worker-group start timeout (60 s) again and again, so the test sizes by totals.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from raydeck.errors import InfeasibleResourcesError, PresetError
from raydeck.scaling import Preset, check_feasible, get_preset, load_presets, presets_markdown
from raydeck.scheduling.policies import Gang
from raydeck.tracking.cross_rank import CrossRank

EPOCHS = 2
# Two CPUs a worker on the session cluster's 4 (tests/conftest.py RAY_NUM_CPUS): two fit.
ELASTIC_PRESET = "cpu2-1-4:\n  num_workers: [1, 4]\n  cpus_per_worker: 2\n"
WORKERS_THAT_FIT = 2
WORLD_SIZE_METRIC = "raydeck/world_size"


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
def test_tables_show_the_range_and_the_queue_keeps_room_for_the_maximum() -> None:
    assert "| `cpu-1-2` | 1-2 | 1 |" in presets_markdown()
    assert "| `cpu-2` | 2 | 1 |" in presets_markdown()
    # The queue admits and counts an elastic job at its maximum (it does not shrink jobs yet).
    assert Gang.of(get_preset("cpu-1-4")).workers == 4


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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_elastic_digits_job_runs_with_the_workers_that_fit_and_records_its_world_size(
    ray_cluster: None, mlflow_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from raydeck.examples.digits import run_digits

    presets = tmp_path / "presets.yaml"
    presets.write_text(ELASTIC_PRESET)
    monkeypatch.setenv("RAYDECK_PRESETS_FILE", str(presets))
    with pytest.raises(InfeasibleResourcesError):
        check_feasible(get_preset("cpu2-1-4", presets).with_workers(4))
    run = run_digits(preset="cpu2-1-4", config={"epochs": EPOCHS}, run_name="elastic",
                     run_id=f"elastic-{uuid.uuid4().hex[:8]}")
    found = mlflow_client.get_run(run.run_id)
    assert found.info.status == "FINISHED"
    assert found.data.params["num_workers"] == "1-4"
    assert [step for step, _ in _history(mlflow_client, run.run_id, "val_accuracy")] == list(
        range(EPOCHS))
    assert _history(mlflow_client, run.run_id, WORLD_SIZE_METRIC) == [
        (epoch, float(WORKERS_THAT_FIT)) for epoch in range(EPOCHS)]
