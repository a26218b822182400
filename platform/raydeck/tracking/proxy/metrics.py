"""The tracking proxy's own Prometheus metrics, exported through Ray's per-node metrics agent.

The metrics themselves are declared in :mod:`raydeck.observability.metrics` (the one registry
README's table and the dashboards use); this module is what the shard and router call.
Ray prefixes custom metric names with ``ray_`` and counters get ``_total``: the Counter
``raydeck_tracking_points_written`` is scraped as ``ray_raydeck_tracking_points_written_total``.

Gauges are :class:`~raydeck.observability.metrics.HeldGauge` objects: Ray exports a gauge value
only once after each ``set()``, so a writer thread stuck in MLflow retries would otherwise make
the backlog vanish from Prometheus exactly when it matters. The queue depth also follows the
received/written counts between the writer's exact samples, so it keeps rising during an outage.
The error counter is exported at zero for both kinds from the start, so ``increase()`` sees the
first error.
"""

from __future__ import annotations

import threading

from raydeck.observability.metrics import (
    TRACKING_ACTIVE_RUNS,
    TRACKING_POINTS_RECEIVED,
    TRACKING_POINTS_WRITTEN,
    TRACKING_QUEUE_DEPTH,
    TRACKING_REPLAY_BACKLOG,
    TRACKING_SPOOL_BYTES,
    TRACKING_WRITE_ERRORS,
    TRACKING_WRITE_LATENCY,
    counter,
    gauge,
    histogram,
    zero_counter,
)

WRITE_ERROR_KINDS = ("transient", "rejected")


class ShardMetrics:
    """The metrics one shard reports, labelled with the shard's index."""

    def __init__(self, shard: int) -> None:
        self._tags = {"shard": str(shard)}
        self.received = counter(TRACKING_POINTS_RECEIVED)
        self.written = counter(TRACKING_POINTS_WRITTEN)
        self.errors = counter(TRACKING_WRITE_ERRORS)
        self.latency = histogram(TRACKING_WRITE_LATENCY)
        self.queue_depth = gauge(TRACKING_QUEUE_DEPTH)
        self.spool_bytes = gauge(TRACKING_SPOOL_BYTES)
        self.replay_backlog = gauge(TRACKING_REPLAY_BACKLOG)
        for kind in WRITE_ERROR_KINDS:
            zero_counter(TRACKING_WRITE_ERRORS, {**self._tags, "kind": kind})
        self._lock = threading.Lock()
        self._depth = 0

    def count_received(self, n: int) -> None:
        if n:
            self.received.inc(n, self._tags)
            self._move_depth(n)

    def count_written(self, n: int) -> None:
        if n:
            self.written.inc(n, self._tags)
            self._move_depth(-n)

    def observe_write(self, seconds: float) -> None:
        self.latency.observe(seconds, self._tags)

    def count_error(self, kind: str, n: int = 1) -> None:
        self.errors.inc(n, {**self._tags, "kind": kind})

    def set_levels(self, queue_depth: int, spool_bytes: int, replay_backlog: int) -> None:
        with self._lock:
            self._depth = queue_depth
            self.queue_depth.set(queue_depth, self._tags)
        self.spool_bytes.set(spool_bytes, self._tags)
        self.replay_backlog.set(replay_backlog, self._tags)

    def _move_depth(self, delta: int) -> None:
        with self._lock:
            self._depth = max(0, self._depth + delta)
            self.queue_depth.set(self._depth, self._tags)


class RouterMetrics:
    """The router's metrics."""

    def __init__(self) -> None:
        self.active_runs = gauge(TRACKING_ACTIVE_RUNS)

    def set_active_runs(self, n: int) -> None:
        self.active_runs.set(n)
