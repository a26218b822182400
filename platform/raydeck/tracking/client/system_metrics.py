"""System metrics sampled into the run: the node's view, and the GPUs Ray gave this process.

Two views, both under ``system/<node ip>/``, the ``system/<node_id>/`` form MLflow's own
``SystemMetricsMonitor`` gives a node (``MLFLOW_SYSTEM_METRICS_NODE_ID``), so MLflow's UI charts
them as its system metrics:

- **Node** (one tracker per node and run, elected by the router, so a node reports once): what
  MLflow's own monitors measure, under their names and in their units
  (``mlflow/system_metrics/metrics/*_monitor.py``; :data:`MLFLOW_NODE_METRICS`, and per GPU
  ``gpu_<i>_<reading>`` of :data:`MLFLOW_GPU_READINGS`, ``i`` the NVML index: ``nvidia-smi``'s
  numbering, and the ``GpuIndex`` of Ray's own ``ray_node_gpus_*`` metrics in Prometheus), and
  raydeck's own readings beside them: disk and network rates, each GPU's temperature.
- **Process** (any tracker whose process Ray assigned GPUs, e.g. a Ray Train worker with
  ``use_gpu``), raydeck's own names: ``<process>/gpu_<k>/<reading>``, where ``<process>`` is
  ``rank_<world rank>`` (``pid_<pid>`` outside Ray Train) and ``k`` the CUDA ordinal the process
  uses (``cuda:k``); readings ``utilization_percent``, ``memory_used_gb``, ``memory_percent``,
  ``temperature_c``, ``power_w``, ``nvml_index`` (which of the node's GPUs it is) and
  ``process_memory_used_gb`` (what this process holds on it, when NVML sees the process).

A reading a GPU does not support is left out. GPU readings need NVML: the ``nvidia-ml-py``
package (a dependency) and the driver's ``libnvidia-ml``. Without them, one log line per process
says why (a warning where GPUs are expected, else info) and the CPU metrics go on. Does not own:
when to sample or where the values go (the tracker's flusher), nor whether a run is sampled at
all (the tracker's settings; the MLflow plugin decides for its runs).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from raydeck.tracking.messages import ProcessInfo

logger = logging.getLogger(__name__)

_MEGABYTE = 1e6  # MLflow's megabytes
_GB = 1024**3  # the per-process GPU readings' gigabytes

# MLflow's names for the node's readings (CPUMonitor, DiskMonitor, NetworkMonitor), in order.
CPU_UTILIZATION = "cpu_utilization_percentage"
MEMORY_USED_MB = "system_memory_usage_megabytes"
MEMORY_USED_PERCENT = "system_memory_usage_percentage"
DISK_USED_MB = "disk_usage_megabytes"
DISK_USED_PERCENT = "disk_usage_percentage"
DISK_AVAILABLE_MB = "disk_available_megabytes"
NETWORK_RECEIVED_MB = "network_receive_megabytes"
NETWORK_SENT_MB = "network_transmit_megabytes"
MLFLOW_NODE_METRICS = (CPU_UTILIZATION, MEMORY_USED_MB, MEMORY_USED_PERCENT, DISK_USED_MB,
                       DISK_USED_PERCENT, DISK_AVAILABLE_MB, NETWORK_RECEIVED_MB,
                       NETWORK_SENT_MB)
# MLflow's GPUMonitor's readings, each named gpu_<i>_<reading>.
MLFLOW_GPU_READINGS = ("memory_usage_percentage", "memory_usage_megabytes",
                       "utilization_percentage", "power_usage_watts", "power_usage_percentage")
# raydeck's own node readings, beside MLflow's: I/O rates in MB (10^6 bytes) per second since the
# previous sample, and each GPU's temperature (gpu_<i>_temperature_celsius).
RAYDECK_NODE_RATES = ("disk_read_mb_s", "disk_write_mb_s", "net_recv_mb_s", "net_sent_mb_s")
GPU_TEMPERATURE = "temperature_celsius"

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
    """Turns successive samples into gauges, totals since the sampler started and per-second
    rates.

    Args:
        node_label: the node's name in the keys (its IP), MLflow's ``node_id``: keys are
            ``system/<node_label>/<name>``, as MLflow's monitor prefixes a node's.
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
            self._last_net = self._first_net = psutil.net_io_counters()
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
            self._node_gpus = [(f"gpu_{index}_", index) for index in range(len(uuids))]
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
        """MLflow's node readings (as its monitors compute them), then raydeck's rates."""
        now = time.monotonic()
        elapsed = max(now - self._last_time, 1e-6)
        memory = psutil.virtual_memory()
        disk_space = psutil.disk_usage(os.sep)
        values = {
            CPU_UTILIZATION: psutil.cpu_percent(interval=None),
            MEMORY_USED_MB: memory.used / _MEGABYTE,
            MEMORY_USED_PERCENT: memory.used / memory.total * 100,
            DISK_USED_MB: disk_space.used / _MEGABYTE,
            DISK_USED_PERCENT: disk_space.percent,
            DISK_AVAILABLE_MB: disk_space.free / _MEGABYTE,
        }
        net = psutil.net_io_counters()
        if net is not None and self._first_net is not None:
            # Since this sampler started, as MLflow's NetworkMonitor counts from its start.
            values[NETWORK_RECEIVED_MB] = (
                (net.bytes_recv - self._first_net.bytes_recv) / _MEGABYTE)
            values[NETWORK_SENT_MB] = (net.bytes_sent - self._first_net.bytes_sent) / _MEGABYTE
        disk = psutil.disk_io_counters()
        if disk is not None and self._last_disk is not None:
            values["disk_read_mb_s"] = (
                (disk.read_bytes - self._last_disk.read_bytes) / _MEGABYTE / elapsed)
            values["disk_write_mb_s"] = (
                (disk.write_bytes - self._last_disk.write_bytes) / _MEGABYTE / elapsed)
        if net is not None and self._last_net is not None:
            values["net_recv_mb_s"] = (
                (net.bytes_recv - self._last_net.bytes_recv) / _MEGABYTE / elapsed)
            values["net_sent_mb_s"] = (
                (net.bytes_sent - self._last_net.bytes_sent) / _MEGABYTE / elapsed)
        self._last_time, self._last_disk, self._last_net = now, disk, net
        return values

    def _gpu_values(self) -> dict[str, float]:
        nvml = self._nvml
        assert nvml is not None
        values: dict[str, float] = {}
        try:
            readings: dict[int, _GpuReading] = {}
            for prefix, index in self._node_gpus:
                readings[index] = _GpuReading.of(nvml, index)
                values.update({prefix + name: value
                               for name, value in readings[index].mlflow_names().items()})
            pid = os.getpid()
            for prefix, index in self._process_gpus:
                mine = dict((readings.get(index) or _GpuReading.of(nvml, index)).process_names(),
                            nvml_index=index)
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


