"""How long the same job ran before, read from MLflow.

Owns: :func:`predict` (a job's predicted duration), :class:`MlflowHistory`, its source,
:func:`mlflow_durations` and :func:`mlflow_cluster_durations`, its queries, and
:class:`CachedHistory`, what the queue keeps of them for the ``gittins`` policy (which ranks a
job by the distribution of its earlier durations: the job's own, else the cluster's, and must
never ask MLflow while the queue holds its lock). Every job submitted
with ``raydeck submit`` (queued or not) tags its MLflow run with its digest (``raydeck.job_digest``:
job file, preset and arguments), so the history covers every run of the job that MLflow has,
not only those the queue started. A run's duration is its MLflow start to end (the driver's
training time, without the job's environment setup). Runs that were preempted are left out:
their span includes the time they waited in the queue.

MLflow's client retries a refused request for minutes by default; the history's client is the
tracking writer's (:class:`raydeck.tracking.proxy.writer.MlflowWriter`): no retries and a bounded
request timeout, so MLflow being down costs a submission one short wait (the queue then
predicts from its own record, and never holds its lock while asking).
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np

from raydeck._internal.contract import JOB_DIGEST_TAG, PREEMPTIONS_TAG
from raydeck._internal.redaction import redact_text

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

logger = logging.getLogger(__name__)

HISTORY_RUNS = 20
# The finished runs (newest) whose durations are the cluster's distribution, and how long the
# queue keeps it before asking MLflow again.
CLUSTER_RUNS = 1000
CLUSTER_TTL_S = 600.0
# Job keys whose durations the queue keeps (the oldest read is forgotten first).
CACHED_KEYS = 1000
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
    """``history(key)`` for :class:`~raydeck.scheduling.queue.job_queue.JobQueue`: the durations in
    the MLflow server at ``tracking_uri``, asked through the tracking writer's fail-fast client."""

    def __init__(self, tracking_uri: str) -> None:
        from raydeck.tracking.proxy.writer import MlflowWriter

        self._writer = MlflowWriter(tracking_uri)

    def __call__(self, key: str) -> list[float]:
        return mlflow_durations(self._writer.client, key)

    def cluster(self) -> list[float]:
        return mlflow_cluster_durations(self._writer.client)


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
    return _finished(client, experiments, f"tags.`{JOB_DIGEST_TAG}` = '{key}'", limit)


def mlflow_cluster_durations(client: MlflowClient, limit: int = CLUSTER_RUNS) -> list[float]:
    """Seconds each of the last ``limit`` finished, never preempted runs of any job submitted
    with ``raydeck submit`` took (runs logged outside a job, notebooks, are not jobs).

    Raises:
        Exception: whatever MLflow raises when it cannot be reached.
    """
    experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return []
    return _finished(client, experiments, f"tags.`{JOB_DIGEST_TAG}` LIKE '%'", limit)


def _finished(client: MlflowClient, experiments: list[str], tags: str, limit: int
              ) -> list[float]:
    """Durations of the newest ``limit`` FINISHED runs matching ``tags`` (a filter), in
    seconds, less those that were preempted (their span includes a wait in the queue)."""
    runs = client.search_runs(
        experiments, filter_string=f"{tags} AND attributes.status = 'FINISHED'",
        order_by=["attributes.end_time DESC"], max_results=limit)
    return [(run.info.end_time - run.info.start_time) / 1000 for run in runs
            if run.info.end_time and run.info.start_time
            and not run.data.tags.get(PREEMPTIONS_TAG)]


class CachedHistory:
    """The durations the queue last read from ``history`` (per job key) and ``cluster`` (any
    job's), for a policy to read under the queue's lock without asking MLflow
    (:meth:`runs`, :meth:`cluster`: ascending, possibly empty).

    Contract: only :meth:`__call__` (a submission's prediction) and :meth:`refresh` (the
    queue's tick, for the jobs it has) ask; a key is asked at each submission and by
    :meth:`refresh` only when never read; the cluster when its copy is older than
    ``ttl_s``. A failure keeps what was read before, and :meth:`refresh` then asks nothing
    for ``ttl_s`` (a tick never waits on an MLflow that is down more than once per
    ``ttl_s``). A policy copy shares this cache (``copy.deepcopy`` returns it): it is
    read-only to policies.
    """

    def __init__(self, history: Callable[[str], list[float]] | None,
                 cluster: Callable[[], list[float]] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 ttl_s: float = CLUSTER_TTL_S) -> None:
        self._history = history
        self._read_cluster = cluster
        self._clock = clock
        self._ttl_s = ttl_s
        self._runs: dict[str, list[float]] = {}
        self._cluster: list[float] = []
        self._cluster_read: float | None = None
        self._paused_until = -math.inf  # after a failed refresh
        self._guard = threading.Lock()  # the dict and the list, never across a read

    def __deepcopy__(self, memo: dict[int, object]) -> CachedHistory:
        return self

    def __call__(self, key: str) -> list[float]:
        """``history(key)``, kept for :meth:`runs` (an empty answer too).

        Raises:
            Exception: what ``history`` raises (nothing is kept).
        """
        durations = self._history(key) if self._history is not None else []
        with self._guard:
            self._runs.pop(key, None)
            self._runs[key] = sorted(d for d in durations if d >= 0)
            while len(self._runs) > CACHED_KEYS:
                del self._runs[next(iter(self._runs))]
        return durations

    def refresh(self, keys: Iterable[str]) -> None:
        """Read the keys never read, and the cluster's durations when stale; logs a failure
        (what was read before stays)."""
        now = self._clock()
        with self._guard:
            if now < self._paused_until:
                return
            unread = {k for k in keys if k and k not in self._runs}
            stale = self._read_cluster is not None and (
                self._cluster_read is None or now - self._cluster_read >= self._ttl_s)
            if stale:
                self._cluster_read = now
        try:
            for key in unread:
                self(key)
            if stale and self._read_cluster is not None:
                durations = sorted(d for d in self._read_cluster() if d >= 0)
                with self._guard:
                    self._cluster = durations
        except Exception as exc:  # MLflow down: rank by what was read before
            with self._guard:
                self._paused_until = now + self._ttl_s
            logger.warning("cannot read job durations from MLflow (%s); the gittins policy "
                           "ranks by what it read before",
                           redact_text(str(exc)).splitlines()[0][:200])

    def runs(self, key: str) -> list[float]:
        """What the last read of ``key`` found (ascending); no MLflow call."""
        with self._guard:
            return self._runs.get(key, [])

    def cluster(self) -> list[float]:
        """What the last read of the cluster found (ascending); no MLflow call."""
        with self._guard:
            return self._cluster
