"""Scaling presets: every built-in resolves to Ray's ScalingConfig, bad presets are refused with an
error naming the field and the fix, and requests the cluster can never run fail before anything
starts. (Packing on fake GPUs: test_scaling_gpu_packing.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from raydeck.errors import InfeasibleResourcesError, PresetError
from raydeck.train.feasibility import check_feasible
from raydeck.train.presets import BUILTIN_PRESETS, Preset, get_preset, load_presets, resolve


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(BUILTIN_PRESETS))
def test_every_builtin_preset_resolves_to_rays_scaling_config(name: str) -> None:
    from ray.train import CheckpointConfig, FailureConfig, ScalingConfig

    preset = get_preset(name)
    config = preset.scaling_config()
    assert isinstance(config, ScalingConfig)
    assert config.num_workers == preset.num_workers and preset.min_workers >= 1
    assert config.elasticity_enabled == preset.elastic
    assert config.placement_strategy == preset.placement_strategy
    assert config.use_gpu == (preset.gpus_per_worker > 0)
    assert config.resources_per_worker["CPU"] == preset.cpus_per_worker
    assert config.resources_per_worker.get("GPU", 0) == preset.gpus_per_worker
    failure = preset.failure_config()
    assert isinstance(failure, FailureConfig) and failure.max_failures == preset.max_failures
    kept = preset.checkpoint_config()
    assert isinstance(kept, CheckpointConfig)
    assert kept.num_to_keep == preset.checkpoints_to_keep
    assert resolve(name) == preset == resolve(preset)


@pytest.mark.timeout(60)
def test_gpu_pack_is_gpu_strict_pack_with_ray_s_best_effort_pack() -> None:
    # The fake-GPU fits (test_scaling_gpu_packing.py) place gpu-strict-pack only: on an idle
    # cluster gpu-pack lands the same way, so what tells the two apart is this mapping.
    pack, strict = (get_preset(name).scaling_config() for name in ("gpu-pack", "gpu-strict-pack"))
    assert (pack.placement_strategy, strict.placement_strategy) == ("PACK", "STRICT_PACK")
    assert (pack.num_workers, pack.resources_per_worker) == (
        strict.num_workers, strict.resources_per_worker) == (4, {"CPU": 1, "GPU": 0.5})


@pytest.mark.timeout(60)
def test_fractional_presets_divide_a_gpu_exactly() -> None:
    shares = {name: get_preset(name).gpus_per_worker for name in ("gpu-half", "gpu-quarter")}
    assert shares == {"gpu-half": 0.5, "gpu-quarter": 0.25}
    for k in range(2, 9):
        Preset("share", 2, gpus_per_worker=1 / k)


@pytest.mark.timeout(60)
def test_workers_sharing_a_gpu_train_with_gloo_because_nccl_refuses_them() -> None:
    # On an H200, four gpu-quarter ranks under NCCL failed with "Duplicate GPU detected"; the
    # same workers trained with gloo (docs/gpu.md).
    from raydeck.train.trainer import torch_config

    backends = {name: torch_config(get_preset(name).scaling_config()).backend
                for name in ("gpu-half", "gpu-quarter", "gpu-pack", "gpu-1", "gpu-2", "cpu-2")}
    assert backends == {"gpu-half": "gloo", "gpu-quarter": "gloo", "gpu-pack": "gloo",
                        "gpu-1": None, "gpu-2": None, "cpu-2": None}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_workers": 2, "gpus_per_worker": 0.3},
         "preset 'bad': gpus_per_worker=0.3: a GPU share must be 1/k for k = 2..8 (0.5, 0.3333, "
         "0.25, 0.2, 0.1667, 0.1429, 0.125) so workers divide a GPU exactly"),
        ({"num_workers": 2, "gpus_per_worker": 1.5},
         "preset 'bad': gpus_per_worker=1.5: whole GPUs must be an integer (1, 2, ...)"),
        ({"num_workers": 0}, "preset 'bad': num_workers=0 must be >= 1"),
        ({"num_workers": 2.5}, "preset 'bad': num_workers=2.5 must be an integer"),
        ({"num_workers": 2, "cpus_per_worker": "two"},
         "preset 'bad': cpus_per_worker='two' must be a number >= 0"),
        ({"num_workers": 2, "placement_strategy": "CLOSE"},
         "preset 'bad': placement_strategy='CLOSE' must be one of PACK, SPREAD, STRICT_PACK, "
         "STRICT_SPREAD"),
        ({"num_workers": 2, "max_failures": -2},
         "preset 'bad': max_failures=-2 must be >= -1 (-1: retry forever, 0: fail on the first "
         "worker death)"),
        ({"num_workers": 2, "checkpoints_to_keep": 0},
         "preset 'bad': checkpoints_to_keep=0 must be >= 1"),
    ],
)
def test_bad_presets_name_the_field_and_the_fix(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(PresetError) as raised:
        Preset("bad", **fields)
    assert str(raised.value).startswith(message)


@pytest.mark.timeout(60)
def test_unknown_preset_lists_the_known_ones(tmp_path: Path) -> None:
    presets = tmp_path / "presets.yaml"
    presets.write_text("team-a:\n  num_workers: 3\n")
    with pytest.raises(PresetError) as raised:
        get_preset("gpu-lots", presets)
    assert str(raised.value) == (
        "unknown preset 'gpu-lots'; known presets: " + ", ".join(sorted([*BUILTIN_PRESETS,
                                                                         "team-a"]))
        + " (add your own in RAYDECK_PRESETS_FILE)")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("suffix", [".yaml", ".toml"])
def test_user_presets_from_yaml_or_toml_add_to_and_override_builtins(
    tmp_path: Path, suffix: str
) -> None:
    path = tmp_path / f"presets{suffix}"
    if suffix == ".yaml":
        path.write_text("presets:\n  cpu-2:\n    num_workers: 2\n    cpus_per_worker: 2\n"
                        "  shared-gpu:\n    num_workers: 3\n    gpus_per_worker: 0.3333333333333333"
                        "\n    placement_strategy: STRICT_PACK\n    max_failures: 5\n")
    else:
        path.write_text('[presets.cpu-2]\nnum_workers = 2\ncpus_per_worker = 2\n'
                        '[presets.shared-gpu]\nnum_workers = 3\n'
                        'gpus_per_worker = 0.3333333333333333\n'
                        'placement_strategy = "STRICT_PACK"\nmax_failures = 5\n')
    presets = load_presets(path)
    assert presets["cpu-2"].cpus_per_worker == 2
    shared = presets["shared-gpu"]
    assert (shared.num_workers, shared.placement_strategy, shared.max_failures) == (
        3, "STRICT_PACK", 5)
    assert shared.scaling_config().resources_per_worker["GPU"] == pytest.approx(1 / 3)
    assert presets["gpu-half"] == BUILTIN_PRESETS["gpu-half"]


@pytest.mark.timeout(60)
def test_a_bad_preset_in_a_file_names_the_preset_and_the_field(tmp_path: Path) -> None:
    path = tmp_path / "presets.yaml"
    path.write_text("tiny:\n  num_workers: 2\n  gpus_per_worker: 0.3\n")
    with pytest.raises(PresetError, match=r"^preset 'tiny': gpus_per_worker=0.3: a GPU share"):
        load_presets(path)
    path.write_text("tiny:\n  num_workers: 2\n  gpu: 1\n")
    with pytest.raises(PresetError, match=r"^preset 'tiny' in .*: unknown field\(s\) gpu; known"):
        load_presets(path)


@pytest.mark.timeout(60)
def test_a_users_own_scaling_config_is_validated_like_a_preset() -> None:
    from ray.train import ScalingConfig

    preset = resolve(ScalingConfig(num_workers=4, use_gpu=True,
                                   resources_per_worker={"CPU": 2, "GPU": 0.25},
                                   placement_strategy="SPREAD"))
    assert (preset.num_workers, preset.cpus_per_worker, preset.gpus_per_worker,
            preset.placement_strategy) == (4, 2, 0.25, "SPREAD")
    assert resolve(ScalingConfig(num_workers=2, use_gpu=True)).gpus_per_worker == 1
    with pytest.raises(PresetError, match=r"gpus_per_worker=0\.3: a GPU share must be 1/k"):
        resolve(ScalingConfig(num_workers=2, use_gpu=True, resources_per_worker={"GPU": 0.3}))


GIB = 1024**3
TWO_NODES = [{"CPU": 8.0, "GPU": 2.0, "memory": 32.0 * GIB},
             {"CPU": 8.0, "GPU": 2.0, "memory": 32.0 * GIB}]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("preset", "available", "runs_now"),
    [
        (Preset("p", 4, gpus_per_worker=0.5, placement_strategy="STRICT_PACK"), TWO_NODES, True),
        # One node has both GPUs free: STRICT_PACK fits there although the cluster is half busy.
        (Preset("p", 4, gpus_per_worker=0.5, placement_strategy="STRICT_PACK"),
         [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 0.0}], True),
        # One GPU free in total, split over two nodes: PACK fits, STRICT_PACK waits.
        (Preset("p", 2, gpus_per_worker=0.5, placement_strategy="PACK"),
         [{"CPU": 8.0, "GPU": 0.5}, {"CPU": 8.0, "GPU": 0.5}], True),
        (Preset("p", 2, gpus_per_worker=0.5, placement_strategy="STRICT_PACK"),
         [{"CPU": 8.0, "GPU": 0.5}, {"CPU": 8.0, "GPU": 0.5}], False),
        (Preset("p", 2, gpus_per_worker=1, placement_strategy="STRICT_SPREAD"),
         [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 0.0, "GPU": 2.0}], False),
        (Preset("p", 2, memory_per_worker_gb=20), [{"CPU": 8.0, "memory": 30.0 * GIB}] * 2, True),
        (Preset("p", 2, memory_per_worker_gb=20),
         [{"CPU": 8.0, "memory": 30.0 * GIB}, {"CPU": 8.0, "memory": 10.0 * GIB}], False),
    ],
)
def test_feasibility_uses_each_nodes_own_resources(
    preset: Preset, available: list[dict[str, float]], runs_now: bool
) -> None:
    answer = check_feasible(preset, node_totals=TWO_NODES, node_available=available)
    assert answer.runs_now is runs_now
    if not runs_now:
        assert answer.message.endswith(
            "feasible, but the cluster is busy; queued until running work frees resources")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("preset", "message"),
    [
        (Preset("big", 3, gpus_per_worker=1, placement_strategy="STRICT_SPREAD"),
         "preset 'big' asks for 3 worker(s) x (1 CPU, 1 GPU), STRICT_SPREAD, but the cluster has "
         "2 node(s) with 16 CPU, 4 GPU, 64.0 GiB memory in total (node 0: 8 CPU, 2 GPU; node 1: "
         "8 CPU, 2 GPU); it would wait forever. Pick a smaller preset (`raydeck presets`) or "
         "add nodes."),
        (Preset("big", 3, gpus_per_worker=1, placement_strategy="STRICT_PACK"),
         "preset 'big' asks for 3 worker(s) x (1 CPU, 1 GPU), STRICT_PACK, but the cluster has"),
        (Preset("big", 1, memory_per_worker_gb=40),
         "preset 'big' asks for 1 worker(s) x (1 CPU, 40.0 GiB memory), PACK, but the cluster"),
    ],
)
def test_infeasible_requests_say_what_was_asked_and_what_exists(
    preset: Preset, message: str
) -> None:
    with pytest.raises(InfeasibleResourcesError) as raised:
        check_feasible(preset, node_totals=TWO_NODES, node_available=TWO_NODES)
    assert str(raised.value).startswith(message)


@pytest.mark.timeout(120)
def test_the_session_cluster_answers_feasibility_from_its_real_resources(
    ray_cluster: None
) -> None:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from tests.conftest import RAY_NUM_CPUS

    assert check_feasible(get_preset("cpu-2")).runs_now
    with pytest.raises(InfeasibleResourcesError, match=(
            r"^preset 'gpu-1' asks for 1 worker\(s\) x \(4 CPU, 1 GPU\), PACK, but the cluster "
            rf"has 1 node\(s\) with {RAY_NUM_CPUS} CPU, ")):
        check_feasible(get_preset("gpu-1"))
    held = placement_group([{"CPU": RAY_NUM_CPUS - 1}])
    ray.get(held.ready(), timeout=60)
    try:
        busy = check_feasible(get_preset("cpu-2"))
    finally:
        remove_placement_group(held)
    assert not busy.runs_now
    assert "queued until running work frees resources" in busy.message


@pytest.mark.timeout(120)
def test_an_infeasible_job_fails_fast_and_creates_no_run(
    ray_cluster: None, mlflow_client: Any
) -> None:
    from raydeck.examples.digits import run_digits

    started = time.monotonic()
    with pytest.raises(InfeasibleResourcesError, match="preset 'gpu-half' asks for 2 worker"):
        run_digits(preset="gpu-half", run_name="never-runs-gpu-half")
    assert time.monotonic() - started < 30
    experiment = mlflow_client.get_experiment_by_name("raydeck")
    if experiment is not None:
        runs = mlflow_client.search_runs([experiment.experiment_id],
                                         filter_string="attributes.run_name = "
                                                       "'never-runs-gpu-half'")
        assert runs == []


@pytest.mark.timeout(120)
def test_raydeck_presets_lists_builtin_and_user_presets(tmp_path: Path) -> None:
    presets = tmp_path / "presets.toml"
    presets.write_text('[presets.team-a]\nnum_workers = 6\ngpus_per_worker = 0.125\n'
                       'checkpoints_to_keep = 4\ndescription = "our share"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAYDECK_")}
    env.update({"RAYDECK_PRESETS_FILE": str(presets), "COLUMNS": "250"})
    listed = subprocess.run([sys.executable, "-m", "raydeck.cli", "presets"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=100)
    assert listed.returncode == 0, listed.stderr
    rows = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:-1]]
            for line in listed.stdout.splitlines() if line.count("│") > 5}
    assert set(BUILTIN_PRESETS) | {"team-a"} <= set(rows)
    assert rows["team-a"] == ["6", "1", "0.125", "-", "PACK", "3", "4", "our share"]
    assert rows["gpu-quarter"][:5] == ["4", "1", "0.25", "-", "PACK"]
