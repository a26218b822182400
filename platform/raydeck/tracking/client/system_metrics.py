"""System metrics sampled into the run: the node's view, and the GPUs Ray gave this process.

Two views, both under ``system/<node ip>/``:

- **Node** (one tracker per node and run, elected by the router, so a node reports once):
  ``cpu_percent``, ``memory_percent``, ``memory_used_gb``, disk and network rates, and for every
  GPU of the node ``gpu_<i>/<reading>``, where ``i`` is the NVML index (``nvidia-smi``'s
  numbering, and the ``GpuIndex`` of Ray's own ``ray_node_gpus_*`` metrics in Prometheus).
- **Process** (any tracker whose process Ray assigned GPUs, e.g. a Ray Train worker with
  ``use_gpu``): ``<process>/gpu_<k>/<reading>``, where ``<process>`` is ``rank_<world rank>``
  (``pid_<pid>`` outside Ray Train) and ``k`` the CUDA ordinal the process uses (``cuda:k``).
  Besides the readings: ``nvml_index`` (which of the node's GPUs it is) and
  ``process_memory_used_gb`` (what this process holds on it, when NVML sees the process).

Readings per GPU: ``utilization_percent``, ``memory_used_gb``, ``memory_percent``,
``temperature_c``, ``power_w`` (one a GPU does not support is left out). They need NVML: the
``nvidia-ml-py`` package (a dependency) and the driver's ``libnvidia-ml``. Without them, one log
line per process says why (a warning where GPUs are expected, else info) and the CPU metrics go
on. Does not own: when to sample or where the values go (the tracker's flusher).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import psutil

from raydeck.tracking.messages import ProcessInfo

logger = logging.getLogger(__name__)

_MB = 1024 * 1024
_GB = 1024**3

_nvml_lock = threading.Lock()
_nvml: Any | None = None
_nvml_opened = False


def cuda_visible_to_nvml(visible_devices: str | None, nvml_uuids: Sequence[str]
                         ) -> list[int | None]:
    """The NVML index of each GPU a CUDA process sees, by CUDA ordinal (``cuda:0``, ...).

    Args:
        visible_devices: a ``CUDA_VISIBLE_DEVICES`` value: None (unset: every GPU, in NVML
            order), ``""`` (none), or comma-separated entries, each an index (``"2"``) or a
            UUID (``"GPU-5fd4..."``; a unique prefix is enough, as for CUDA).
        nvml_uuids: the node's GPU UUIDs in NVML index order (``nvmlDeviceGetUUID`` of index
            0, 1, ...).

    Returns:
        One entry per device the process sees. As CUDA does, the list ends at the first entry
        that names no GPU (``-1``, an index past the last GPU, an unknown or ambiguous UUID);
        it also ends at a GPU named twice. A MIG instance (``MIG-...``) is a device the process
        sees but whose readings NVML gives only for the whole GPU: None at its ordinal.

    Index entries are CUDA ordinals, equal to NVML indices when ``CUDA_DEVICE_ORDER`` is
    ``PCI_BUS_ID`` (NVML's order) and, with CUDA's default order (fastest first, ties by PCI
    bus), on nodes with one GPU model; on mixed nodes set ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or
    use UUIDs.
    """
    if visible_devices is None:
        return list(range(len(nvml_uuids)))
    lowered = [uuid.lower() for uuid in nvml_uuids]
    devices: list[int | None] = []
    for raw in visible_devices.split(","):
        entry = raw.strip().lower()
        index: int | None
        if entry.startswith("mig-"):
            devices.append(None)
            continue
        if entry.startswith("gpu-"):
            matches = [i for i, uuid in enumerate(lowered) if uuid.startswith(entry)]
            index = matches[0] if len(matches) == 1 else None
        elif entry.isdigit():
            index = int(entry) if int(entry) < len(nvml_uuids) else None
        else:
            index = None
        if index is None or index in devices:
            break
        devices.append(index)
    return devices


def assigned_gpus() -> str | None:
    """The GPUs Ray assigned to this process, as a ``CUDA_VISIBLE_DEVICES`` value.

    None when Ray assigned none (a driver, a CPU task) or Ray is not initialised. Ray sets the
    process's ``CUDA_VISIBLE_DEVICES`` to its assignment, so that value (in the process's CUDA
    order) is used; with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` Ray leaves it alone and
    ``ray.get_gpu_ids()`` names the devices (as indices or entries of the node's
    ``CUDA_VISIBLE_DEVICES``).
    """
    import ray

    if not ray.is_initialized():
        return None
    ids = [str(gpu) for gpu in ray.get_gpu_ids()]
    if not ids:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"):
        return ",".join(ids)
    return visible


def sampler_for(process: ProcessInfo, node_view: bool) -> SystemSampler | None:
    """The sampler a tracker runs: the node view if the router elected it for its node, the
    process view if Ray assigned its process GPUs; None when it has neither to do."""
    gpus = assigned_gpus()
    if not node_view and gpus is None:
        return None
    label = f"rank_{process.world_rank}" if process.world_rank is not None else f"pid_{process.pid}"
    return SystemSampler(process.node_ip, node_view=node_view,
                         process_gpus=(label, gpus) if gpus is not None else None)


class SystemSampler:
    """Turns successive samples into gauges and per-second rates.

    Args:
        node_label: the node's name in the keys (its IP).
        node_view: sample the node (CPU, memory, disk, network, every GPU).
        process_gpus: ``(label, CUDA_VISIBLE_DEVICES value)`` of this process's GPUs, sampled
            under ``system/<node>/<label>/gpu_<k>/`` (see :func:`assigned_gpus`).
    """

    def __init__(self, node_label: str, *, node_view: bool = True,
                 process_gpus: tuple[str, str] | None = None) -> None:
        self.prefix = f"system/{node_label}/"
        self._node_view = node_view
        self._last_time = time.monotonic()
        if node_view:
            self._last_disk = psutil.disk_io_counters()
            self._last_net = psutil.net_io_counters()
            psutil.cpu_percent(interval=None)  # primes the CPU counter; the first value is 0.0
        self._nvml = _open_nvml(gpus_expected=process_gpus is not None)
        self._node_gpus: list[tuple[str, int]] = []
        self._process_gpus: list[tuple[str, int]] = []
        if self._nvml is not None:
            self._find_gpus(process_gpus)

    def _find_gpus(self, process_gpus: tuple[str, str] | None) -> None:
        nvml = self._nvml
        assert nvml is not None
        try:
            uuids = [_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(index)))
                     for index in range(nvml.nvmlDeviceGetCount())]
        except nvml.NVMLError as exc:
            logger.warning("NVML could not list the GPUs; no GPU metrics for this run: %s", exc)
            self._nvml = None
            return
        if self._node_view:
            self._node_gpus = [(f"gpu_{index}/", index) for index in range(len(uuids))]
        if process_gpus is not None:
            label, visible = process_gpus
            indices = cuda_visible_to_nvml(visible, uuids)
            self._process_gpus = [(f"{label}/gpu_{ordinal}/", index)
                                  for ordinal, index in enumerate(indices) if index is not None]
            if not self._process_gpus:
                logger.warning("no per-process GPU metrics: the GPUs Ray assigned this process "
                               "(%s) are MIG instances or match none of NVML's %d GPUs",
                               visible, len(uuids))

    def sample(self) -> dict[str, float]:
        """One sample: ``system/<node>/...`` key -> value."""
        values: dict[str, float] = {}
        if self._node_view:
            values.update(self._node_values())
        if self._nvml is not None:
            values.update(self._gpu_values())
        return {self.prefix + name: float(value) for name, value in values.items()}

    def _node_values(self) -> dict[str, float]:
        now = time.monotonic()
        elapsed = max(now - self._last_time, 1e-6)
        memory = psutil.virtual_memory()
        values = {
            "cpu_percent": psutil.cpu_percent(interval=None),
            "memory_percent": memory.percent,
            "memory_used_gb": memory.used / _GB,
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
        return values

    def _gpu_values(self) -> dict[str, float]:
        nvml = self._nvml
        assert nvml is not None
        values: dict[str, float] = {}
        try:
            readings: dict[int, dict[str, float]] = {}
            for prefix, index in self._node_gpus:
                readings[index] = _readings(nvml, index)
                values.update({prefix + name: value for name, value in readings[index].items()})
            pid = os.getpid()
            for prefix, index in self._process_gpus:
                mine = dict(readings.get(index) or _readings(nvml, index), nvml_index=index)
                used = _process_memory_bytes(nvml, index, pid)
                if used is not None:
                    mine["process_memory_used_gb"] = used / _GB
                values.update({prefix + name: value for name, value in mine.items()})
        except nvml.NVMLError as exc:
            logger.warning("NVML sampling failed; GPU metrics stop for this run: %s", exc)
            self._nvml = None
        return values


def _text(value: str | bytes) -> str:
    """NVML strings: str from nvidia-ml-py, bytes from older bindings."""
    return value.decode() if isinstance(value, bytes) else value


def _readings(nvml: Any, index: int) -> dict[str, float]:
    """Utilisation, memory, temperature and power of one GPU; the ones it does not support
    (NVML's NotSupported, e.g. power on some boards) are left out."""
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    values: dict[str, float] = {}
    with contextlib.suppress(nvml.NVMLError_NotSupported):
        values["utilization_percent"] = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
    with contextlib.suppress(nvml.NVMLError_NotSupported):
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        values["memory_used_gb"] = memory.used / _GB
        values["memory_percent"] = 100.0 * memory.used / memory.total
    with contextlib.suppress(nvml.NVMLError_NotSupported):
        values["temperature_c"] = nvml.nvmlDeviceGetTemperature(handle,
                                                                 nvml.NVML_TEMPERATURE_GPU)
    with contextlib.suppress(nvml.NVMLError_NotSupported):
        values["power_w"] = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
    return values


def _process_memory_bytes(nvml: Any, index: int, pid: int) -> int | None:
    """GPU memory process ``pid`` holds on GPU ``index``; None when NVML does not list it (no
    CUDA context yet, or a container whose PIDs NVML does not see)."""
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    with contextlib.suppress(nvml.NVMLError_NotSupported):
        used = [entry.usedGpuMemory for entry in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                if entry.pid == pid and entry.usedGpuMemory is not None]
        return sum(used) if used else None
    return None


def _open_nvml(gpus_expected: bool) -> Any | None:
    """NVML (``pynvml``), initialised once per process; None where it cannot be used.

    The first failure is logged once per process: a warning when this node looks like it has
    GPUs (Ray assigned some, or ``/dev/nvidia*`` exists), else info (a CPU node).
    """
    global _nvml, _nvml_opened
    with _nvml_lock:
        if _nvml_opened:
            return _nvml
        _nvml_opened = True
        try:
            import pynvml

            pynvml.nvmlInit()
            _nvml = pynvml
        except ImportError:
            _gpu_metrics_off(gpus_expected, "the nvidia-ml-py package is not installed")
        except Exception as exc:  # pynvml.NVMLError_*: no driver library, driver mismatch...
            _gpu_metrics_off(gpus_expected, f"NVML did not start: {exc}")
        return _nvml


def _gpu_metrics_off(gpus_expected: bool, why: str) -> None:
    level = logging.WARNING if gpus_expected or glob.glob("/dev/nvidia[0-9]*") else logging.INFO
    logger.log(level, "no GPU metrics in this process (%s); CPU, memory, disk and network "
               "metrics continue", why)
