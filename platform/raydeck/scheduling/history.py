"""How long the same job ran before, read from MLflow.

Owns: :func:`mlflow_durations`, the queue's source for duration prediction. Every job submitted
with ``raydeck submit`` (queued or not) tags its MLflow run with its digest (``raydeck.job_digest``:
job file, preset and arguments), so the history covers every run of the job that MLflow has,
not only those the queue started. A run's duration is its MLflow start to end (the driver's
training time, without the job's environment setup). Runs that were preempted are left out:
their span includes the time they waited in the queue.
"""

from __future__ import annotations

import re

from raydeck.jobs import JOB_DIGEST_TAG
from raydeck.preemption import PREEMPTIONS_TAG

HISTORY_RUNS = 20
_KEY = re.compile(r"^[0-9a-f]{1,64}$")


def mlflow_durations(tracking_uri: str, key: str, limit: int = HISTORY_RUNS) -> list[float]:
    """Seconds each of the last ``limit`` finished, never preempted runs of job ``key`` took.

    Raises:
        Exception: whatever MLflow raises when it cannot be reached (the queue then falls back
            to its own history).
    """
    from mlflow.tracking import MlflowClient

    if not _KEY.match(key):
        return []  # not a job key (and never put into a filter string)
    client = MlflowClient(tracking_uri)
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
