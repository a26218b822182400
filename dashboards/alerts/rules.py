"""raydeck's alert rules; `raydeck dashboards render` writes them to raydeck.rules.yml.

Each rule says what is wrong (summary) and what to do (runbook). Every rule has a
`promtool test rules` unit test in tests/ that makes it fire and stay quiet. Thresholds are
module constants; `training_stalled()` takes its own so a test can shorten it.
"""

from raydeck.observability.alerts import AlertRule, RuleGroup
from raydeck.observability.metrics import (
    STORAGE_OP_ERRORS,
    TRACKING_POINTS_RECEIVED,
    TRACKING_POINTS_WRITTEN,
    TRACKING_QUEUE_DEPTH,
    TRACKING_SPOOL_BYTES,
    TRACKING_WRITE_ERRORS,
    TRAIN_STEP_TIME,
    TRAIN_STEP_TIMESTAMP,
)
from raydeck.observability.prometheus import CLUSTER_LABEL, RAY_JOB_NAME

GPU_MEMORY_FULL_FRACTION = 0.95
TRAINING_STALL_FLOOR_S = 900
TRAINING_STALL_STEP_MULTIPLE = 3
SPOOL_LIMIT_BYTES = 1024**3
RATE_WINDOW = "5m"

RUN = f"{CLUSTER_LABEL}, run, run_id"
GPU = "instance, GpuIndex, GpuDeviceName"

ray_node_down = AlertRule(
    name="RayNodeDown",
    expr=f'up{{job="{RAY_JOB_NAME}"}} == 0\n'
         f"or sum by ({CLUSTER_LABEL}, node_type) (ray_cluster_failed_nodes) > 0",
    for_s=60,
    severity="critical",
    summary="Ray node {{ with $labels.instance }}{{ . }}{{ else }}of type "
            "{{ $labels.node_type }}{{ end }} is down",
    runbook="Check the node's machine and its raylet log (/tmp/ray/session_latest/logs/"
            "raylet.out), then restart or replace it; `raydeck status` lists the nodes Ray "
            "sees. Ray Train jobs resume from their last checkpoint once capacity is back.",
)

gpu_memory_nearly_full = AlertRule(
    name="GpuMemoryNearlyFull",
    expr=f"sum by ({GPU}) (ray_node_gram_used)\n"
         f"/ (sum by ({GPU}) (ray_node_gram_used) + sum by ({GPU}) (ray_node_gram_available))\n"
         f"> {GPU_MEMORY_FULL_FRACTION}",
    for_s=300,
    severity="warning",
    summary="GPU {{ $labels.GpuIndex }} on {{ $labels.instance }} is "
            "{{ $value | humanizePercentage }} full",
    runbook="Find the job on that node (Cluster health dashboard, `ray list actors`); lower its "
            "batch size, enable gradient accumulation or checkpointing of activations before "
            "it runs out of memory.",
)

job_pending_infeasible = AlertRule(
    name="JobPendingInfeasible",
    expr=f'sum by ({CLUSTER_LABEL}) (ray_scheduler_unscheduleable_tasks{{Reason="Infeasible"}})'
         " > 0\n"
         f'or sum by ({CLUSTER_LABEL}) (ray_gcs_placement_group_count{{State="Infeasible"}}) > 0',
    for_s=120,
    severity="warning",
    summary="{{ $value }} task(s) or placement group(s) ask for resources no node has",
    runbook="`ray status` shows the unsatisfiable demand. Stop the job (`ray job stop`) and "
            "resubmit with a preset the cluster can run (`raydeck presets`), or add a node type "
            "that has the resources.",
)


def training_stalled(floor_s: float = TRAINING_STALL_FLOOR_S, for_s: float = 60) -> AlertRule:
    """No step for max(``floor_s``, 3 x the run's own step time) while its ranks are alive.

    The step timestamp is exported only while a rank's process lives (HeldGauge), so a run
    that finished or died does not fire; a hung one does.
    """
    timestamp = TRAIN_STEP_TIMESTAMP.prometheus_name
    step_time = TRAIN_STEP_TIME.prometheus_name
    return AlertRule(
        name="TrainingStalled",
        expr=f"(time() - max by ({RUN}) ({timestamp}))\n"
             f"> on ({RUN}) clamp_min(\n"
             f"  {TRAINING_STALL_STEP_MULTIPLE} * (max by ({RUN}) ({step_time})\n"
             f"       or on ({RUN}) 0 * max by ({RUN}) ({timestamp})),\n"
             f"  {floor_s:g})",
        for_s=for_s,
        severity="critical",
        summary="Run {{ $labels.run }} reported no step for {{ $value | humanizeDuration }}",
        runbook="Its workers are alive but make no progress. Read the rank logs (MLflow run, "
                "logs/rank_<i>.txt) and `ray stack` on the node for a hang (data loader, "
                "collective op); stop the job and resubmit to resume from the last checkpoint.",
    )


