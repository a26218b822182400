"""System metrics of one node, sampled into the run as ``system/<node>/<metric>``.

The router elects one tracker per node and run to sample, so a node running a driver and two
workers reports once. CPU, memory, disk and network come from psutil; GPU utilisation, memory
and temperature from NVML when a GPU and ``pynvml`` (``nvidia-ml-py``) are present.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import psutil

logger = logging.getLogger(__name__)

_MB = 1024 * 1024


class SystemSampler:
    """Turns successive samples into gauges and per-second rates for one node."""

    def __init__(self, node_label: str) -> None:
        self.prefix = f"system/{node_label}/"
        self._last_time = time.monotonic()
        self._last_disk = psutil.disk_io_counters()
        self._last_net = psutil.net_io_counters()
        psutil.cpu_percent(interval=None)  # primes the CPU counter; the first value is 0.0
        self._nvml = _open_nvml()

    def sample(self) -> dict[str, float]:
        now = time.monotonic()
        elapsed = max(now - self._last_time, 1e-6)
        memory = psutil.virtual_memory()
        values = {
            "cpu_percent": psutil.cpu_percent(interval=None),
            "memory_percent": memory.percent,
            "memory_used_gb": memory.used / 1024**3,
        }
        disk = psutil.disk_io_counters()
        if disk is not None and self._last_disk is not None:
            values["disk_read_mb_s"] = (
                (disk.read_bytes - self._last_disk.read_bytes) / _MB / elapsed
            )
            values["disk_write_mb_s"] = (
                (disk.write_bytes - self._last_disk.write_bytes) / _MB / elapsed
            )
        net = psutil.net_io_counters()
        if net is not None and self._last_net is not None:
            values["net_recv_mb_s"] = (net.bytes_recv - self._last_net.bytes_recv) / _MB / elapsed
            values["net_sent_mb_s"] = (net.bytes_sent - self._last_net.bytes_sent) / _MB / elapsed
        self._last_time, self._last_disk, self._last_net = now, disk, net
        values.update(self._gpu_values())
        return {self.prefix + name: float(value) for name, value in values.items()}

    def _gpu_values(self) -> dict[str, float]:
        if self._nvml is None:
            return {}
        nvml = self._nvml
        values: dict[str, float] = {}
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                util = nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                values[f"gpu_{index}_utilization_percent"] = util.gpu
                values[f"gpu_{index}_memory_percent"] = 100.0 * memory.used / memory.total
                values[f"gpu_{index}_temperature_c"] = nvml.nvmlDeviceGetTemperature(
                    handle, nvml.NVML_TEMPERATURE_GPU
                )
        except Exception as exc:
            logger.warning("NVML sampling failed; GPU metrics stop for this run: %s", exc)
            self._nvml = None
        return values


def _open_nvml() -> Any | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None
