"""What the job server's answer about a started job means for the queue, and the queue's rows
as the policies see them.

Owns: :func:`verdict` (a pure decision: the queue applies it under its lock and makes any call
to the job server outside it, :mod:`raydeck.scheduling.queue.job_queue`), the resources a queued job
may use (:func:`free_capacity`), the jobs a strict gang waits for Ray to place (:func:`claiming`)
and the conversions from a stored :class:`~raydeck.scheduling.queue.store.JobRow` to a policy's
:class:`~raydeck.scheduling.policies.core.QueuedJob` / ``RunningJob``.

Ray, not the queue, chooses each worker's node. A strict gang (``STRICT_PACK``,
``STRICT_SPREAD``) therefore starts alone: not while a job the queue started in the last
``CLAIM_S`` seconds (:func:`~raydeck.scheduling.queue.reconcile.claiming`) has no placement group
placed by Ray yet, and nothing starts after it until Ray has placed its own (or ``CLAIM_S`` has
passed: a job that never asks Ray for a placement group). Otherwise Ray may put a job started
beside it on the node the gang was counted on (seen on two nodes: two 1-CPU jobs started in the
gang's tick took its node, and it waited in Ray).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from raydeck._internal.contract import PREEMPTED_EXIT_CODE
from raydeck.scheduling.policies import attained_service
from raydeck.scheduling.policies.core import Capacity, QueuedJob, RunningJob
from raydeck.scheduling.policies.resources import Gang, Resources
from raydeck.scheduling.queue.launcher import JobState
from raydeck.scheduling.queue.listing import strict
from raydeck.scheduling.queue.store import JobRow

PREEMPT_GRACE_S = 300.0
# How long a strict gang waits at most for a job started before it (or the jobs after it wait
# for it) to be placed by Ray: a job may never ask Ray for a placement group.
CLAIM_S = 120.0
TERMINAL = {"SUCCEEDED": "succeeded", "FAILED": "failed", "STOPPED": "stopped"}


@dataclass(frozen=True)
class Verdict:
    """What to do with a started job. ``action``: ``resubmit`` (recorded ``starting``, never
    submitted: the queue stopped in between), ``requeue`` (back in the queue, resuming from its
    checkpoint; ``preempted`` when it stopped for another job), ``stop`` (asked to stop over
    ``PREEMPT_GRACE_S`` ago and still running: the job server stops it), ``end`` (it ended as
    ``state``; ``why`` when the job server did not say so), ``running`` (the job server has
    it), ``relaunch`` (an elastic job stopped at its checkpoint to restart at the size it was
    asked to: at once, no queueing), ``keep`` (an elastic job asked to grow that has not
    reached a checkpoint in ``PREEMPT_GRACE_S``: it goes on at its size, nothing waits on its
    growth) or ``""`` (nothing changes)."""

    action: str
    why: str = ""
    preempted: bool = False
    state: str = ""


def verdict(row: JobRow, state: JobState | None, now: float, finished: str = "") -> Verdict:
    """The verdict on active ``row`` whose job the job server reports as ``state`` (None: it
    does not know the job); ``finished``: for a job it does not know, why the job's own
    witness says it ran to its end (:func:`raydeck.scheduling.queue.witness.witness`), else "".
    """
    if state is None:
        if finished:
            # It ended while the head was down, or its driver's exit was never seen: it is
            # done, and running it again would run it twice.
            return Verdict("end", f"succeeded while the job server was away: {finished}",
                           state="succeeded")
        if row.state == "starting" and row.accepted_at is None:
            return Verdict("resubmit")  # recorded, then the queue stopped before submitting
        # The job server forgot a job it ran: the head restarted (Ray keeps its jobs in the
        # head's GCS) and the job died with it.
        return Verdict("requeue", "lost when the cluster's head restarted")
    status = state.status
    if row.state == "preempting" and status in TERMINAL and stopped_for_queue(row, state):
        if row.resize_to:
            return Verdict("relaunch", f"resized from {row.workers} to {row.resize_to} workers")
        return Verdict("requeue", "preempted", preempted=True)
    if row.state == "preempting" and row.preempt_at is not None \
            and now - row.preempt_at > PREEMPT_GRACE_S and status not in TERMINAL:
        if row.resize_to > row.workers:
            return Verdict("keep", f"no checkpoint within {PREEMPT_GRACE_S:.0f} s of being "
                                   f"asked to grow to {row.resize_to} workers")
        return Verdict("stop")
    if status in TERMINAL:
        failed = status == "FAILED"
        return Verdict("end", f"exited with code {state.exit_code}" if failed
                       and state.exit_code is not None else "failed" if failed else "",
                       state=TERMINAL[status])
    return Verdict("running") if row.state == "starting" else Verdict("")


def stopped_for_queue(row: JobRow, state: JobState) -> bool:
    """Whether preempting ``row``'s attempt, ended as ``state``, stopped for the queue: its
    driver exited with the preempted code (75); or it was told to stop at a checkpoint and
    then exited 0 without saying training ran to its end, or without Ray seeing its exit code;
    or the queue stopped it itself after its grace period. Any other end (a crash while it was
    asked, before it was told) is the job's own outcome, recorded as such: requeueing it would
    hide the failure and run it again."""
    if state.exit_code == PREEMPTED_EXIT_CODE:
        return True
    if state.status == "STOPPED":
        return row.stopped_at is not None
    if told(row):
        return state.exit_code is None or (state.exit_code == 0 and row.completed_at is None)
    return False


def told(row: JobRow) -> bool:
    """Whether ``row`` was told to stop: asked (``preempting``), then a checkpoint call of its
    current attempt was answered "stop", recorded before the answer left the queue. (Not read
    from the checkpoint's and the request's times: a checkpoint at the very clock reading of
    the request came before it and was answered "go on".)"""
    return row.state == "preempting" and row.told_at is not None


def refused(row: JobRow) -> bool:
    """A job that failed without ever starting (the job server refused its submission)."""
    return row.state == "failed" and row.started_at is None


def queued(row: JobRow) -> QueuedJob:
    """``row`` as a policy sees a queued job."""
    gang = (Gang(row.workers, Resources(row.cpus / row.workers, row.gpus / row.workers),
                 row.placement, row.max_workers) if row.workers else None)
    return QueuedJob(row.id, row.team, row.priority, Resources(row.cpus, row.gpus),
                     row.submitted_at, row.estimate_s, gang, key=row.key,
                     attained_s=row.attained_s)


def running(row: JobRow, now: float) -> RunningJob:
    """``row`` as a policy sees a started job."""
    started = now if row.started_at is None else row.started_at
    return RunningJob(queued(row), started, row.checkpoint_at,
                      resumed=row.preemptions + row.resizes > 0)


def attained(row: JobRow, now: float) -> float:
    """The service ``row`` has attained by ``now``: its ended attempts' plus, while started,
    its current one's (:func:`raydeck.scheduling.policies.attained_service.attained`). The
    queue stores it as ``attained_s`` as the attempt ends, so it never decreases."""
    return attained_service.attained(queued(row), row.started_at, now)


def holds(row: JobRow) -> Resources:
    """What active ``row`` holds: its needs, an elastic job's at the larger of its size and the
    size it is asked to restart at."""
    grown = row.sized(row.resize_to) if row.resize_to > row.workers else {}
    return Resources(grown.get("cpus", row.cpus), grown.get("gpus", row.gpus))


def free_capacity(free_nodes: tuple[Resources, ...], total_nodes: tuple[Resources, ...],
                  active: list[JobRow], serving: Resources = Resources(),
                  releasing: Resources = Resources()) -> tuple[Capacity, Resources]:
    """Free (per node, and a pool) and total resources, ``active`` being the queue's started
    jobs, ``serving`` what Serve's live replicas hold and ``releasing`` what the replicas Serve
    is stopping hold until they exit: the pool is the smaller of what is free now, with
    ``releasing`` (jobs outside the queue count), and the total less what ``active`` and
    ``serving`` hold (a job just started may not have claimed its own yet; an elastic job asked
    to grow holds its new size already: the room is kept for its restart). A stopping replica's
    room is so the next job's, once: counted again as given back, it would make a ceiling be
    lowered twice for one job, or raised into the room of the job it was lowered for."""
    available = Resources.total(free_nodes) + releasing
    total = Resources.total(total_nodes)
    held = serving
    for row in active:
        held = held + holds(row)
    by_reservation = total - held
    pool = Resources(min(available.cpus, by_reservation.cpus),
                     min(available.gpus, by_reservation.gpus))
    return Capacity(pool, free_nodes), total


def claiming(active: list[JobRow], waiting: list[QueuedJob], now: float,
             placed: Callable[[str], bool]) -> list[QueuedJob]:
    """The jobs of ``active`` started less than ``CLAIM_S`` ago that Ray has not ``placed``
    yet (a launcher's call, by submission id); asked only when a strict gang is ``waiting`` or
    among them (no other start depends on it:
    :func:`~raydeck.scheduling.queue.listing.held_back`)."""
    recent = [r for r in active if r.started_at is not None and now - r.started_at < CLAIM_S]
    if not any(map(strict, [*waiting, *map(queued, recent)])):
        return []
    return [queued(r) for r in recent if not placed(r.submission_id)]
