"""What a client changes on a job in the queue: cancelling it (stopping it when started) and its
priority, each as a member of its team or an admin (:mod:`raydeck.scheduling.queue.access`).

Owns: :class:`JobChanges` and :func:`job` (a queued job by id, or one line naming the command
that lists them). The queue (:mod:`raydeck.scheduling.queue.job_queue`) holds one and answers its
clients through it, under its own lock; the job server is called without it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from raydeck.errors import ConfigError
from raydeck.scheduling.queue import access
from raydeck.scheduling.queue.failures import classify
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.job_view import JobView
from raydeck.scheduling.queue.jobspec import TeamsFile
from raydeck.scheduling.queue.launcher import Launcher
from raydeck.scheduling.queue.reconcile import refused
from raydeck.scheduling.queue.store import ACTIVE, ENDED, JobRow, Store


def reached(row: JobRow) -> bool:
    """Whether the job server may have ``row``'s current attempt: it was started, or its
    submission failed without an answer (it may have got through)."""
    return row.state in ACTIVE or (row.state == "queued" and row.submit_failures > 0)


def job(store: Store, job_id: str) -> JobRow:
    """The queue's job ``job_id``.

    Raises:
        ConfigError: no such job.
    """
    row = store.get(job_id)
    if row is None:
        raise ConfigError(f"no job {job_id!r} in the queue (`raydeck queue` lists them)")
    return row


@dataclass(frozen=True)
class JobChanges:
    """Changes to the jobs of ``store``; ``lock`` is the queue's, ``clock`` its clock."""

    store: Store
    launcher: Launcher
    lock: threading.RLock
    clock: Callable[[], float]

    def cancel(self, job_id: str, who: Identity, teams: TeamsFile) -> JobView:
        """As ``who``: take a queued job out (one waiting to retry its submission too), stop a
        started one, or clear one the job server refused from ``raydeck queue``.

        Every attempt the job server may have is stopped before the job is recorded
        cancelled: the current one of a started job, and that of a queued job whose
        submission's answer was lost (it may have reached the job server). An attempt that
        became current meanwhile (a relaunch or requeue racing this cancel) is stopped too;
        one that still lands later is stopped by the next tick
        (:meth:`~raydeck.scheduling.queue.job_queue.JobQueue.tick`'s orphans).

        Raises:
            ConfigError: no such job, ``who`` may not cancel it (:mod:`.access`), it has
                already run and ended, or the job server cannot stop it now (it is
                unreachable: the job keeps running; try again).
        """
        stopped: set[int] = set()
        while True:
            with self.lock:
                row = job(self.store, job_id)
                if not stopped:
                    access.check_change(who, row, "cancel", teams)
                    if row.state not in ("queued", *ACTIVE) and not refused(row):
                        raise ConfigError(f"job {job_id} has already ended ({row.state})")
                if row.state in ENDED and stopped:  # it ended meanwhile
                    return JobView.of(row)
                if not reached(row) or row.attempt in stopped:
                    return self._cancelled(row)
            self._stop(row)  # outside the lock: the job server may be slow
            stopped.add(row.attempt)

    def _stop(self, row: JobRow) -> None:
        try:
            self.launcher.stop(row.submission_id)
        except Exception as exc:
            failure = classify(exc)
            # 404: the job server does not have it (never got it): there is nothing to stop.
            if failure.http_status != 404:
                raise ConfigError(f"cannot stop job {row.id} now: {failure.reason}; it "
                                  "keeps running, try again") from None

    def reprioritize(self, job_id: str, priority: int, who: Identity, teams: TeamsFile
                     ) -> JobView:
        """As ``who``: give a job not yet ended a new priority (the policy orders queued jobs by
        it from the next tick; a started job's decides which jobs may preempt it).

        Raises:
            ConfigError: no such job, it has ended, ``who`` may not change it, or the priority
                is negative or over its team's bound (:mod:`.access`).
        """
        if priority < 0:
            raise ConfigError(f"--priority={priority}: must be >= 0 (higher runs first)")
        with self.lock:
            row = job(self.store, job_id)
            access.check_change(who, row, "reprioritize", teams)
            access.check_priority(who, priority, row.team, teams)
            if row.state in ENDED:
                raise ConfigError(f"job {job_id} has already ended ({row.state})")
            self.store.update(job_id, priority=priority)
            return JobView.of(job(self.store, job_id))

    def _cancelled(self, row: JobRow) -> JobView:
        self.store.update(row.id, state="cancelled", ended_at=self.clock(), retry_at=None,
                          reason="cancelled by raydeck cancel"
                                 + (f" (it had failed: {row.reason})" if refused(row) else ""))
        return JobView.of(job(self.store, row.id))
