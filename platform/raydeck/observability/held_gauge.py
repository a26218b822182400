"""Ray gauges that stay exported while their process lives: :class:`HeldGauge`.

Owns: :class:`HeldGauge`, the one keeper thread per process that sets every held value again,
and :func:`export_interval_s` (how often this process exports to its node's metrics agent).
Does not own: which gauges exist or their labels (:mod:`raydeck.observability.metrics`, whose
:func:`~raydeck.observability.metrics.gauge` makes one per metric and process).

Why a gauge that is set once never shows up (measured with Ray 2.60, and read in its source):
the process's C++ metric recorder keeps a gauge value only until its next export to the agent
(every ``metrics_report_interval_ms``, 10 s by default) and then clears it, so each ``set()`` is
exported exactly once; the agent keeps a received gauge value for two export intervals and then
evicts it (``OpenTelemetryMetricRecorder`` in ``ray/_private/telemetry``). A gauge set once is
therefore on the export port for about 20 s, 10 s after the ``set()``: a Prometheus that scrapes
every 15-60 s sees it once or never. Counters and histograms are cumulative and stay.
:class:`HeldGauge` is raydeck's fix: it remembers the last value of each series, and one keeper
thread per process sets every held value again twice per export interval until the series is
forgotten or the process exits (after which the series ages out within ~20 s, which is what a
dashboard should show for a process that is gone).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray.util.metrics import Gauge

logger = logging.getLogger(__name__)

DEFAULT_EXPORT_INTERVAL_MS = 10_000
# Ray never exports more often than once a second (``SetReportInterval`` in stats.h).
MIN_EXPORT_INTERVAL_MS = 1_000
# A held gauge is set again this many times per export interval, so every export carries it.
REFRESHES_PER_EXPORT = 2


def export_interval_s() -> float:
    """How often this process's Ray metric recorder exports to the node's metrics agent."""
    try:
        import ray

        interval_ms = int(ray._config.metrics_report_interval_ms())
    except Exception:  # not a Ray process, or Ray moved its config: use Ray's default
        interval_ms = DEFAULT_EXPORT_INTERVAL_MS
    return max(interval_ms, MIN_EXPORT_INTERVAL_MS) / 1000.0


class _GaugeKeeper:
    """Sets every held gauge value again, twice per Ray export interval, from one thread.

    The thread is a daemon on purpose: a held value means "this process is alive and says so";
    after the process exits there is nothing to flush, and the series must age out.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[Gauge, dict, float]] = {}
        self._thread_pid: int | None = None
        self.refresh_cycles = 0

    def hold(self, name: str, ray_gauge: Gauge, tags: dict[str, str], value: float) -> None:
        with self._lock:
            ray_gauge.set(value, tags)
            self._series[(name, tuple(sorted(tags.items())))] = (ray_gauge, tags, value)
            if self._thread_pid != os.getpid():
                # Started lazily, and again in a forked child, which inherits no threads.
                self._thread_pid = os.getpid()
                threading.Thread(target=self._run, name="raydeck-gauge-keeper",
                                 daemon=True).start()

    def release(self, name: str, tags: dict[str, str]) -> None:
        with self._lock:
            self._series.pop((name, tuple(sorted(tags.items()))), None)

    def held(self) -> int:
        """Number of series this process keeps alive."""
        with self._lock:
            return len(self._series)

    def _run(self) -> None:
        interval_s = export_interval_s() / REFRESHES_PER_EXPORT
        while True:
            time.sleep(interval_s)
            with self._lock:
                # Under the lock, so a concurrent hold() of a newer value is never overwritten
                # by the older one.
                for ray_gauge, tags, value in self._series.values():
                    try:
                        ray_gauge.set(value, tags)
                    except Exception:
                        logger.exception("could not refresh a gauge; it will age out")
                self.refresh_cycles += 1


_KEEPER = _GaugeKeeper()


class HeldGauge:
    """A Ray Gauge whose series stay exported until forgotten or the process exits.

    Use it for every gauge: a plain Ray Gauge disappears from Prometheus about 20 s after its
    last ``set()`` (module docstring). The arguments are Ray's ``Gauge``'s.
    """

    def __init__(self, name: str, description: str, tag_keys: tuple[str, ...] = ()) -> None:
        from ray.util.metrics import Gauge

        self.name = name
        self._gauge = Gauge(name, description, tag_keys=tag_keys)

    def set(self, value: float, tags: Mapping[str, str] | None = None) -> None:
        """Set the series for ``tags`` to ``value`` and keep exporting it."""
        _KEEPER.hold(self.name, self._gauge, dict(tags or {}), float(value))

    def forget(self, tags: Mapping[str, str] | None = None) -> None:
        """Stop exporting the series for ``tags`` (it ages out of Prometheus within ~20 s)."""
        _KEEPER.release(self.name, dict(tags or {}))


def held_series() -> int:
    """How many gauge series this process keeps exported (for tests and debugging)."""
    return _KEEPER.held()
