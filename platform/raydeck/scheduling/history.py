"""How long the same job ran before, read from MLflow.

Owns: :func:`predict` (a job's predicted duration), :class:`MlflowHistory`, its source, and
:func:`mlflow_durations`, its query. Every job submitted
with ``raydeck submit`` (queued or not) tags its MLflow run with its digest (``raydeck.job_digest``:
job file, preset and arguments), so the history covers every run of the job that MLflow has,
not only those the queue started. A run's duration is its MLflow start to end (the driver's
training time, without the job's environment setup). Runs that were preempted are left out:
their span includes the time they waited in the queue.

MLflow's client retries a refused request for minutes by default; the history's client is the
tracking writer's (:class:`raydeck.tracking.writer.MlflowWriter`): no retries and a bounded
request timeout, so MLflow being down costs a submission one short wait (the queue then
predicts from its own record, and never holds its lock while asking).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from raydeck.jobs import JOB_DIGEST_TAG
from raydeck.preemption import PREEMPTIONS_TAG
from raydeck.redaction import redact_text

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

logger = logging.getLogger(__name__)

HISTORY_RUNS = 20
PREDICTION_QUANTILE = 0.75
_KEY = re.compile(r"^[0-9a-f]{1,64}$")


def predict(history: Callable[[str], list[float]] | None, own: Callable[[str], list[float]],
            key: str) -> float | None:
    """Predicted duration of a job from earlier runs of the same job (same job file, preset
    and arguments): the 75th percentile of their durations in ``history`` (MLflow's: runs
    started outside the queue count), else in ``own`` (the queue's record), else None."""
    durations: list[float] = []
    if history is not None:
        try:
            durations = history(key)
        except Exception as exc:  # MLflow down: predict from what the queue knows
            logger.warning("no duration history from MLflow (%s); using the queue's own",
                           redact_text(str(exc)).splitlines()[0][:200])
    durations = durations or own(key)
    return float(np.quantile(durations, PREDICTION_QUANTILE)) if durations else None


class MlflowHistory:
    """``history(key)`` for :class:`~raydeck.scheduling.queue.JobQueue`: the durations in the
    MLflow server at ``tracking_uri``, asked through the tracking writer's fail-fast client."""

    def __init__(self, tracking_uri: str) -> None:
        from raydeck.tracking.writer import MlflowWriter

        self._writer = MlflowWriter(tracking_uri)

    def __call__(self, key: str) -> list[float]:
        return mlflow_durations(self._writer.client, key)


def mlflow_durations(client: MlflowClient, key: str, limit: int = HISTORY_RUNS) -> list[float]:
    """Seconds each of the last ``limit`` finished, never preempted runs of job ``key`` took.

    Raises:
        Exception: whatever MLflow raises when it cannot be reached (the queue then falls back
            to its own history).
    """
    if not _KEY.match(key):
        return []  # not a job key (and never put into a filter string)
    experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return []
    runs = client.search_runs(
        experiments, filter_string=f"tags.`{JOB_DIGEST_TAG}` = '{key}' AND "
                                   "attributes.status = 'FINISHED'",
        order_by=["attributes.end_time DESC"], max_results=limit)
    return [(run.info.end_time - run.info.start_time) / 1000 for run in runs
            if run.info.end_time and run.info.start_time
            and not run.data.tags.get(PREEMPTIONS_TAG)]
