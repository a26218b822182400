"""When a running job may be preempted, and how the room its stop frees is kept for the job it
was stopped for: the rules the queue (:mod:`raydeck.scheduling.queue.job_queue`) and the simulator
(:mod:`raydeck.scheduling.simulator.replay`) both apply, so a trace replay preempts as the queue
does.

Owns: :data:`MIN_RUN_BEFORE_PREEMPTION_S`, :func:`preemptible`, :func:`preempt` and
:func:`decide` (a policy's decisions with these rules applied). The policies themselves
(:mod:`raydeck.scheduling.policies.core`) say whom to stop and in which order jobs start; these
rules keep that from looping.

Why: a victim goes back in its place (same submission time). Under most orders that place is
ahead of the job it made room for (FIFO always; ``priority`` once it has waited long enough),
so without these rules it restarts first in the room it freed and, holding an old checkpoint,
is at once a victim again while the job it was stopped for never starts.

Contract:

- A preemption is made for one named job (:class:`~raydeck.scheduling.policies.core.Preemption`'s
  ``job``). Each victim records it (``preempted_for``) and does not start again while that job
  is still queued (:func:`held_back`); that job starts as soon as it fits, before the policy's
  other choices, and until then what it needs is kept from them (:func:`decide`).
- A job is a victim only with a checkpoint committed in its current attempt (the one it would
  resume from); a job that was preempted before also only once its current attempt has run
  :data:`MIN_RUN_BEFORE_PREEMPTION_S` (:func:`preemptible`). So no job is preempted twice
  without committing a new checkpoint in between, and each restart buys real progress.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from raydeck.scheduling.policies.core import (
    Capacity,
    Policy,
    Preemption,
    QueuedJob,
    Resources,
    RunningJob,
)

# A job restarted after a preemption runs at least this long before it may be stopped again:
# a restart costs minutes (workers start, the checkpoint loads), which a shorter run would not
# repay. A first attempt may be stopped at its first checkpoint. The queue's default
# (``raydeck queue --min-run``).
MIN_RUN_BEFORE_PREEMPTION_S = 600.0


def preemptible(job: RunningJob, now: float,
                min_run_s: float = MIN_RUN_BEFORE_PREEMPTION_S) -> bool:
    """Whether ``job`` may be a victim at ``now``: it committed a checkpoint in its current
    attempt (``checkpoint_s`` at or after ``started_s``) and, if it was preempted before
    (``resumed``), that attempt has run ``min_run_s``."""
    if job.checkpoint_s is None or job.checkpoint_s < job.started_s:
        return False
    return not job.resumed or now - job.started_s >= min_run_s


def preempt(policy: Policy, queue: Sequence[QueuedJob], running: Sequence[RunningJob],
            free: Resources, now: float,
            min_run_s: float = MIN_RUN_BEFORE_PREEMPTION_S) -> Preemption | None:
    """:meth:`Policy.preempt` with only :func:`preemptible` jobs (under ``min_run_s``) as
    victims (``running`` and ``free`` leave out, and count as free, the jobs already
    stopping)."""
    return policy.preempt(queue, running, free, now,
                          can_stop=lambda job: preemptible(job, now, min_run_s))


def held_back(preempted_for: Mapping[str, str], queued: Collection[str]) -> dict[str, str]:
    """The entries of ``preempted_for`` (a job -> the job it was last preempted for, "" for
    none) whose job is still in ``queued``: those victims may not start yet, and those jobs go
    first (:func:`decide`)."""
    return {victim: job for victim, job in preempted_for.items() if job and job in queued}


def decide(policy: Policy, queue: Sequence[QueuedJob], running: Sequence[RunningJob],
           free: Capacity, total: Resources, now: float,
           preempted_for: Mapping[str, str]) -> list[QueuedJob]:
    """The jobs to start now, in order: :meth:`Policy.decide` over ``queue`` less the victims
    in ``preempted_for`` (what :func:`held_back` kept), except that a job others were
    preempted for goes first. It starts as soon as it fits (within its team's quota); until
    then its needs are kept from the pool the others are chosen on, so the room its victims
    free is its own.

    Contract: every job returned fits ``free`` placed in the returned order (the pool kept
    for a waiting job only shrinks what the others may take).
    """
    first_ids = set(preempted_for.values())
    candidates = [job for job in queue if job.id not in preempted_for]
    first = [job for job in candidates if job.id in first_ids]
    started: list[QueuedJob] = []
    running = list(running)
    for job in policy.order(first, running, now):
        if not policy.allowed(job, running):
            continue
        left = free.after(job)
        if left is None:
            free = Capacity(free.pool - job.needs, free.nodes)
            continue
        started.append(job)
        running.append(RunningJob(job, now))
        free = left
    rest = [job for job in candidates if job.id not in first_ids]
    return started + policy.decide(rest, running, free, total, now)
