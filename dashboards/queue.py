"""Queue: how many jobs each team has waiting and running, how long they wait, how often the
queue preempts their jobs, and how good the queue's duration predictions are.

Reads the queue actor's metrics (raydeck.observability.metrics, ``QUEUE_*``). Rendered to
grafana/raydeck-queue.json.
"""

from raydeck.observability.dashboards import (
    CLUSTER,
    CLUSTER_FILTER,
    Dashboard,
    Panel,
    Row,
    Target,
    Variable,
    quantile_target,
    selector,
)
from raydeck.observability.metrics import (
    QUEUE_DURATION_RATIO,
    QUEUE_JOBS,
    QUEUE_PREEMPTIONS,
    QUEUE_WAIT,
    MetricSpec,
)

TEAM = Variable(
    "team", "Team", f"label_values({QUEUE_JOBS.prometheus_name}{{{CLUSTER_FILTER}}}, team)",
    "Team of the queued jobs (`raydeck submit --queue --team`)")
FILTERS = (CLUSTER_FILTER, 'team=~"$team"')


def _jobs_in(state: str) -> Target:
    in_state = f'state="{state}"'
    return Target(f"sum by (team) ({selector(QUEUE_JOBS, *FILTERS, in_state)})", "{{team}}")


def _quantile(metric: MetricSpec, quantile: float) -> Target:
    return quantile_target(metric, quantile, FILTERS, by="team")


queue_row = Row("Queue", (
    Panel("Queued jobs per team", (_jobs_in("queued"),), stack=True,
          description="Jobs waiting; `raydeck queue` says why each waits."),
    Panel("Running jobs per team", (_jobs_in("running"),), stack=True,
          description="Jobs the queue started that have not ended."),
    Panel("Wait before start", (_quantile(QUEUE_WAIT, 0.5), _quantile(QUEUE_WAIT, 0.95)),
          unit="s", description="Seconds from `raydeck submit --queue` to the job's start."),
    Panel("Preemptions", (Target(
        f"sum by (team) (increase({selector(QUEUE_PREEMPTIONS, *FILTERS)}[$__rate_interval]))",
        "{{team}}"),), stack=True,
          description="Jobs of each team asked to stop at their next checkpoint for a job of "
                      "higher priority; each resumes from that checkpoint in its MLflow run."),
    Panel("Duration / prediction", (_quantile(QUEUE_DURATION_RATIO, 0.5),
                                    _quantile(QUEUE_DURATION_RATIO, 0.9)),
          description="A finished job's duration over what the queue predicted (from earlier "
                      "runs of the same job, or --estimate): 1 is exact, above 1 the queue "
                      "was optimistic."),
))

DASHBOARD = Dashboard(
    uid="raydeck-queue",
    title="raydeck / Queue",
    description="Queued and running jobs per team, waits, preemptions and prediction error.",
    variables=(CLUSTER, TEAM),
    rows=(queue_row,),
)
