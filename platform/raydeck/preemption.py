"""The training runtime's preemption signal: a queued job tells the queue of each committed
checkpoint and learns there that it should stop (as Determined's ``should_preempt()``).

This module sits below tracking and scheduling: the queue (:mod:`raydeck.scheduling`)
implements :class:`PreemptionQueue` as a named actor, and the tracker
(``Tracker.should_preempt``), ``report_epoch``, the Lightning callback and the training driver
(:func:`raydeck.training.end_if_preempted`) consume the answer; none of them imports the queue.

Owns: ``RAYDECK_QUEUE_JOB`` (the queue's id of the job, set in the job's runtime env when the
queue starts it), the queue actor's name, :func:`checkpoint_committed` (every rank calls it
after a committed checkpoint; rank 0 tells the queue and every rank gets rank 0's answer, so all
ranks stop at the same epoch), :func:`stop_requested` (that answer, for the training loop) and
:func:`preemption_number` (the driver, once training returned: which preemption stopped it).

Contract: a job the queue did not start makes no call and is never asked to stop. A queue that
cannot be reached answers "go on" (logged): a queue outage never stops training.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

from raydeck.config import load_settings

logger = logging.getLogger(__name__)

QUEUE_JOB_ENV = "RAYDECK_QUEUE_JOB"
# The queue's detached actor, in the settings' Ray namespace.
QUEUE_ACTOR_NAME = "raydeck-queue"
QUEUE_CALL_TIMEOUT_S = 10.0
# A preempted job's exit status (EX_TEMPFAIL: try again later), so it is not mistaken for done.
PREEMPTED_EXIT_CODE = 75
# On the run of a preempted job: how many times, and where each stopped.
PREEMPTIONS_TAG = "raydeck.preemptions"
PREEMPTION_TAG_PREFIX = "raydeck.preemption."



class PreemptionQueue(Protocol):
    """What the queue's actor answers a job (each as ``(ok, value)``, through Ray)."""

    def checkpointed(self, job_id: str) -> tuple[bool, bool]:
        """A checkpoint of ``job_id`` committed: whether it should stop now."""
        ...

    def preempted(self, job_id: str) -> tuple[bool, int | None]:
        """Which preemption of ``job_id`` stopped it, None when it was not told to stop."""
        ...


_stop_requested = False
_handle: Any = None


def queue_job_id() -> str | None:
    """The queue's id of this job, None when the queue did not start it."""
    return os.environ.get(QUEUE_JOB_ENV) or None


def _ask(method: str, job_id: str) -> Any:
    """Call the queue actor; None when it cannot be reached."""
    global _handle
    # Deferred for start-up time: the queue's side imports this module's constants, and Ray
    # only matters to a queued job, which has imported it already.
    import ray

    try:
        if _handle is None:
            _handle = ray.get_actor(QUEUE_ACTOR_NAME, namespace=load_settings().ray_namespace)
        ok, value = ray.get(getattr(_handle, method).remote(job_id),
                            timeout=QUEUE_CALL_TIMEOUT_S)
    except Exception as exc:
        _handle = None
        logger.warning("the job queue did not answer (%s); training goes on", exc)
        return None
    return value if ok else None


def checkpoint_committed(rank: int) -> bool:
    """After a committed checkpoint, on every rank of a Ray Train job (a collective when there
    are several): whether the queue asks the job to stop now. The checkpoint just committed is
    what the job resumes from, so the training function should return.
    """
    global _stop_requested
    job_id = queue_job_id()
    if job_id is None:
        return False
    answer = bool(_ask("checkpointed", job_id)) if rank == 0 else False
    _stop_requested = _agree(answer)
    if _stop_requested:
        logger.warning("job %s is preempted by the queue: stopping at this checkpoint", job_id)
    return _stop_requested


def stop_requested() -> bool:
    """What the last :func:`checkpoint_committed` answered in this process."""
    return _stop_requested


def preemption_number() -> int | None:
    """In a queued job's driver once Ray Train returned: which preemption of this job stopped
    it (1 for the first), None when the job was not queued or no rank was told to stop.
    """
    job_id = queue_job_id()
    return _ask("preempted", job_id) if job_id is not None else None


def _agree(value: bool) -> bool:
    """Rank 0's ``value`` on every rank of the job's process group."""
    # Deferred for start-up time: torch is imported only by a process that trains.
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return bool(shared[0])
