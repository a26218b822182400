"""The tracking proxy's own Prometheus metrics, exported through Ray's per-node metrics agent.

Ray prefixes custom metric names with ``ray_`` and counters get ``_total``: the Counter
``raydeck_tracking_points_written`` is scraped as ``ray_raydeck_tracking_points_written_total``.
Gauges are re-set on every writer cycle rather than only on change: Ray's exporter only carries a
gauge series that was recorded recently, so a gauge set once at start-up never reaches Prometheus.
Every name is listed in :data:`METRIC_NAMES` (README's metrics table and the dashboards use it).
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

WRITE_LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]

METRIC_NAMES: dict[str, str] = {
    "raydeck_tracking_points_received": "Counter: entities (points, params, tags, files) accepted",
    "raydeck_tracking_points_written": "Counter: entities written to MLflow",
    "raydeck_tracking_write_errors": "Counter: failed MLflow writes, by kind (transient/rejected)",
    "raydeck_tracking_write_latency_s": "Histogram: seconds per shard write cycle",
    "raydeck_tracking_queue_depth": "Gauge: entities accepted but not yet written",
    "raydeck_tracking_spool_bytes": "Gauge: bytes in the shard's spool directory",
    "raydeck_tracking_replay_backlog": "Gauge: spooled batches replayed after a restart, unwritten",
    "raydeck_tracking_active_runs": "Gauge: runs the router holds open",
}


class ShardMetrics:
    """The metrics one shard reports, labelled with the shard's index."""

    def __init__(self, shard: int) -> None:
        keys = ("shard",)
        self._tags = {"shard": str(shard)}
        self.received = Counter(
            "raydeck_tracking_points_received", METRIC_NAMES["raydeck_tracking_points_received"],
            tag_keys=keys,
        )
        self.written = Counter(
            "raydeck_tracking_points_written", METRIC_NAMES["raydeck_tracking_points_written"],
            tag_keys=keys,
        )
        self.errors = Counter(
            "raydeck_tracking_write_errors", METRIC_NAMES["raydeck_tracking_write_errors"],
            tag_keys=("shard", "kind"),
        )
        self.latency = Histogram(
            "raydeck_tracking_write_latency_s", METRIC_NAMES["raydeck_tracking_write_latency_s"],
            boundaries=WRITE_LATENCY_BUCKETS_S, tag_keys=keys,
        )
        self.queue_depth = Gauge(
            "raydeck_tracking_queue_depth", METRIC_NAMES["raydeck_tracking_queue_depth"],
            tag_keys=keys,
        )
        self.spool_bytes = Gauge(
            "raydeck_tracking_spool_bytes", METRIC_NAMES["raydeck_tracking_spool_bytes"],
            tag_keys=keys,
        )
        self.replay_backlog = Gauge(
            "raydeck_tracking_replay_backlog", METRIC_NAMES["raydeck_tracking_replay_backlog"],
            tag_keys=keys,
        )

    def count_received(self, n: int) -> None:
        if n:
            self.received.inc(n, self._tags)

    def count_written(self, n: int, seconds: float) -> None:
        if n:
            self.written.inc(n, self._tags)
        self.latency.observe(seconds, self._tags)

    def count_error(self, kind: str, n: int = 1) -> None:
        self.errors.inc(n, {**self._tags, "kind": kind})

    def set_levels(self, queue_depth: int, spool_bytes: int, replay_backlog: int) -> None:
        self.queue_depth.set(queue_depth, self._tags)
        self.spool_bytes.set(spool_bytes, self._tags)
        self.replay_backlog.set(replay_backlog, self._tags)


class RouterMetrics:
    """The router's metrics."""

    def __init__(self) -> None:
        self.active_runs = Gauge(
            "raydeck_tracking_active_runs", METRIC_NAMES["raydeck_tracking_active_runs"]
        )

    def set_active_runs(self, n: int) -> None:
        self.active_runs.set(n)
