"""The training runtime's preemption signal: a queued job tells the queue of each committed
checkpoint and learns there that it should stop (as Determined's ``should_preempt()``).

This module sits below tracking and scheduling: the queue (:mod:`raydeck.scheduling`)
implements :class:`PreemptionQueue` as a named actor, and the tracker
(``Tracker.should_preempt``), ``report_epoch``, the Lightning callback and the training driver
(:func:`raydeck.train.trainer.end_if_preempted`) consume the answer; none of them imports the queue.

Owns: ``RAYDECK_QUEUE_JOB`` (the queue's id of the job, set in the job's runtime env when the
queue starts it), ``RAYDECK_QUEUE_TOKEN`` (the token of this attempt, set beside it: every call
to the queue carries it, and the queue answers only its current attempt; an earlier attempt still
running is told to stop at its checkpoints, and its stop or completion is refused),
``RAYDECK_QUEUE_WORKERS`` (for an elastic job, the most workers the queue
allows it in this attempt: :func:`queue_workers`), the queue actor's name,
:func:`checkpoint_committed` (every rank calls it after a committed checkpoint; rank 0 tells the
queue and every rank gets rank 0's answer, so all ranks stop at the same epoch),
:func:`stop_requested` (that answer, for the training loop) and :func:`stopped_for_queue` (the
driver, once training returned: whether its workers stopped for the queue and which preemption
it was; or tell the queue that training ran to its end).

Contract: a job the queue did not start makes no call and is never asked to stop. A queue that
cannot be reached answers "go on" (logged): a queue outage never stops training. The handshake
is durable: the queue records "told to stop" before its answer leaves it, and a rank told to
stop records it in the cluster's key-value store (the Ray job's own key) before it stops, so the
driver raises :class:`~raydeck.errors.JobPreemptedError` (exit 75) whenever its workers stopped
for the queue, even when its own call to the queue fails or times out; the queue, for its part,
takes a job it told to stop that still exits 0 without calling ``completed`` as preempted.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

from raydeck._internal.contract import (
    KV_NAMESPACE,
    QUEUE_ACTOR_NAME,
    QUEUE_JOB_ENV,
    QUEUE_TOKEN_ENV,
    QUEUE_WORKERS_ENV,
)
from raydeck.config.settings import load_settings
from raydeck.errors import ConfigError

logger = logging.getLogger(__name__)

QUEUE_CALL_TIMEOUT_S = 10.0
# Where a rank told to stop leaves word for its driver: key ``<prefix><Ray job id>``.
STOPPED_KEY_PREFIX = "preempted:"



class PreemptionQueue(Protocol):
    """What the queue's actor answers a job (each as ``(ok, value)``, through Ray); ``token``:
    the calling attempt's (``RAYDECK_QUEUE_TOKEN``). A token that is not the current attempt's
    is told to stop (``checkpointed``) or refused (the others: ``(False, message)``)."""

    def checkpointed(self, job_id: str, token: str) -> tuple[bool, bool]:
        """A checkpoint of ``job_id`` committed: whether it should stop now."""
        ...

    def preempted(self, job_id: str, token: str) -> tuple[bool, int | None]:
        """Which preemption of ``job_id`` stopped it, None when it was not told to stop."""
        ...

    def completed(self, job_id: str, token: str) -> tuple[bool, None]:
        """``job_id`` trained to its end: it was not stopped, whatever it was told."""
        ...


_stop_requested = False
_handle: Any = None


def queue_job_id() -> str | None:
    """The queue's id of this job, None when the queue did not start it."""
    return os.environ.get(QUEUE_JOB_ENV) or None


def queue_workers() -> int | None:
    """The most workers the queue allows this elastic job now, None when it sets no bound (a
    fixed gang, or a job the queue did not start).

    Raises:
        ConfigError: ``RAYDECK_QUEUE_WORKERS`` is set but not a whole number >= 1.
    """
    raw = os.environ.get(QUEUE_WORKERS_ENV)
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"{QUEUE_WORKERS_ENV}={raw!r}: must be a whole number >= 1 (set by "
                          "the queue; unset it to run the job outside the queue)")
    return int(raw)


def _ask(method: str, job_id: str) -> Any:
    """Call the queue actor; None when it cannot be reached (or refuses)."""
    return _call(method, job_id)[1]


def _call(method: str, job_id: str) -> tuple[bool, Any]:
    """Call the queue actor with this attempt's token: ``(True, its answer)``, or
    ``(False, None)`` when it cannot be reached in ``QUEUE_CALL_TIMEOUT_S`` or refuses."""
    global _handle
    # Deferred for start-up time: the queue's side imports this module's constants, and Ray
    # only matters to a queued job, which has imported it already.
    import ray

    try:
        if _handle is None:
            _handle = ray.get_actor(QUEUE_ACTOR_NAME, namespace=load_settings().ray_namespace)
        ok, value = ray.get(getattr(_handle, method).remote(job_id, _token()),
                            timeout=QUEUE_CALL_TIMEOUT_S)
    except Exception as exc:
        _handle = None
        logger.warning("the job queue did not answer %s (%s); training goes on", method, exc)
        return False, None
    if not ok:
        logger.warning("the job queue refused %s: %s", method, value)
        return False, None
    return True, value


def _token() -> str:
    """This attempt's token ("" for a job started by a queue that issued none)."""
    return os.environ.get(QUEUE_TOKEN_ENV, "")


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
        if rank == 0:
            _record_stop()
        logger.warning("job %s is preempted by the queue: stopping at this checkpoint", job_id)
    return _stop_requested


def stop_requested() -> bool:
    """What the last :func:`checkpoint_committed` answered in this process."""
    return _stop_requested


def stopped_for_queue() -> tuple[bool, int | None]:
    """In a queued job's driver once Ray Train returned: whether its workers stopped because
    the queue asked them to (their word in the key-value store, or the queue's confirmation:
    either suffices), and which preemption of the job it was (1 for the first; None when the
    queue did not confirm). A job the queue did not start answers ``(False, None)``; a job that
    ran to its end tells the queue so (``completed``) when the queue answers.
    """
    job_id = queue_job_id()
    if job_id is None:
        return False, None
    answered, number = _call("preempted", job_id)
    if number is None and not _workers_stopped():
        if answered:
            _call("completed", job_id)
        return False, None
    return True, number


def _stopped_key() -> str:
    import ray

    return f"{STOPPED_KEY_PREFIX}{ray.get_runtime_context().get_job_id()}"


def _record_stop() -> None:
    """On rank 0, told to stop: leave word for the driver (same Ray job) that its workers
    stop for the queue. Logged, not raised, when it cannot: the queue's record still holds."""
    from ray.experimental.internal_kv import _internal_kv_put

    try:
        _internal_kv_put(_stopped_key(), b"1", overwrite=True, namespace=KV_NAMESPACE)
    except Exception as exc:
        logger.warning("could not record the preemption for the driver (%s)", exc)


def _workers_stopped() -> bool:
    """In the driver: whether a rank of this Ray job recorded that it stopped for the queue."""
    from ray.experimental.internal_kv import _internal_kv_exists

    try:
        return bool(_internal_kv_exists(_stopped_key(), namespace=KV_NAMESPACE))
    except Exception as exc:
        logger.warning("cannot read whether the workers stopped for the queue (%s)", exc)
        return False


def _agree(value: bool) -> bool:
    """Rank 0's ``value`` on every rank of the job's process group."""
    # Deferred for start-up time: torch is imported only by a process that trains.
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return bool(shared[0])
