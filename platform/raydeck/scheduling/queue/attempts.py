"""Every attempt of the queue's jobs that the job server may run, read once per tick.

Owns: :func:`read` (one ``statuses`` request for the current attempt of each started job, of
each queued job whose submission's answer was lost, and every earlier attempt of the queue's
live and recently ended jobs) and :func:`stop` (stopping the orphans it finds). The queue
(:meth:`raydeck.scheduling.queue.job_queue.JobQueue.tick`) applies what it read under its lock;
this module takes no lock and calls the job server and MLflow (the witness) without one.

Why every attempt, not only the current: a cancel or a relaunch can race a submission that is
still landing (a timeout after the job server got it), and only the job server knows it landed.
Reading all of them in one list answers that at no extra request, so "one attempt of a job
runs, and a cancelled or ended job runs none" holds within a tick of any such race.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from raydeck._internal.contract import PREEMPTED_EXIT_CODE
from raydeck.scheduling.queue.failures import classify
from raydeck.scheduling.queue.launcher import JobState, Launcher
from raydeck.scheduling.queue.reconcile import TERMINAL
from raydeck.scheduling.queue.store import ACTIVE, JobRow, Store, submission_id
from raydeck.scheduling.queue.witness import RunFinished, witness

logger = logging.getLogger(__name__)

# How long after a job ended the queue still stops any attempt of it the job server runs (one
# whose submission raced its cancel): far longer than a submission can take to land.
ORPHAN_WATCH_S = 3600.0


@dataclass
class JobServerView:
    """One tick's read of the job server.

    ``active``: each started job with its state (None: the job server does not know it), why
    its witness says it finished, and its log's end when it failed. ``adopt``: queued jobs
    whose submission, its answer lost, reached the job server after all (started, never to be
    submitted again). ``orphans``: attempts the job server runs that the queue does not (not
    the current attempt of their job, or of a job that ended).
    """

    orphans: list[str]
    adopt: list[JobRow] = field(default_factory=list)
    active: list[tuple[JobRow, JobState | None, str, str]] = field(default_factory=list)


def read(store: Store, launcher: Launcher, run_finished: RunFinished | None, now: float
         ) -> JobServerView | None:
    """What the job server has of ``store``'s jobs, in one request; None when it cannot
    answer now (the tick starts what it can and reads it again next time)."""
    active = store.jobs(*ACTIVE)
    queued = store.jobs("queued")
    ended = store.ended_since(now - ORPHAN_WATCH_S)
    lost = [r for r in queued if r.submit_failures]
    current = {r.submission_id: r for r in [*active, *lost]}
    earlier = {submission_id(r.id, a) for r in [*active, *queued] for a in range(r.attempt)}
    earlier |= {submission_id(r.id, a) for r in ended for a in range(r.attempt + 1)}
    try:
        states = launcher.statuses([*current, *earlier])
    except Exception as exc:
        logger.warning("cannot read the job server's statuses now: %s", classify(exc).reason)
        return None
    seen = JobServerView(orphans=[sid for sid in earlier if sid in states
                                  and states[sid].status not in TERMINAL],
                         adopt=[r for r in lost if r.submission_id in states])
    for row in active:
        state = states.get(row.submission_id)
        try:
            finished = witness(row, run_finished) if state is None else ""
        except Exception as exc:
            logger.warning("cannot reconcile job %s now: %s", row.id, classify(exc).reason)
            continue
        failed = state is not None and state.status == "FAILED" \
            and state.exit_code != PREEMPTED_EXIT_CODE
        seen.active.append((row, state, finished,
                            launcher.log_tail(row.submission_id) if failed else ""))
    return seen


def stop(launcher: Launcher, orphans: list[str]) -> None:
    """Stop each orphan attempt; one the job server cannot stop now is tried at the next tick
    (it is still an orphan then)."""
    for sid in orphans:
        logger.warning("stopping %s: an attempt the queue no longer runs", sid)
        try:
            launcher.stop(sid)
        except Exception as exc:
            logger.warning("cannot stop %s now (%s); tried again next tick", sid,
                           classify(exc).reason)
