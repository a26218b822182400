"""Whether a started job that the job server forgot had already finished: the job's own word.

A restarted head keeps no job table (Ray keeps its jobs in the head's GCS), so a job that ended
while the head was down is never seen ending. Before the queue puts such a job back in the
queue (:mod:`raydeck.scheduling.queue.reconcile`), it asks the job's witnesses, in this order:

1. its driver told the queue that training ran to its end (``completed_at``: the queue's own
   database, written before the driver exits;
   :func:`raydeck.tracking.client.preemption.stopped_for_queue`);
2. its MLflow run (tag ``raydeck.run_key`` = the job's ``RAYDECK_RUN_ID``) ended ``FINISHED``
   after the current attempt started. A preempted or killed run ends ``KILLED``, a failed one
   ``FAILED``, a run whose driver died with the head stays ``RUNNING``: only a run that trained
   to its end is ``FINISHED``.

Either makes the job ``succeeded`` instead of running again: exactly once, for a job whose run
reaches MLflow. A job with neither witness (it logs no MLflow run, or MLflow is not configured)
is requeued: at least once. MLflow unreachable is neither yes nor no: :func:`witness` raises and
the queue asks again at its next tick (the job keeps its place meanwhile).

Owns: :func:`witness` (the decision) and :class:`MlflowRuns` (the MLflow question, through the
tracking writer's fail-fast client: no retries, a bounded request timeout). Called without the
queue's lock.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from raydeck.jobs.submission import METADATA_RUN_ID
from raydeck.scheduling.queue.store import JobRow
from raydeck.tracking.proxy.writer import MlflowWriter

# ``run_finished(run_key, since)``: whether the run ended FINISHED at or after ``since``.
RunFinished = Callable[[str, float], bool]


class MlflowRuns:
    """``run_finished`` for :func:`witness`: the MLflow server at ``tracking_uri``."""

    def __init__(self, tracking_uri: str) -> None:
        self._writer = MlflowWriter(tracking_uri)

    def __call__(self, run_key: str, since: float) -> bool:
        """Whether the run tagged ``raydeck.run_key = run_key`` ended FINISHED at or after
        ``since`` (seconds since the epoch): an earlier FINISHED run with the same key (a job
        queued again under its old run id) is not this attempt's.

        Raises:
            TransientWriteError: MLflow cannot be reached now.
            PermanentWriteError: MLflow refused the question.
        """
        run = self._writer.find_run(run_key)
        return (run is not None and run.info.status == "FINISHED"
                and run.info.end_time is not None and run.info.end_time >= since * 1000)


def run_key(row: JobRow) -> str:
    """The raydeck run id the job logs under (``RAYDECK_RUN_ID``), "" when it has none."""
    return str(json.loads(row.metadata_json or "{}").get(METADATA_RUN_ID, ""))


def witness(row: JobRow, run_finished: RunFinished | None) -> str:
    """Why the forgotten started job ``row`` counts as finished, or "" when nothing says so
    (it runs again). ``run_finished``: MLflow's answer (None: no MLflow configured).

    Raises:
        Exception: what ``run_finished`` raises when MLflow cannot answer now (the queue asks
            again at its next tick rather than guess).
    """
    if row.completed_at is not None:
        return "its driver reported that training ran to its end"
    key = run_key(row)
    if key and run_finished is not None and row.started_at is not None \
            and run_finished(key, row.started_at):
        return f"its MLflow run {key} ended FINISHED"
    return ""
