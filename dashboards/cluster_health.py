"""Cluster health: is every node up, how busy is it, is work stuck, is object storage healthy.

Reads Ray's own node, scheduler and object-store metrics, plus raydeck's storage metrics.
Rendered to grafana/raydeck-cluster-health.json by `raydeck dashboards render`.
"""

from raydeck.observability.dashboards import (
    CLUSTER,
    CLUSTER_FILTER,
    NODE,
    Dashboard,
    Panel,
    Row,
    Target,
    Threshold,
    selector,
)
from raydeck.observability.metrics import STORAGE_OP_ERRORS, STORAGE_OP_LATENCY

NODE_FILTER = 'instance=~"$node"'
ON_NODE = (CLUSTER_FILTER, NODE_FILTER)
PER_NODE = "instance"
GPU = "needs GPUs: CPU-only nodes export no GPU metrics"
NO_STORAGE = "object storage is not configured, or nothing used it yet"
INFEASIBLE_TASKS = selector("ray_scheduler_unscheduleable_tasks", CLUSTER_FILTER,
                            'Reason="Infeasible"')
INFEASIBLE_GROUPS = selector("ray_gcs_placement_group_count", CLUSTER_FILTER,
                             'State="Infeasible"')
UNFINISHED_TASKS = selector("ray_tasks", *ON_NODE, 'State!~"FINISHED|FAILED"')
EXECUTOR_ACTORS = selector("ray_actors", CLUSTER_FILTER, 'Source="executor"')
OBJECT_STORE_CAPACITY = selector("ray_resources", *ON_NODE, 'Name="object_store_memory"')


def _ratio_percent(used: str, other: str, by: str) -> str:
    """100 * used / (used + other), both summed by ``by`` on the selected nodes."""
    used_sel, other_sel = selector(used, *ON_NODE), selector(other, *ON_NODE)
    return (f"100 * sum by ({by}) ({used_sel}) / "
            f"(sum by ({by}) ({used_sel}) + sum by ({by}) ({other_sel}))")


cluster_row = Row("Cluster", (
    Panel("Nodes alive", (Target(f"sum({selector('ray_cluster_active_nodes', CLUSTER_FILTER)})",
                                 "alive"),),
          kind="stat", width=6, height=4,
          description="Nodes Ray considers alive (reported by the head node)."),
    Panel("Failed nodes", (Target(f"sum({selector('ray_cluster_failed_nodes', CLUSTER_FILTER)})",
                                  "failed"),),
          kind="stat", width=6, height=4, thresholds=(Threshold(1, "red"),), no_value="0",
          empty_ok="no node has failed (Ray exports the count only once one has)",
          description="Nodes the autoscaler saw fail. Any: see RayNodeDown's runbook."),
    Panel("Running jobs", (Target(f"sum({selector('ray_running_jobs', CLUSTER_FILTER)})",
                                  "jobs"),),
          kind="stat", width=6, height=4, description="Ray jobs (drivers) running now."),
    Panel("Infeasible tasks and placement groups", (Target(
        f"sum({INFEASIBLE_TASKS}) + (sum({INFEASIBLE_GROUPS}) or vector(0))", "infeasible"),),
        kind="stat", width=6, height=4, thresholds=(Threshold(1, "orange"),),
        description="Work asking for resources no node has (e.g. a GPU on a CPU cluster): it "
                    "pends forever. See the JobPendingInfeasible runbook."),
))

