"""What a finished sweep tells its caller and its parent run: every trial's outcome, the best.

Owns: :class:`SweepResult` and :class:`TrialSummary`, ending every trial's child run with its
final status (waiting, so the record is certain), and writing the summary on the parent run:
the best trial's id, run, score (``best_<metric>``), its config (scalars as ``best.<name>``
tags, the whole config as JSON in the ``raydeck.best_config`` tag and ``sweep/best_trial.json``),
the count of trials per status, and how well the sweep used its slots. Does not own:
registering the best model (:mod:`raydeck.tune.registry`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raydeck._internal.redaction import quiet_mlflow_urls
from raydeck.config.settings import Settings
from raydeck.errors import ConfigError
from raydeck.tune.config import SweepConfig
from raydeck.tune.monitor import END_RUN_TIMEOUT_S, SlotUsage, SweepMonitor, end_child_run
from raydeck.tune.scheduling import LINEAGE_KEY
from raydeck.tune.space import as_text, flatten, is_scalar, plain
from raydeck.tune.status import (
    ERROR_LINE_MAX_CHARS,
    RUN_STATUS,
    STOPPED_AT_RUNG_TAG,
    TRIAL_STATUS_TAG,
    TRIAL_STATUSES,
    TrialOutcome,
)

BEST_CONFIG_TAG = "raydeck.best_config"
BEST_TRIAL_ARTIFACT = "sweep/best_trial.json"
MAX_TAG_CHARS = 8000
SWEEP_STATE_TAG = "raydeck.sweep_state"
# How often the summary reads a child run's status while its end is on its way to MLflow.
END_POLL_S = 0.2


@dataclass(frozen=True)
class TrialSummary:
    """One trial of a finished sweep."""

    trial_id: str
    run_id: str
    status: str
    stop_iteration: int
    best_score: float | None
    config: dict[str, Any]
    time_total_s: float = 0.0
    rung: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class SweepResult:
    """What a finished sweep tells its caller.

    ``slot_usage`` describes this driver's tuning loop (None when no trial ran in it, e.g. a
    resume that only summarized).
    """

    parent_run_id: str
    best_trial_id: str
    best_run_id: str
    best_config: dict[str, Any]
    best_score: float
    trials: tuple[TrialSummary, ...]
    registered_model_uri: str | None
    wall_time_s: float
    slot_usage: SlotUsage | None = None

    @property
    def trial_iterations(self) -> int:
        return sum(t.stop_iteration for t in self.trials)

    def count(self, status: str) -> int:
        return sum(t.status == status for t in self.trials)


def trial_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A trial's config as the job saw it (no PBT hand-over), as plain data."""
    return {str(k): plain(v) for k, v in config.items() if k not in (LINEAGE_KEY, "data")}


def summarize(grid: Any, config: SweepConfig, monitor: SweepMonitor, parent: Any,
              settings: Settings) -> SweepResult:
    """End every trial's child run with its final status and write the summary on the parent.

    Raises:
        ConfigError: no trial reported the sweep's metric (nothing to call best).
    """
    from mlflow.tracking import MlflowClient

    client = MlflowClient(settings.tracking.uri)
    children = child_runs(client, parent)
    better = max if config.mode == "max" else min
    trials = []
    outcomes: dict[str, TrialOutcome] = {}
    for result in grid:
        trial_id = str(result.metrics.get("trial_id", ""))
        iteration = int(result.metrics.get("training_iteration", 0) or 0)
        child = children.get(trial_id)
        outcome = outcomes[trial_id] = _final_outcome(result, trial_id, iteration, monitor,
                                                      child)
        history = result.metrics_dataframe
        scores = (history[config.metric].dropna().tolist()
                  if history is not None and config.metric in history else [])
        trials.append(TrialSummary(
            trial_id=trial_id, run_id=child.info.run_id if child else "",
            status=outcome.status, stop_iteration=outcome.iteration,
            best_score=better(scores) if scores else None,
            config=trial_config(result.config),
            time_total_s=float(result.metrics.get("time_total_s", 0.0) or 0.0),
            rung=outcome.rung, error=outcome.error,
        ))
    record_outcomes(config, monitor, outcomes, children, client)
    scored = [(t.best_score, t) for t in trials
              if t.best_score is not None and not math.isnan(t.best_score)]
    if not scored:
        raise ConfigError(
            f"no trial reported {config.metric!r}; check the job's reports "
            f"(statuses: {', '.join(sorted({t.status for t in trials}))}; errors: "
            f"{'; '.join(sorted({t.error for t in trials if t.error})) or 'none'})"
        )
    best_score, best = better(scored, key=lambda pair: pair[0])
    usage = monitor.slot_usage()
    record_on_parent(parent, config, trials, best, best_score, usage)
    return SweepResult(
        parent_run_id=parent.run_id, best_trial_id=best.trial_id, best_run_id=best.run_id,
        best_config=best.config, best_score=best_score, trials=tuple(trials),
        registered_model_uri=None, wall_time_s=0.0, slot_usage=usage,
    )


def child_runs(client: Any, parent: Any) -> dict[str, Any]:
    """The sweep's child runs in MLflow, by trial id."""
    return {str(run.data.tags.get("raydeck.trial_id")): run for run in client.search_runs(
        [parent.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.run_id}'",
        max_results=10_000)}