@dataclass(frozen=True)
class _GpuReading:
    """One GPU's raw NVML readings; None where the GPU does not support one (NVML's
    NotSupported, e.g. power on some boards)."""

    utilization_percent: float | None
    memory_used_bytes: float | None
    memory_total_bytes: float | None
    temperature_c: float | None
    power_mw: float | None
    power_limit_mw: float | None

    @classmethod
    def of(cls, nvml: Any, index: int) -> _GpuReading:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)

        def read(call: Callable[[], Any], unavailable: Any = nvml.NVMLError_NotSupported) -> Any:
            with contextlib.suppress(unavailable):
                return call()
            return None

        utilization = read(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        memory = read(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        return cls(
            utilization_percent=utilization.gpu if utilization is not None else None,
            memory_used_bytes=memory.used if memory is not None else None,
            memory_total_bytes=memory.total if memory is not None else None,
            temperature_c=read(lambda: nvml.nvmlDeviceGetTemperature(
                handle, nvml.NVML_TEMPERATURE_GPU)),
            power_mw=read(lambda: nvml.nvmlDeviceGetPowerUsage(handle)),
            # Only for power_usage_percentage: a limit NVML will not give drops that alone.
            power_limit_mw=read(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle),
                                nvml.NVMLError),
        )

    def mlflow_names(self) -> dict[str, float]:
        """The node view's readings: MLflow GPUMonitor's (units too), then the temperature."""
        values: dict[str, float] = {}
        if self.memory_used_bytes is not None and self.memory_total_bytes:
            values["memory_usage_percentage"] = (
                100.0 * self.memory_used_bytes / self.memory_total_bytes)
            values["memory_usage_megabytes"] = self.memory_used_bytes / _MEGABYTE
        if self.utilization_percent is not None:
            values["utilization_percentage"] = self.utilization_percent
        if self.power_mw is not None:
            values["power_usage_watts"] = self.power_mw / 1000.0
            if self.power_limit_mw:
                values["power_usage_percentage"] = 100.0 * self.power_mw / self.power_limit_mw
        if self.temperature_c is not None:
            values[GPU_TEMPERATURE] = self.temperature_c
        return values

    def process_names(self) -> dict[str, float]:
        """A process's GPU readings, raydeck's names (``gpu_<k>/<reading>``)."""
        values: dict[str, float] = {}
        if self.utilization_percent is not None:
            values["utilization_percent"] = self.utilization_percent
        if self.memory_used_bytes is not None and self.memory_total_bytes:
            values["memory_used_gb"] = self.memory_used_bytes / _GB
            values["memory_percent"] = 100.0 * self.memory_used_bytes / self.memory_total_bytes
        if self.temperature_c is not None:
            values["temperature_c"] = self.temperature_c
        if self.power_mw is not None:
            values["power_w"] = self.power_mw / 1000.0
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
