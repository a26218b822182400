"""A queued job's side of preemption: telling the queue of each committed checkpoint, and
learning there that it should stop (as Determined's ``should_preempt()``).

Owns: ``RAYDECK_QUEUE_JOB`` (the queue's id of the job, set in the job's runtime env when the
queue starts it), :func:`checkpoint_committed` (every rank calls it after a committed
checkpoint; rank 0 tells the queue and every rank gets rank 0's answer, so all ranks stop at the
same epoch), :func:`stop_requested` (that answer, for the training loop) and
:func:`end_if_preempted` (the driver, once training returned: record the preemption on the run,
end it KILLED and raise, so the job exits unfinished and the queue starts it again).

Contract: a job the queue did not start makes no call and is never asked to stop. A queue that
cannot be reached answers "go on" (logged): a queue outage never stops training.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from raydeck.errors import JobPreemptedError

if TYPE_CHECKING:
    from raydeck.tracking.tracker import Tracker

logger = logging.getLogger(__name__)

QUEUE_JOB_ENV = "RAYDECK_QUEUE_JOB"
QUEUE_CALL_TIMEOUT_S = 10.0
# A preempted job's exit status (EX_TEMPFAIL: try again later), so it is not mistaken for done.
PREEMPTED_EXIT_CODE = 75
# On the run of a preempted job: how many times, and where each stopped.
PREEMPTIONS_TAG = "raydeck.preemptions"
PREEMPTION_TAG_PREFIX = "raydeck.preemption."

_stop_requested = False
_handle: Any = None


def queue_job_id() -> str | None:
    """The queue's id of this job, None when the queue did not start it."""
    return os.environ.get(QUEUE_JOB_ENV) or None


def _ask(method: str, job_id: str) -> Any:
    """Call the queue actor; None when it cannot be reached."""
    global _handle
    import ray

    from raydeck.config import load_settings
    from raydeck.scheduling.actor import ACTOR_NAME

    try:
        if _handle is None:
            _handle = ray.get_actor(ACTOR_NAME, namespace=load_settings().ray_namespace)
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


def end_if_preempted(tracker: Tracker, result: Any) -> None:
    """After Ray Train returned in a queued job's driver: if its workers stopped because the
    queue asked them to, tag the run (``raydeck.preemptions``, ``raydeck.preemption.<N>``),
    end it KILLED (the next attempt marks it running again) and raise. A job that finished
    before any rank was told goes on as finished.

    Raises:
        JobPreemptedError: the job stopped at a checkpoint for the queue.
    """
    job_id = queue_job_id()
    number = _ask("preempted", job_id) if job_id is not None else None
    if number is None:
        return
    epoch = (result.metrics or {}).get("epoch")
    where = f"stopped after epoch {epoch}" if epoch is not None else "stopped at a checkpoint"
    tracker.set_tags({PREEMPTIONS_TAG: number, f"{PREEMPTION_TAG_PREFIX}{number}": where},
                     strict=False)
    tracker.finish("KILLED")
    raise JobPreemptedError(f"job {job_id}: preempted by the queue ({where}, preemption "
                            f"{number}); it resumes from that checkpoint in run {tracker.run_id}")


def _agree(value: bool) -> bool:
    """Rank 0's ``value`` on every rank of the job's process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return bool(shared[0])
