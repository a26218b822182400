"""What a finished sweep tells its caller and its parent run: every trial's outcome, the best.

Owns: :class:`SweepResult` and :class:`TrialSummary`, ending every trial's child run with its
final status (waiting, so the record is certain), each trial's score on its child run, and the
summary on the parent run: the best trial's id, run, score (``best_<metric>``), its config
(scalars as ``best.<name>`` tags, the whole config as JSON in the ``raydeck.best_config`` tag and
``sweep/best_trial.json``), a description that links the best child run, the count of trials per
status, and how well the sweep used its slots. Does not own: registering the best model
(:mod:`raydeck.tune.registry`).

A trial's score is the best value of the sweep's metric it reported (:mod:`raydeck.tune.score`);
each child run shows it as ``best_<metric>``, the key the summary ranks by and prints: sorting the
child runs by it in MLflow ranks them as the summary does (equal scores tie).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raydeck._internal.redaction import quiet_mlflow_urls
from raydeck.config.settings import Settings
from raydeck.config.tracking_uri import run_page
from raydeck.errors import ConfigError
from raydeck.tune.config import SweepConfig
from raydeck.tune.monitor import END_RUN_TIMEOUT_S, SlotUsage, SweepMonitor, end_child_run
from raydeck.tune.scheduling import LINEAGE_KEY
from raydeck.tune.score import best_of
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
# MLflow's UI shows this tag as the run's description (Markdown), above its details.
DESCRIPTION_TAG = "mlflow.note.content"
# How often the summary reads a child run's status while its end is on its way to MLflow.
END_POLL_S = 0.2


@dataclass(frozen=True)
class TrialSummary:
    """One trial of a finished sweep.

    ``best_score`` is the trial's score: the best value of the sweep's metric it reported, as
    its child run shows it (``best_<metric>``); None if it reported none.
    """

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

    ``best_score`` is the best trial's score, ``best_metric`` its name (``best_<metric>``, as
    the child runs and the parent run show it); ``experiment_id`` is the MLflow experiment of
    the parent run and its children. ``slot_usage`` describes this driver's tuning loop (None
    when no trial ran in it, e.g. a resume that only summarized).
    """

    parent_run_id: str
    best_trial_id: str
    best_run_id: str
    best_config: dict[str, Any]
    best_metric: str
    best_score: float
    trials: tuple[TrialSummary, ...]
    registered_model_uri: str | None
    wall_time_s: float
    slot_usage: SlotUsage | None = None
    experiment_id: str = ""

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
    """End every trial's child run with its final status, log each trial's score on its run
    (``best_<metric>``), rank the trials by it and write the summary on the parent.

    Raises:
        ConfigError: no trial reported the sweep's metric (nothing to call best).
    """
    from mlflow.tracking import MlflowClient

    client = MlflowClient(settings.tracking.uri)
    children = child_runs(client, parent)
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
            best_score=best_of(scores, config.mode),
            config=trial_config(result.config),
            time_total_s=float(result.metrics.get("time_total_s", 0.0) or 0.0),
            rung=outcome.rung, error=outcome.error,
        ))
    record_outcomes(config, monitor, outcomes, children, client)
    record_scores(config, trials, children, client)
    best_score = best_of((t.best_score for t in trials), config.mode)
    if best_score is None:
        raise ConfigError(
            f"no trial reported {config.metric!r}; check the job's reports "
            f"(statuses: {', '.join(sorted({t.status for t in trials}))}; errors: "
            f"{'; '.join(sorted({t.error for t in trials if t.error})) or 'none'})"
        )
    best = next(t for t in trials if t.best_score == best_score)
    usage = monitor.slot_usage()
    experiment_id = str(parent.experiment_id)
    record_on_parent(parent, config, trials, best, best_score, usage, experiment_id)
    return SweepResult(
        parent_run_id=parent.run_id, best_trial_id=best.trial_id, best_run_id=best.run_id,
        best_config=best.config, best_metric=config.best_metric, best_score=best_score,
        trials=tuple(trials), registered_model_uri=None, wall_time_s=0.0, slot_usage=usage,
        experiment_id=experiment_id,
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


def record_scores(config: SweepConfig, trials: list[TrialSummary], children: dict[str, Any],
                  client: Any) -> None:
    """Make each child run show its trial's score as ``best_<metric>``: the value the summary
    ranks by.

    The trial logged its best as it improved, and its data has landed (the driver waited for
    it), so this normally finds the score there and writes nothing. Where the trial could not
    know its whole history (a PBT exploit, a resumed distributed trial) or never logged it, the
    score is written directly in MLflow at the run's last step of the key (or the trial's last
    iteration) with a later time, which makes it the run's latest value of the key.
    """
    key = config.best_metric
    for trial in trials:
        child = children.get(trial.trial_id)
        if child is None or trial.best_score is None:
            continue
        shown = child.data.metrics.get(key)
        if shown == trial.best_score:
            continue
        steps = ([m.step for m in client.get_metric_history(child.info.run_id, key)]
                 if shown is not None else [])
        client.log_metric(child.info.run_id, key, trial.best_score,
                          timestamp=int(time.time() * 1000),
                          step=max([trial.stop_iteration, *steps]))


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
                     best: TrialSummary, best_score: float, usage: SlotUsage | None,
                     experiment_id: str) -> None:
    """The summary tags, metrics, description and artifact of the parent run (scalars as tags,
    all as JSON; the description links the best child run)."""
    flat = flatten(best.config)
    best_json = json.dumps(best.config, sort_keys=True)
    tags: dict[str, Any] = {
        "raydeck.best_trial_id": best.trial_id,
        "raydeck.best_run_id": best.run_id,
        **{f"best.{name}": as_text(value) for name, value in flat.items() if is_scalar(value)},
        **{f"raydeck.trials_{status}": sum(t.status == status for t in trials)
           for status in TRIAL_STATUSES},
        SWEEP_STATE_TAG: "finished",
        DESCRIPTION_TAG: describe_best(config, best, best_score, experiment_id),
    }
    if len(best_json) <= MAX_TAG_CHARS:
        tags[BEST_CONFIG_TAG] = best_json
    parent.set_tags(tags)
    metrics = {config.best_metric: best_score,
               "trial_iterations": float(sum(t.stop_iteration for t in trials))}
    if usage is not None:
        metrics.update(sweep_slot_idle_fraction=usage.idle_fraction,
                       sweep_trial_startup_s=usage.startup_s)
    parent.log_metrics(metrics, step=0)
    parent.log_dict({"trial_id": best.trial_id, "run_id": best.run_id, "config": best.config,
                     config.metric: best_score,
                     "statuses": {t.trial_id: t.status for t in trials}}, BEST_TRIAL_ARTIFACT)


def describe_best(config: SweepConfig, best: TrialSummary, best_score: float,
                  experiment_id: str) -> str:
    """The parent run's description (Markdown): the best trial, its score and a link to its
    child run. The link is relative to MLflow's UI, so it opens wherever the reader's UI is."""
    run = f"{config.name}-{best.trial_id}"
    if best.run_id:
        run = f"[{run}]({run_page(experiment_id, best.run_id)})"
    first = "highest" if config.mode == "max" else "lowest"
    return (f"Best trial **{best.trial_id}**: `{config.best_metric}` = {best_score:.6g} "
            f"(its {first} `{config.metric}`), run {run}. Sort the child runs by "
            f"`metrics.{config.best_metric}`, {first} first, to rank them as this summary does.")
