"""System metrics: which NVML device each GPU a process sees is, and what a node without NVML
reports (one log line, CPU metrics as before).

This machine has no GPU: NVML's absence is the real one (nvidia-ml-py is installed, the driver's
libnvidia-ml is not). Which GPUs Ray gives a worker on fake GPUs: test_scaling_gpu_packing.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from raydeck.tracking.client.system_metrics import cuda_visible_to_nvml

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
    assert {"system/10.0.0.7/cpu_percent", "system/10.0.0.7/memory_percent",
            "system/10.0.0.7/net_recv_mb_s"} <= node.keys()
    assert not [key for key in node if "gpu" in key]
