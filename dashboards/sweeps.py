"""Sweeps: how many trials are in each state, and the best score so far.

Reads what the sweep driver reports through raydeck.observability.metrics.SweepMetrics; each
trial's training progress is on the Training dashboard (its run). Rendered to
grafana/raydeck-sweeps.json.
"""

from raydeck.observability.dashboards import (
    CLUSTER,
    CLUSTER_FILTER,
    SWEEP,
    Dashboard,
    Panel,
    Row,
    Target,
    Threshold,
    selector,
)
from raydeck.observability.metrics import SWEEP_BEST_SCORE, SWEEP_TRIALS

SWEEP_FILTERS = (CLUSTER_FILTER, 'sweep=~"$sweep"')


def _trials_in(state: str) -> str:
    in_state = f'state="{state}"'
    return f"sum({selector(SWEEP_TRIALS, *SWEEP_FILTERS, in_state)})"


sweeps_row = Row("Sweeps", (
    Panel("Running trials", (Target(_trials_in("running"), "running"),), kind="stat",
          width=6, height=5, description="Trials training right now."),
    Panel("Completed trials", (Target(_trials_in("completed"), "completed"),), kind="stat",
          width=6, height=5, description="Trials that ran to their last step."),
    Panel("Stopped early", (Target(_trials_in("stopped_early"), "stopped_early"),),
          kind="stat", width=6, height=5,
          description="Trials the scheduler (ASHA) stopped at a rung."),
    Panel("Errored trials", (Target(_trials_in("errored"), "errored"),), kind="stat",
          width=6, height=5, thresholds=(Threshold(1, "red"),),
          description="Trials that failed; their MLflow runs hold the error and logs."),
    Panel("Trial states over time", (Target(
        f"sum by (sweep, state) ({selector(SWEEP_TRIALS, *SWEEP_FILTERS)})",
        "{{sweep}} {{state}}"),), stack=True,
        description="Trials per state for each sweep."),
    Panel("Best score", (Target(
        f"max by (sweep, metric, mode) ({selector(SWEEP_BEST_SCORE, *SWEEP_FILTERS)})",
        "{{sweep}} {{metric}} ({{mode}})"),),
        description="Best value of the sweep's metric so far."),
))

DASHBOARD = Dashboard(
    uid="raydeck-sweeps",
    title="raydeck / Sweeps",
    description="Trial states over time and the best score of each sweep.",
    variables=(CLUSTER, SWEEP),
    rows=(sweeps_row,),
)
