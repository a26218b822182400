"""GPU presets on fake GPUs: which worker gets which GPU, per placement strategy, and feasibility
answers from real per-node resources.

One driver process (``tests/fixtures/fake_gpu_cluster.py``) starts a two-node Ray cluster with
two fake GPUs and four CPUs per node, starts each preset's Ray Train worker group and
prints what every worker saw; the tests assert on it. ``gpu-pack`` gets no fit of its own: on
this idle cluster PACK places its four half-GPU workers exactly as ``gpu-strict-pack`` does (one
node, two per GPU), so its fit proved nothing more; that the preset asks Ray for PACK is
checked in tests/train/test_scaling.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TEST_ENV
from tests.fixtures.ray_head import MARKER_ENV, new_marker, reap

REPO = Path(__file__).resolve().parents[2]
PRESETS = ("gpu-spread", "gpu-strict-pack", "gpu-strict-spread", "gpu-quarter")
DRIVER_TIMEOUT_S = 1200


@pytest.fixture(scope="module")
def fake_gpu_results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import os

    root = tmp_path_factory.mktemp("fake-gpus")
    marker = new_marker()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAYDECK_"))}
    # The suite's Ray settings (auth off, Ray Train's 0.5 s health checks, no preemption
    # watcher: one actor process less for each of the four fits), whatever ran before.
    env.update({k: v for k, v in TEST_ENV.items() if k.startswith("RAY_")})
    env.update({MARKER_ENV: marker, "FAKE_GPU_STORAGE": str(root), "PYTHONUNBUFFERED": "1"})
    checks = ["feasibility", "admission", *(f"placement:{name}" for name in PRESETS)]
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tests.fixtures.fake_gpu_cluster", *checks], cwd=REPO,
            env=env, capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S,
            start_new_session=True,
        )
    finally:
        reap(marker)
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            item = json.loads(line[len("RESULT "):])
            results[item["check"]] = item["value"]
    assert done.returncode == 0 and len(results) == len(checks), (
        done.stdout[-3000:] + done.stderr[-5000:])
    yield results


def _placements(results: dict[str, Any], preset: str) -> list[dict[str, Any]]:
    workers = results[f"placement:{preset}"]
    assert [w["rank"] for w in workers] == list(range(len(workers)))
    for worker in workers:
        # Each worker owns one GPU id, and the devices it may see include it.
        assert len(worker["gpu_ids"]) == 1, worker
        assert worker["gpu_ids"][0] in worker["cuda_visible_devices"].split(","), worker
    return workers


def _per_gpu(workers: list[dict[str, Any]]) -> Counter[tuple[str, str]]:
    return Counter((w["node"], w["gpu_ids"][0]) for w in workers)


@pytest.mark.slow
@pytest.mark.timeout(DRIVER_TIMEOUT_S + 60)
def test_packed_half_gpu_workers_share_two_gpus_of_one_node(
    fake_gpu_results: dict[str, Any]
) -> None:
    workers = _placements(fake_gpu_results, "gpu-strict-pack")
    assert len({w["node"] for w in workers}) == 1
    assert sorted(_per_gpu(workers).values()) == [2, 2]
    assert sorted(w["gpu_ids"][0] for w in workers) == ["0", "0", "1", "1"]


@pytest.mark.slow
@pytest.mark.timeout(DRIVER_TIMEOUT_S + 60)
def test_spread_half_gpu_workers_pair_up_on_one_gpu_per_node(
    fake_gpu_results: dict[str, Any]
) -> None:
    workers = _placements(fake_gpu_results, "gpu-spread")
    assert sorted(Counter(w["node"] for w in workers).values()) == [2, 2]
    assert sorted(_per_gpu(workers).values()) == [2, 2]


@pytest.mark.slow
@pytest.mark.timeout(DRIVER_TIMEOUT_S + 60)
def test_strict_spread_puts_each_whole_gpu_worker_on_its_own_node(
    fake_gpu_results: dict[str, Any]
) -> None:
    workers = _placements(fake_gpu_results, "gpu-strict-spread")
    assert len(workers) == 2
    assert len({w["node"] for w in workers}) == 2


@pytest.mark.slow
@pytest.mark.timeout(DRIVER_TIMEOUT_S + 60)
def test_quarter_gpu_workers_fill_one_gpu(fake_gpu_results: dict[str, Any]) -> None:
    workers = _placements(fake_gpu_results, "gpu-quarter")
    assert list(_per_gpu(workers).values()) == [4]


@pytest.mark.slow
@pytest.mark.timeout(DRIVER_TIMEOUT_S + 60)
def test_feasibility_reads_each_nodes_own_free_gpus(fake_gpu_results: dict[str, Any]) -> None:
    answers = fake_gpu_results["feasibility"]
    assert answers["gpu-strict-pack idle"] is True
    # More distinct nodes, or more GPUs on one node, than exist: refused at once, explained.
    assert answers["3 workers strict-spread"].startswith(
        "infeasible: preset 'gpu-strict-spread' asks for 3 worker(s) x (4 CPU, 1 GPU), "
        "STRICT_SPREAD, but the cluster has 2 node(s) with 8 CPU, 4 GPU")
    assert "(node 0: 4 CPU, 2 GPU" in answers["3 workers strict-spread"]
    assert answers["5 workers strict-pack"].startswith(
        "infeasible: preset 'gpu-strict-pack' asks for 5 worker(s) x (1 CPU, 0.5 GPU)")
    # One node fully busy: the other still fits four half-GPU workers now.
    assert answers["gpu-strict-pack one node busy"] is True
    # 0.5 GPU free on each node: four quarter-GPU workers fit now, a 2-GPU node does not.
    assert answers["gpu-strict-pack both nodes busy"] is False
    assert answers["gpu-quarter both nodes busy"] is True


@pytest.mark.slow
@pytest.mark.timeout(DRIVER_TIMEOUT_S + 60)
def test_the_queue_admits_exactly_the_gangs_ray_can_place_now(
        fake_gpu_results: dict[str, Any]) -> None:
    admission = fake_gpu_results["admission"]
    # One GPU held on each node: what the queue's launcher reads, per node.
    assert admission["nodes"] == [[4.0, 1.0], [4.0, 1.0]]
    for preset, answer in admission["gangs"].items():
        assert answer["queue"] == answer["ray"], (preset, answer)
    # The case cluster totals get wrong: two GPUs free in all, but no node holds four halves.
    assert admission["gangs"]["gpu-strict-pack"] == {"pool": True, "queue": False, "ray": False}
    assert all(answer["queue"] for preset, answer in admission["gangs"].items()
               if preset != "gpu-strict-pack")
    # FIFO keeps the strict gang at the head waiting, nothing jumps it; in the other order the
    # packed gang starts and the strict one waits.
    assert admission["fifo"] == {"strict first": [], "pack first": ["gpu-pack"]}
    # Ray fills one GPU with half shares before it starts the next: the whole GPU stays free.
    half, other_half, whole = admission["holders"]
    assert half == other_half and len(half) == 1 and whole != half


@pytest.mark.slow
@pytest.mark.timeout(DRIVER_TIMEOUT_S + 60)
def test_each_worker_samples_the_gpu_ray_gave_it(fake_gpu_results: dict[str, Any]) -> None:
    from raydeck.tracking.client.system_metrics import cuda_visible_to_nvml

    node_uuids = [f"GPU-{index:08x}-0000-0000-0000-000000000000" for index in range(2)]
    for preset in PRESETS:
        for worker in _placements(fake_gpu_results, preset):
            nvml_indices = cuda_visible_to_nvml(worker["assigned_gpus"], node_uuids)
            assert nvml_indices == [int(worker["gpu_ids"][0])], (preset, worker)
