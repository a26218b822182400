"""Submitting a queued job to the job server and recording what came of it.

Owns: :class:`Submitter`, the check that a new job's id is not the job server's already, and
the queue's one way to submit (from its tick, and again for a job
recorded ``starting`` that was never submitted). The submission runs without the queue's lock;
its outcome is recorded under it, only if the job is still the one submitted (not cancelled or
restarted meanwhile). A failure is classified (:func:`~raydeck.scheduling.queue.failures.classify`)
and recorded on that job alone: a permanent one fails it with the reason, a transient one puts
it back in the queue (its place and submission id kept: a submission that did get through is
refused as a duplicate next time and counts as started) to be tried again after a backoff.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass

from raydeck.errors import ConfigError
from raydeck.scheduling.queue.failures import Backoff, Failure, classify
from raydeck.scheduling.queue.launcher import Launcher
from raydeck.scheduling.queue.store import JobRow, Store, submission_id

logger = logging.getLogger(__name__)

# How many attempts of one id a new submission looks past (earlier lives of a reused id).
_ATTEMPTS_LOOKED_UP = 64


class Outcome(enum.Enum):
    """What came of a submission. ``STARTED``: the job server accepted it. ``NOT_STARTED``: it
    did not (refused, unreachable, busy, or cancelled meanwhile): its room is free.
    ``UNKNOWN``: its answer never came (a timeout), so it may have reached the job server: its
    room stays taken in this tick, and the next tick's read of the job server takes it as
    started if it did (:mod:`raydeck.scheduling.queue.attempts`)."""

    STARTED = "started"
    NOT_STARTED = "not started"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Submitter:
    """Submits jobs of ``store`` to ``launcher``; ``lock`` is the queue's."""

    store: Store
    launcher: Launcher
    backoff: Backoff
    lock: threading.RLock

    def free_attempt(self, job_id: str, attempt: int) -> int:
        """The first attempt of ``job_id`` from ``attempt`` on whose submission id the job
        server does not have: an earlier life of the same id that the queue started, and has
        since forgotten (deleted after ``RETENTION_S``), is skipped, never taken as this one.
        A job server that cannot be asked now refuses nothing (its check would only delay the
        queue).

        Raises:
            ConfigError: the job server has a job under one of those ids that the queue did
                not start (the queue would otherwise take that job's status as its own).
        """
        sids = [submission_id(job_id, a) for a in range(attempt, attempt + _ATTEMPTS_LOOKED_UP)]
        try:
            known = self.launcher.statuses(sids)
        except Exception as exc:
            logger.warning("cannot ask the job server whether it has %s (%s); queued anyway",
                           sids[0], classify(exc).reason)
            return attempt
        for offset, sid in enumerate(sids):
            state = known.get(sid)
            if state is None:
                return attempt + offset
            if state.queue_id != job_id:
                raise ConfigError(f"job {job_id}: the job server already has a job {sid} "
                                  f"({state.status}) that the queue did not start; queue it "
                                  "under another id (a new run: leave out --run-id)")
        raise ConfigError(f"job {job_id}: the job server has {_ATTEMPTS_LOOKED_UP} earlier "
                          "jobs under this id; queue it under another id")

    def start(self, row: JobRow, now: float) -> Outcome:
        """Submit ``row`` (recorded ``starting``) and record what came of it (see
        :class:`Outcome`). A job cancelled while it was being submitted is stopped again and
        counts as not started (its room is free again)."""
        try:
            self.launcher.submit(row, self.store.package(row.package_uri)
                                 if row.package_uri else None)
        except Exception as exc:
            failure = classify(exc)
            with self.lock:
                if self._still_starting(row):
                    self._failed(row, failure, now)
            return Outcome.UNKNOWN if failure.unanswered else Outcome.NOT_STARTED
        with self.lock:
            kept = self._still_starting(row)
            if kept:
                self.store.update(row.id, accepted_at=now, submit_failures=0, retry_at=None,
                                  **({"reason": ""} if row.submit_failures else {}))
        if not kept:
            logger.warning("job %s was cancelled while it was submitted; stopping it", row.id)
            try:
                self.launcher.stop(row.submission_id)
            except Exception as exc:
                logger.error("cannot stop cancelled job %s: %s; `ray job stop %s`", row.id,
                             classify(exc).reason, row.submission_id)
        return Outcome.STARTED if kept else Outcome.NOT_STARTED

    def _still_starting(self, row: JobRow) -> bool:
        current = self.store.get(row.id)
        return (current is not None and current.state == "starting"
                and current.attempt == row.attempt)

    def _failed(self, row: JobRow, failure: Failure, now: float) -> None:
        if failure.permanent:
            self.store.update(row.id, state="failed", started_at=None, ended_at=now,
                              retry_at=None, reason=f"not started: {failure.reason}")
            logger.error("job %s was refused: %s", row.id, failure.reason)
            return
        failures = row.submit_failures + 1
        retry_at = now + self.backoff.delay_s(failures)
        # An elastic job waits at its minimum, except one whose submission may have landed:
        # that attempt runs at the size it was submitted at, and keeps it, both when the queue
        # adopts it and when it submits the same attempt again (the job server then answers a
        # duplicate: started). Counted at its minimum, what it holds would be undercounted, and
        # a job waiting on that room would wait for good: no victim frees what it does not hold.
        self.store.update(
            row.id, state="queued", started_at=None, submit_failures=failures,
            retry_at=retry_at, **({} if failure.unanswered else row.sized()),
            reason=f"submission failed {failures}x ({failure.reason}); retried at "
                   f"{time.strftime('%H:%M:%S', time.localtime(retry_at))}")
        logger.warning("job %s: submission failed (%s); retrying in %.0f s", row.id,
                       failure.reason, retry_at - now)
