"""The queue's two outward interfaces: the job server it starts jobs on (:class:`Launcher`) and
what it reports as it works (:class:`Observer`).

Owns: those interfaces and :class:`TimedLauncher`, which bounds every call to a launcher, so a
job server that hangs (a dashboard that accepts connections and never answers) costs the queue
one bounded wait, never a stalled queue. Ray's launcher is :mod:`raydeck.scheduling.queue.ray_jobs`;
tests use fakes with the same behaviour.
"""

from __future__ import annotations

import abc
import contextvars
import threading
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from raydeck.scheduling.policies.core import Resources

if TYPE_CHECKING:  # the queue's clients import this module without SQLAlchemy (job_view.py)
    from raydeck.scheduling.queue.store import JobRow

# The longest one call to the job server may take before the queue gives up on it (Ray's job
# client requests are sent with this timeout too: raydeck.scheduling.queue.ray_jobs).
LAUNCHER_TIMEOUT_S = 30.0
# Threads that may wait on a job server at once; a call beyond them waits for one (bounded too).
_LAUNCHER_THREADS = 4
_T = TypeVar("_T")
# How a bounded call's answer is awaited: its result, or FutureTimeout once the bound passed.
Await = Callable[["Future[Any]", float], Any]


def _in_real_time(future: Future[Any], timeout_s: float) -> Any:
    """The answer of ``future`` within ``timeout_s`` seconds of real time."""
    return future.result(timeout=timeout_s)


@dataclass(frozen=True)
class JobState:
    """What the job server says of one submission: Ray's ``status`` (``PENDING``, ``RUNNING``,
    ``SUCCEEDED``, ``FAILED``, ``STOPPED``) and, once its driver exited, its ``exit_code``
    (Ray's ``driver_exit_code``; None while it runs, or when Ray did not see the exit: a
    driver killed with its node). ``queue_id``: the queue's id of the job when the queue
    started it ("" otherwise: a job submitted to Ray directly)."""

    status: str
    exit_code: int | None = None
    queue_id: str = ""


class Launcher(abc.ABC):
    """The job server the queue starts jobs on."""

    @abc.abstractmethod
    def submit(self, row: JobRow, package: bytes | None) -> None:
        """Start the job as ``row.submission_id``; a job with that id already there counts as
        started. Raises what the job server's client raises (the queue classifies it with
        :func:`~raydeck.scheduling.queue.failures.classify`)."""

    @abc.abstractmethod
    def statuses(self, submission_ids: Collection[str]) -> dict[str, JobState]:
        """The state of each of ``submission_ids`` that the job server has, read in one
        request (Ray's: one ``list_jobs``). An id missing from the answer is one the job
        server does not know (its head restarted, or it never got the submission): that is
        its answer, never a guess from an error. Raises when it cannot answer."""

    @abc.abstractmethod
    def log_tail(self, submission_id: str) -> str:
        """The last lines of a job's log (for a job recorded failed); "" when there is none
        or it cannot be read."""

    @abc.abstractmethod
    def stop(self, submission_id: str) -> None:
        """Stop a running job; raises as ``submit`` does (an HTTP 404: the job server never
        got it)."""

    def submitting(self) -> frozenset[str]:
        """Submission ids whose submission timed out and is still under way (it may land):
        none for a launcher whose calls return before the queue goes on (only a bounded one's
        outlive their bound: :class:`TimedLauncher`)."""
        return frozenset()

    @abc.abstractmethod
    def resources(self) -> tuple[tuple[Resources, ...], tuple[Resources, ...]]:
        """``(free now, total)`` of each node of the cluster (aligned)."""

    @abc.abstractmethod
    def placed(self, submission_id: str) -> bool:
        """Whether the cluster has placed the job's placement groups (its workers' resources;
        one given back since counts); False when it has none yet, one still waits, or that
        cannot be read."""