def record_outcomes(config: SweepConfig, monitor: SweepMonitor,
                     outcomes: dict[str, TrialOutcome], children: dict[str, Any], client: Any
                     ) -> list[str]:
    """Make certain every child run records its final outcome; returns the trials that have a
    run to record it on (a trial Tune had just started may not have made its run yet).

    Trials that ended in this driver were ended as they did (those calls are awaited here);
    others (ended under an earlier driver) are ended now. A run the tracking proxy does not
    know (it was restarted meanwhile), or whose end the proxy has not written to MLflow within
    ``END_RUN_TIMEOUT_S``, or which MLflow shows ended with another status (the proxy ends a
    run KILLED when it finds the run's process gone, and Tune ends a stopped trial's actor), is
    ended directly in MLflow: when the sweep returns, every child run it recorded shows its
    final status.
    """
    import ray

    quiet_mlflow_urls(client.tracking_uri)  # set_terminated below would print a credentialed URL
    pending = {trial_id: monitor.ending(trial_id, outcome) or end_child_run(
        config, monitor.namespace, trial_id, outcome, wait_s=None)
        for trial_id, outcome in outcomes.items()}
    deadline = time.monotonic() + END_RUN_TIMEOUT_S
    refs = [ref for ref in pending.values() if ref is not None]
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=END_RUN_TIMEOUT_S)
    recorded = []
    for trial_id, ref in pending.items():
        try:
            known = ref is not None and bool(ray.get(ref, timeout=0))
        except Exception:
            known = False
        child = children.get(trial_id)
        outcome = outcomes[trial_id]
        if known and child is not None:
            # The router has handed the end to the run's shard; it is in MLflow once the shard
            # has written it, normally within a flush interval. The proxy may have ended the
            # run first, KILLED, when it saw the trial's process gone (Tune stops a trial by
            # ending its actor): this driver's outcome is the trial's, so it is what stays.
            status = _ended_in_mlflow(client, child.info.run_id, deadline)
            known = status == outcome.run_status
        if not known and child is not None:
            for key, value in outcome.tags().items():
                client.set_tag(child.info.run_id, key, value)
            client.set_terminated(child.info.run_id, status=outcome.run_status)
        if known or child is not None:
            recorded.append(trial_id)
    return recorded


def _ended_in_mlflow(client: Any, run_id: str, deadline: float) -> str | None:
    """The status MLflow shows run ``run_id`` ended with, waiting for its end until
    ``deadline``; None if it is still running then."""
    while True:
        status = str(client.get_run(run_id).info.status)
        if status != "RUNNING":
            return status
        if time.monotonic() >= deadline:
            return None
        time.sleep(END_POLL_S)


def _final_outcome(result: Any, trial_id: str, iteration: int, monitor: SweepMonitor,
                   child: Any) -> TrialOutcome:
    """The trial's status: this driver's observation, else what the run already records
    (decided by an earlier driver of the sweep), else the policy's guess from the iteration."""
    if result.error is not None:
        seen = monitor.outcome(trial_id)
        return seen if seen and seen.error else monitor.policy.errored(iteration, result.error)
    seen = monitor.outcome(trial_id)
    if seen is not None:
        return seen
    tags = child.data.tags if child is not None else {}
    recorded = tags.get(TRIAL_STATUS_TAG)
    if recorded in TRIAL_STATUSES and recorded != "preempted" and child is not None \
            and child.info.status == RUN_STATUS[recorded]:
        rung = tags.get(STOPPED_AT_RUNG_TAG)
        error = tags.get("raydeck.trial_error")
        return TrialOutcome(recorded, iteration, int(rung) if rung else None,
                            error[:ERROR_LINE_MAX_CHARS] if error else None)
    stopped_at = monitor.stopped_at(trial_id)
    return monitor.policy.ended(iteration, stopped_at=stopped_at, observed=False)


def record_on_parent(parent: Any, config: SweepConfig, trials: list[TrialSummary],
                     best: TrialSummary, best_score: float, usage: SlotUsage | None) -> None:
    """The summary tags, metrics and artifact of the parent run (scalars as tags, all as JSON)."""
    flat = flatten(best.config)
    best_json = json.dumps(best.config, sort_keys=True)
    tags: dict[str, Any] = {
        "raydeck.best_trial_id": best.trial_id,
        "raydeck.best_run_id": best.run_id,
        **{f"best.{name}": as_text(value) for name, value in flat.items() if is_scalar(value)},
        **{f"raydeck.trials_{status}": sum(t.status == status for t in trials)
           for status in TRIAL_STATUSES},
        SWEEP_STATE_TAG: "finished",
    }
    if len(best_json) <= MAX_TAG_CHARS:
        tags[BEST_CONFIG_TAG] = best_json
    parent.set_tags(tags)
    metrics = {f"best_{config.metric}": best_score,
               "trial_iterations": float(sum(t.stop_iteration for t in trials))}
    if usage is not None:
        metrics.update(sweep_slot_idle_fraction=usage.idle_fraction,
                       sweep_trial_startup_s=usage.startup_s)
    parent.log_metrics(metrics, step=0)
    parent.log_dict({"trial_id": best.trial_id, "run_id": best.run_id, "config": best.config,
                     config.metric: best_score,
                     "statuses": {t.trial_id: t.status for t in trials}}, BEST_TRIAL_ARTIFACT)