nodes_row = Row("Nodes", (
    Panel("CPU utilization per node", (Target(
        f"max by ({PER_NODE}) ({selector('ray_node_cpu_utilization', *ON_NODE)})",
        "{{instance}}"),), unit="percent",
        description="Host CPU busy, per node (all processes, not only Ray's)."),
    Panel("Memory used per node", (Target(
        _ratio_percent("ray_node_mem_used", "ray_node_mem_available", PER_NODE),
        "{{instance}}"),), unit="percent", thresholds=(Threshold(90, "red"),),
        description="Host memory in use. Near 100%, Ray's memory monitor starts killing "
                    "workers."),
    Panel("Disk used per node", (Target(
        _ratio_percent("ray_node_disk_usage", "ray_node_disk_free", PER_NODE),
        "{{instance}}"),), unit="percent", thresholds=(Threshold(90, "red"),),
        description="Disk holding Ray's temp dir (spilled objects, logs, the tracking spool)."),
    Panel("Object store used per node", (
        Target(f"sum by ({PER_NODE}) ({selector('ray_object_store_memory', *ON_NODE)})",
               "{{instance}} used"),
        Target(f"sum by ({PER_NODE}) ({OBJECT_STORE_CAPACITY})", "{{instance}} capacity"),
    ), unit="bytes", description="Plasma object store: bytes held (any location) and capacity."),
    Panel("GPU utilization", (Target(
        f"avg by ({PER_NODE}, GpuIndex) ({selector('ray_node_gpus_utilization', *ON_NODE)})",
        "{{instance}} GPU {{GpuIndex}}"),), unit="percent", empty_ok=GPU,
        description="Per GPU, from Ray's node metrics; GpuIndex is the NVML index, the <i> of "
                    "system/<node>/gpu_<i>_<reading> in a run's MLflow metrics. Low while a job "
                    "holds the GPU: the input pipeline is the bottleneck."),
    Panel("GPU memory used", (Target(
        _ratio_percent("ray_node_gram_used", "ray_node_gram_available", f"{PER_NODE}, GpuIndex"),
        "{{instance}} GPU {{GpuIndex}}"),), unit="percent", thresholds=(Threshold(95, "red"),),
        empty_ok=GPU, description="Per GPU. Above 95% for minutes: GpuMemoryNearlyFull fires."),
))

work_row = Row("Work", (
    Panel("Tasks by state", (Target(
        f"clamp_min(sum by (State) ({UNFINISHED_TASKS}), 0)", "{{State}}"),), stack=True,
        description="Tasks not yet finished, by state (includes actor method calls)."),
    Panel("Actors by state", (Target(
        f"sum by (State) ({EXECUTOR_ACTORS})", "{{State}}"),), stack=True,
        description="Actors per state (tracking shards, Train workers, ...)."),
    Panel("Tasks waiting to be scheduled", (Target(
        f"sum by (Reason) ({selector('ray_scheduler_unscheduleable_tasks', *ON_NODE)})",
        "{{Reason}}"),), stack=True,
        description="WaitingForResources: the cluster is full; Infeasible: no node can ever "
                    "run it."),
    Panel("Worker start-up failures", (Target(
        f"sum by (Reason) (increase("
        f"{selector('ray_scheduler_failed_worker_startup', *ON_NODE, suffix='_total')}"
        "[$__rate_interval]))", "{{Reason}}"),),
        description="Worker processes that failed to start (runtime env, registration)."),
    Panel("Unexpected worker deaths", (Target(
        f"sum by ({PER_NODE}) (increase("
        f"{selector('ray_node_manager_unexpected_worker_failure', *ON_NODE, suffix='_total')}"
        "[$__rate_interval]))", "{{instance}}"),), no_value="0",
        empty_ok="no worker has died unexpectedly",
        description="Workers that crashed or were OOM-killed; Ray Train restarts from the last "
                    "checkpoint."),
))

storage_row = Row("Object storage", (
    Panel("Storage operations per second", (Target(
        f"sum by (op) (rate({selector(STORAGE_OP_LATENCY, *ON_NODE, suffix='_count')}"
        "[$__rate_interval]))", "{{op}}"),), unit="ops",
        description="Object-storage calls raydeck made, by operation.",
        empty_ok=NO_STORAGE),
    Panel("Storage latency p90", (Target(
        "histogram_quantile(0.9, sum by (op, le) (rate("
        f"{selector(STORAGE_OP_LATENCY, *ON_NODE, suffix='_bucket')}[$__rate_interval])))",
        "{{op}}"),), unit="s",
        empty_ok=NO_STORAGE,
        description="90th percentile seconds per operation."),
    Panel("Storage errors", (Target(
        f"sum by (op) (increase({selector(STORAGE_OP_ERRORS, *ON_NODE)}[$__rate_interval]))",
        "{{op}}"),), thresholds=(Threshold(1, "red"),),
        empty_ok=NO_STORAGE,
        description="Operations that raised. Any: see the StorageErrors runbook."),
))

DASHBOARD = Dashboard(
    uid="raydeck-cluster-health",
    title="raydeck / Cluster health",
    description="Is every Ray node up, how busy, is work stuck, is object storage healthy.",
    variables=(CLUSTER, NODE),
    rows=(cluster_row, nodes_row, work_row, storage_row),
)