tracking_backlog_growing = AlertRule(
    name="TrackingBacklogGrowing",
    expr=f"sum by ({CLUSTER_LABEL}) ({TRACKING_QUEUE_DEPTH.prometheus_name}) > 0\n"
         f"and sum by ({CLUSTER_LABEL}) "
         f"(rate({TRACKING_POINTS_RECEIVED.prometheus_name}[{RATE_WINDOW}]))\n"
         f"  > sum by ({CLUSTER_LABEL}) "
         f"(rate({TRACKING_POINTS_WRITTEN.prometheus_name}[{RATE_WINDOW}]))",
    for_s=600,
    severity="warning",
    summary="The tracking proxy accepts more than it writes to MLflow; "
            "{{ $value }} entities wait",
    runbook="MLflow is slower than the jobs log, or unreachable: check the MLflow server and "
            "its database; `raydeck tracking status` shows each shard's queue and last error. "
            "Nothing is lost: the spool keeps everything until MLflow catches up.",
)

tracking_writes_failing = AlertRule(
    name="TrackingWritesFailing",
    expr=f"sum by ({CLUSTER_LABEL}) (increase("
         f'{TRACKING_WRITE_ERRORS.prometheus_name}{{kind="transient"}}[{RATE_WINDOW}])) > 0',
    for_s=300,
    severity="warning",
    summary="MLflow writes keep failing ({{ $value }} in 5 minutes); data waits in the spool",
    runbook="The shards cannot reach MLflow and retry with backoff. Fix the MLflow server or "
            "RAYDECK_TRACKING_URI; `raydeck tracking status` shows the last error.",
)

tracking_values_rejected = AlertRule(
    name="TrackingValuesRejected",
    expr=f"sum by ({CLUSTER_LABEL}) (increase("
         f'{TRACKING_WRITE_ERRORS.prometheus_name}{{kind="rejected"}}[{RATE_WINDOW}])) > 0',
    for_s=0,
    severity="warning",
    summary="MLflow refused {{ $value }} logged value(s)",
    runbook="MLflow permanently refused values (e.g. a param logged twice with different "
            "values); the job's tracker.finish() raises TrackingWriteError naming them. Fix the "
            "job's logging calls.",
)

tracking_spool_large = AlertRule(
    name="TrackingSpoolLarge",
    expr=f"max by ({CLUSTER_LABEL}, instance, shard) ({TRACKING_SPOOL_BYTES.prometheus_name})"
         f" > {SPOOL_LIMIT_BYTES}",
    for_s=300,
    severity="warning",
    summary="Tracking shard {{ $labels.shard }} spools {{ $value | humanize1024 }}B",
    runbook="More than 1 GiB waits on disk for MLflow (see TrackingBacklogGrowing). Make sure "
            "the disk holding the raydeck data dir has room; never delete the spool, it is the "
            "only copy.",
)

storage_errors = AlertRule(
    name="StorageErrors",
    expr=f"sum by ({CLUSTER_LABEL}, op) "
         f"(increase({STORAGE_OP_ERRORS.prometheus_name}[{RATE_WINDOW}])) > 0",
    for_s=60,
    severity="warning",
    summary="Object storage {{ $labels.op }} calls fail ({{ $value }} in 5 minutes)",
    runbook="Checkpoints and artifacts may not be saved. `raydeck status` checks the endpoint "
            "and credentials; check the MinIO server's health and free space.",
)

RULE_GROUPS = (
    RuleGroup("raydeck-cluster", (ray_node_down, gpu_memory_nearly_full, job_pending_infeasible)),
    RuleGroup("raydeck-training", (training_stalled(),)),
    RuleGroup("raydeck-tracking", (tracking_backlog_growing, tracking_writes_failing,
                                   tracking_values_rejected, tracking_spool_large)),
    RuleGroup("raydeck-storage", (storage_errors,)),
)