class Observer:
    """What the queue reports as it works (the actor exports it as metrics); no-ops here."""

    def started(self, row: JobRow, now: float) -> None:
        """``row`` was submitted to the job server at ``now`` (its wait: now - submitted)."""
        return None

    def ended(self, row: JobRow, now: float) -> None:
        """``row`` ended at ``now`` (its duration: now - started; predicted: estimate_s)."""
        return None

    def counts(self, by_team_and_state: dict[tuple[str, str], int]) -> None:
        """After each tick: how many jobs each team has queued and running."""
        return None

    def preempted(self, row: JobRow, now: float) -> None:
        """``row`` was asked at ``now`` to stop at its next checkpoint."""
        return None


class LauncherTimeout(TimeoutError):
    """A call to the job server did not answer within its bound; classified as transient
    (:func:`raydeck.scheduling.queue.failures.classify`): the queue tries again later."""


class TimedLauncher(Launcher):
    """``launcher`` with each call bounded by ``timeout_s``.

    A call that does not answer in time raises :class:`LauncherTimeout`; its thread is left to
    finish on its own (at most ``_LAUNCHER_THREADS`` of them: later calls wait their turn within
    their own bound). A submission that timed out may still reach the job server: until its
    call returns it is :meth:`submitting` (the queue keeps its room and does not submit it
    again), and after, the queue's next read of the job server takes it as started if it
    landed.

    ``await_answer(future, timeout_s)`` returns the call's answer or raises
    :class:`concurrent.futures.TimeoutError` when the call is past its bound: by default in real
    time. A test's job server that knows when one of its calls hangs passes its own, so that a
    hang, and only a hang, times out, at once: a run of the model-based test then replays
    exactly (tests/fixtures/chaos_job_server.py).
    """

    def __init__(self, launcher: Launcher, timeout_s: float = LAUNCHER_TIMEOUT_S,
                 await_answer: Await = _in_real_time) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: a call's bound must be positive seconds")
        self._launcher = launcher
        self._timeout_s = timeout_s
        self._await = await_answer
        self._pool = ThreadPoolExecutor(_LAUNCHER_THREADS, thread_name_prefix="raydeck-launcher")
        self._submissions: dict[str, Future[None]] = {}
        self._submissions_lock = threading.Lock()

    def _bounded(self, what: str, call: Callable[[], _T], track: str = "") -> _T:
        # In the caller's context: a caller's checked job server serves its call only
        # (raydeck.scheduling.queue.job_server.QueueServer.hinted).
        future = self._pool.submit(contextvars.copy_context().run, call)
        try:
            answer: _T = self._await(future, self._timeout_s)
        except FutureTimeout:
            if not future.cancel() and track:
                with self._submissions_lock:  # it runs on: it may still land
                    self._submissions[track] = future  # type: ignore[assignment]
            raise LauncherTimeout(f"the job server did not answer {what} within "
                                  f"{self._timeout_s:g} s") from None
        return answer

    def submit(self, row: JobRow, package: bytes | None) -> None:
        self._bounded(f"submitting {row.submission_id}",
                      lambda: self._launcher.submit(row, package), track=row.submission_id)

    def submitting(self) -> frozenset[str]:
        with self._submissions_lock:
            for sid in [sid for sid, future in self._submissions.items() if future.done()]:
                del self._submissions[sid]
            return frozenset(self._submissions)

    def statuses(self, submission_ids: Collection[str]) -> dict[str, JobState]:
        return self._bounded(f"the status of {len(submission_ids)} job(s)",
                             lambda: self._launcher.statuses(submission_ids))

    def log_tail(self, submission_id: str) -> str:
        try:
            return self._bounded(f"the log of {submission_id}",
                                 lambda: self._launcher.log_tail(submission_id))
        except LauncherTimeout:
            return ""  # the contract: "" when it cannot be read

    def stop(self, submission_id: str) -> None:
        self._bounded(f"stopping {submission_id}", lambda: self._launcher.stop(submission_id))

    def resources(self) -> tuple[tuple[Resources, ...], tuple[Resources, ...]]:
        return self._bounded("the cluster's resources", self._launcher.resources)

    def placed(self, submission_id: str) -> bool:
        try:
            return self._bounded(f"whether {submission_id} is placed",
                                 lambda: self._launcher.placed(submission_id))
        except LauncherTimeout:
            return False  # the contract: False when it cannot be read (a gang waits CLAIM_S)
