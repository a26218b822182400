"""System metrics: the node's readings carry MLflow's own names and units (checked against
MLflow's monitors), which NVML device each GPU a process sees is, and what a node without NVML
reports (one log line, CPU metrics as before).

This machine has no GPU: NVML's absence is the real one (nvidia-ml-py is installed, the driver's
libnvidia-ml is not). Which GPUs Ray gives a worker on fake GPUs: test_scaling_gpu_packing.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raydeck.tracking.client.system_metrics import (
    GPU_TEMPERATURE,
    MLFLOW_GPU_READINGS,
    MLFLOW_NODE_METRICS,
    RAYDECK_NODE_RATES,
    SystemSampler,
    _GpuReading,
    cuda_visible_to_nvml,
)

REPO = Path(__file__).resolve().parents[2]
# UUIDs as nvmlDeviceGetUUID returns them for NVML indices 0..3.
UUIDS = [
    "GPU-5fd4f2bd-8bb7-7e3c-1e3d-8b9f2c3a0e11",
    "GPU-9a1c7d32-0f4e-11ee-be56-0242ac120002",
    "GPU-9a1c7d32-55aa-4b1e-a2c4-6b0e7f3d9c21",
    "GPU-e0b7c2a4-3f6d-4c8e-9d1a-2b5f8e7c4a90",
]


@pytest.mark.parametrize(("visible", "indices"), [
    (None, [0, 1, 2, 3]),                       # unset: every GPU, NVML order
    ("", []),                                   # Ray's value for a process with no GPU
    ("2", [2]),
    ("3,1", [3, 1]),                            # cuda:0 is NVML 3
    (" 1, 2 ", [1, 2]),
    ("1,7,2", [1]),                             # CUDA stops at the first invalid entry
    ("-1,0", []),
    ("1,1", [1]),
    (f"{UUIDS[2]},{UUIDS[0]}", [2, 0]),         # Ray started with UUIDs in CUDA_VISIBLE_DEVICES
    (UUIDS[3].upper(), [3]),
    ("GPU-e0b7", [3]),                          # a unique prefix, as CUDA accepts
    ("GPU-9a1c7d32", []),                       # ambiguous prefix: no device
    (f"0,{UUIDS[1]}", [0, 1]),
    ("GPU-00000000-0000-0000-0000-000000000000", []),
    ("MIG-6c9b4a1e-2d7f-5a3b-8e0c-1f2a3b4c5d6e", [None]),
])
def test_cuda_visible_devices_name_nvml_devices(visible: str | None, indices: list[int | None]
                                                ) -> None:
    assert cuda_visible_to_nvml(visible, UUIDS) == indices


def test_a_node_without_gpus_reports_none() -> None:
    assert cuda_visible_to_nvml(None, []) == []
    assert cuda_visible_to_nvml("0", []) == []


_WITHOUT_NVML = """
import json, logging, sys
logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(message)s")
from raydeck.tracking.client.system_metrics import SystemSampler
worker = SystemSampler("10.0.0.7", node_view=False, process_gpus=("rank_0", "0"))
node = SystemSampler("10.0.0.7")
node.sample()
print(json.dumps({"worker": worker.sample(), "node": node.sample()}))
"""


@pytest.mark.timeout(120)
def test_without_nvml_one_line_says_so_and_cpu_metrics_go_on() -> None:
    try:
        import pynvml

        pynvml.nvmlInit()
        pytest.skip("NVML works on this machine: its absence cannot be tested here")
    except pynvml.NVMLError:
        pass
    done = subprocess.run([sys.executable, "-c", _WITHOUT_NVML], cwd=REPO, capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "GPU metrics" in line]
    # Two samplers, one line; a warning, since Ray gave this process a GPU.
    assert lines == ["WARNING no GPU metrics in this process (NVML did not start: NVML Shared "
                     "Library Not Found); CPU, memory, disk and network metrics continue"]
    samples = json.loads(done.stdout)
    assert samples["worker"] == {}
    node = samples["node"]
    assert {"system/10.0.0.7/cpu_utilization_percentage",
            "system/10.0.0.7/system_memory_usage_megabytes",
            "system/10.0.0.7/network_receive_megabytes"} <= node.keys()
    assert not [key for key in node if "gpu" in key]


def _mlflow_node_reading() -> dict[str, float]:
    """One reading of MLflow's own node monitors, as its SystemMetricsMonitor takes it."""
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

    reading: dict[str, float] = {}
    for monitor in (CPUMonitor(), DiskMonitor(), NetworkMonitor()):
        monitor.collect_metrics()
        reading.update(monitor.aggregate_metrics())
    return reading


