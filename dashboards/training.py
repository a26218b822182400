"""Training: per run, is it progressing, how fast, is the loss moving, are checkpoints landing.

Reads what `raydeck.train.checkpointing.report_epoch` exports from every rank (run, rank, job_id
labels), plus Ray Train's controller state. Rendered to grafana/raydeck-training.json.
"""

from raydeck.observability.dashboards import (
    CLUSTER,
    CLUSTER_FILTER,
    JOB,
    RUN,
    Dashboard,
    Panel,
    Row,
    Target,
    Threshold,
    selector,
)
from raydeck.observability.metrics import (
    LOSS_KEY_PART,
    THROUGHPUT_KEY,
    TRAIN_CHECKPOINT_BYTES,
    TRAIN_CHECKPOINT_SAVE,
    TRAIN_LOSS,
    TRAIN_SAMPLES_PER_S,
    TRAIN_STEP,
    TRAIN_STEP_TIME,
    TRAIN_STEP_TIMESTAMP,
)

RUN_FILTERS = (CLUSTER_FILTER, 'job_id=~"$job"', 'run=~"$run"')
STEP_TIMESTAMP = selector(TRAIN_STEP_TIMESTAMP, *RUN_FILTERS)
SAVE_SUM = selector(TRAIN_CHECKPOINT_SAVE, *RUN_FILTERS, suffix="_sum")
SAVE_COUNT = selector(TRAIN_CHECKPOINT_SAVE, *RUN_FILTERS, suffix="_count")
RANK_ZERO_SAVES = selector(TRAIN_CHECKPOINT_SAVE, *RUN_FILTERS, 'rank="0"', suffix="_count")

progress_row = Row("Progress", (
    Panel("Last step", (Target(f"max by (run) ({selector(TRAIN_STEP, *RUN_FILTERS)})",
                               "{{run}}"),),
          kind="stat", width=6, height=5,
          description="Highest step (epoch) any rank of the run reported."),
    Panel("Time since last step", (Target(f"time() - max by (run) ({STEP_TIMESTAMP})",
                                          "{{run}}"),),
          kind="stat", unit="s", width=6, height=5,
          thresholds=(Threshold(300, "orange"), Threshold(900, "red")),
          description="Seconds since the run's newest step. Grows while a live job makes no "
                      "progress: see the TrainingStalled runbook."),
    Panel("Ranks reporting", (Target(f"count by (run) ({STEP_TIMESTAMP})", "{{run}}"),),
          kind="stat", width=6, height=5,
          description="Ranks whose process is alive and has reported a step. Fewer than the "
                      "run's workers: a rank died or never started."),
    Panel("Checkpoints saved", (Target(
        f"max by (run) (max_over_time({RANK_ZERO_SAVES}[$__range]))", "{{run}}"),),
        kind="stat", width=6, height=5,
        description="Checkpoints rank 0 wrote since its process started (one per step)."),
    Panel("Throughput per run", (Target(
        f"sum by (run) ({selector(TRAIN_SAMPLES_PER_S, *RUN_FILTERS)})", "{{run}}"),),
        unit="suffix: samples/s",
        description=f"Sum over ranks of the `{THROUGHPUT_KEY}` value the job reports."),
    Panel("Throughput per rank", (Target(
        f"max by (run, rank) ({selector(TRAIN_SAMPLES_PER_S, *RUN_FILTERS)})",
        "{{run}} rank {{rank}}"),), unit="suffix: samples/s",
        description="A rank far below the others is a straggler (slow node or skewed data)."),
    Panel("Step time per rank", (Target(
        f"max by (run, rank) ({selector(TRAIN_STEP_TIME, *RUN_FILTERS)})",
        "{{run}} rank {{rank}}"),), unit="s",
        description="Seconds between a rank's last two reported steps (includes evaluation "
                    "and checkpointing)."),
    Panel("Loss", (Target(
        f"avg by (run, name) ({selector(TRAIN_LOSS, *RUN_FILTERS)})", "{{run}} {{name}}"),),
        description=f"Mean over ranks of every reported value whose key contains "
                    f"`{LOSS_KEY_PART}`.",
        empty_ok=f"the job reports no value whose key contains '{LOSS_KEY_PART}'"),
))

checkpoint_row = Row("Checkpoints", (
    Panel("Mean checkpoint save time per rank", (Target(
        f"max by (run, rank) ({SAVE_SUM} / {SAVE_COUNT})", "{{run}} rank {{rank}}"),), unit="s",
        description="Seconds to write and report a checkpoint, averaged since the rank "
                    "started; rising: storage is slow (see the storage panels)."),
    Panel("Checkpoint size per rank", (Target(
        f"max by (run, rank) ({selector(TRAIN_CHECKPOINT_BYTES, *RUN_FILTERS)})",
        "{{run}} rank {{rank}}"),), unit="bytes",
        description="Bytes of the last checkpoint each rank wrote (rank 0 holds the model)."),
))

ray_train_row = Row("Ray Train", (
    Panel("Train controller state", (Target(
        "sum by (ray_train_run_name, ray_train_controller_state) "
        f"({selector('ray_train_controller_state', CLUSTER_FILTER)})",
        "{{ray_train_run_name}} {{ray_train_controller_state}}"),), stack=True, width=24,
        description="Ray Train's own view of each run: RUNNING, RESTARTING after a worker "
                    "failure, ERRORED."),
))

DASHBOARD = Dashboard(
    uid="raydeck-training",
    title="raydeck / Training",
    description="Per run: progress, throughput, step time, loss, ranks, checkpoints.",
    variables=(CLUSTER, JOB, RUN),
    rows=(progress_row, checkpoint_row, ray_train_row),
)
