"""Tracking proxy: is the pipeline from trackers to MLflow keeping up, and is anything lost.

Reads the proxy's own metrics (raydeck.tracking.proxy.metrics). Rendered to
grafana/raydeck-tracking-proxy.json.
"""

from raydeck.observability.dashboards import (
    CLUSTER,
    CLUSTER_FILTER,
    Dashboard,
    Panel,
    Row,
    Target,
    Threshold,
    quantile_target,
    selector,
)
from raydeck.observability.metrics import (
    TRACKING_ACTIVE_RUNS,
    TRACKING_POINTS_RECEIVED,
    TRACKING_POINTS_WRITTEN,
    TRACKING_QUEUE_DEPTH,
    TRACKING_REPLAY_BACKLOG,
    TRACKING_SPOOL_BYTES,
    TRACKING_WRITE_ERRORS,
    TRACKING_WRITE_LATENCY,
)

SPOOL_WARNING_BYTES = 1024**3


def _latency_quantile(quantile: float) -> Target:
    return quantile_target(TRACKING_WRITE_LATENCY, quantile, (CLUSTER_FILTER,))


throughput_row = Row("Throughput", (
    Panel("Active runs", (Target(f"sum({selector(TRACKING_ACTIVE_RUNS, CLUSTER_FILTER)})",
                                 "runs"),),
          kind="stat", width=6, height=8, description="Runs the proxy holds open."),
    Panel("Ingest vs write rate", (
        Target(f"sum(rate({selector(TRACKING_POINTS_RECEIVED, CLUSTER_FILTER)}"
               "[$__rate_interval]))", "received"),
        Target(f"sum(rate({selector(TRACKING_POINTS_WRITTEN, CLUSTER_FILTER)}"
               "[$__rate_interval]))", "written to MLflow"),
    ), unit="cps", width=18,
        description="Entities (points, params, tags, files) per second. Written below "
                    "received for long: MLflow is slow or down, the backlog grows."),
    Panel("Write latency", (_latency_quantile(0.5), _latency_quantile(0.9),
                            _latency_quantile(0.99)), unit="s",
          description="Seconds per shard write cycle (one bulk MLflow write)."),
    Panel("Write errors", (Target(
        f"sum by (kind) (increase({selector(TRACKING_WRITE_ERRORS, CLUSTER_FILTER)}"
        "[$__rate_interval]))", "{{kind}}"),), thresholds=(Threshold(1, "red"),),
        description="transient: MLflow unreachable, retried, nothing lost; rejected: MLflow "
                    "refused values (the run's status shows them)."),
))

backlog_row = Row("Backlog", (
    Panel("Queue depth per shard", (Target(
        f"max by (shard) ({selector(TRACKING_QUEUE_DEPTH, CLUSTER_FILTER)})",
        "shard {{shard}}"),), stack=True,
        description="Entities accepted and spooled but not yet in MLflow."),
    Panel("Spool size per shard", (Target(
        f"max by (shard) ({selector(TRACKING_SPOOL_BYTES, CLUSTER_FILTER)})",
        "shard {{shard}}"),), unit="bytes", stack=True,
        thresholds=(Threshold(SPOOL_WARNING_BYTES, "orange"),),
        description="Bytes on disk waiting to be written; survives restarts."),
    Panel("Replay backlog per shard", (Target(
        f"max by (shard) ({selector(TRACKING_REPLAY_BACKLOG, CLUSTER_FILTER)})",
        "shard {{shard}}"),), stack=True,
        description="Spooled batches found after a shard restart, not yet written."),
))

DASHBOARD = Dashboard(
    uid="raydeck-tracking-proxy",
    title="raydeck / Tracking proxy",
    description="Ingest vs write rate, backlog, spool, errors and latency of the tracking proxy.",
    variables=(CLUSTER,),
    rows=(throughput_row, backlog_row),
)