def test_the_node_view_has_mlflows_names_and_units_and_raydecks_rates_beside_them() -> None:
    # MLflow's UI charts system/<node_id>/<name> as its own system metrics only under its names.
    sampler = SystemSampler("10.0.0.7")
    ours = {key.removeprefix("system/10.0.0.7/"): value
            for key, value in sampler.sample().items()}
    theirs = _mlflow_node_reading()
    assert set(theirs) == set(MLFLOW_NODE_METRICS)
    assert set(ours) - {key for key in ours if key.startswith("gpu_")} == (
        set(MLFLOW_NODE_METRICS) | set(RAYDECK_NODE_RATES))
    # Same units: MLflow's megabytes are 10^6 bytes (MiB would read 4.9 % lower).
    for key in ("disk_usage_megabytes", "disk_available_megabytes"):
        assert ours[key] == pytest.approx(theirs[key], rel=0.01), key
    assert ours["system_memory_usage_percentage"] == pytest.approx(
        theirs["system_memory_usage_percentage"], abs=2.0)
    assert ours["network_receive_megabytes"] >= 0


def test_node_gpu_readings_are_named_as_mlflows_gpu_monitor_names_them() -> None:
    # MLflow's GPUMonitor names each reading f"gpu_{i}_<reading>" (read from its source: this
    # machine has no GPU to run it on).
    import mlflow.system_metrics.metrics.gpu_monitor as gpu_monitor

    source = Path(gpu_monitor.__file__).read_text()
    assert set(re.findall(r'f"gpu_\{i\}_(\w+)"', source)) == set(MLFLOW_GPU_READINGS)
    reading = _GpuReading(utilization_percent=97.0, memory_used_bytes=40e9,
                          memory_total_bytes=80e9, temperature_c=61.0, power_mw=350_000.0,
                          power_limit_mw=700_000.0)
    assert reading.mlflow_names() == {
        "memory_usage_percentage": 50.0, "memory_usage_megabytes": 40_000.0,
        "utilization_percentage": 97.0, "power_usage_watts": 350.0,
        "power_usage_percentage": 50.0, GPU_TEMPERATURE: 61.0}
    # A board without power readings: those are left out, as raydeck always did.
    bare = _GpuReading(utilization_percent=3.0, memory_used_bytes=None, memory_total_bytes=None,
                       temperature_c=None, power_mw=None, power_limit_mw=None)
    assert bare.mlflow_names() == {"utilization_percentage": 3.0}


@pytest.mark.timeout(60)
def test_on_a_gpu_node_the_gpu_keys_match_mlflows_gpu_monitor() -> None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        pytest.skip("no NVML on this machine: the GPU monitor cannot run here")
    from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

    monitor = GPUMonitor()
    monitor.collect_metrics()
    theirs = set(monitor.aggregate_metrics())
    ours = {key.removeprefix("system/n/") for key in SystemSampler("n").sample()
            if key.startswith("system/n/gpu_")}
    assert theirs <= ours
    readings = {*MLFLOW_GPU_READINGS, GPU_TEMPERATURE}
    assert ours <= {f"gpu_{i}_{r}" for i in range(monitor.num_gpus) for r in readings}
