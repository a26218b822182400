"""Running a tracked Ray Train job: the driver side of raydeck's training runtime.

Owns: turning a training function, a scaling choice and a tracker into a ``TorchTrainer`` whose
workers log to the tracker's run, whose checkpoints go to raydeck's storage, and which restarts
from the latest checkpoint when a worker dies; in a job the queue started, an elastic scaling
choice kept within the workers the queue allows it (:func:`within_queue`); Ray Train's node-drain
watcher kept off, since its creation logs a Ray Core ERROR in every job
(:func:`without_preemption_watcher`). Does not own: what
a checkpoint holds (:mod:`raydeck.train.checkpointing`) or scaling presets
(:mod:`raydeck.train.presets`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

from raydeck._internal.contract import PREEMPTION_TAG_PREFIX, PREEMPTIONS_TAG
from raydeck.config.settings import Settings
from raydeck.errors import JobPreemptedError
from raydeck.tracking.client import preemption
from raydeck.tracking.client.tracker import Tracker
from raydeck.train.presets import DEFAULT_CHECKPOINTS_TO_KEEP, DEFAULT_MAX_FAILURES

logger = logging.getLogger(__name__)

# Ray Train's switch for its node-drain (spot preemption) watcher; see without_preemption_watcher.
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


def checkpoint_storage_path(settings: Settings) -> str:
    """Where Ray Train persists checkpoints, as a URI a user reads.

    The checkpoint bucket (``s3://<bucket>/<prefix>``) when object storage is configured, else
    ``<data_dir>/checkpoints`` on one machine. A ``RunConfig`` also needs the filesystem that
    carries the endpoint and credentials: build it from
    ``raydeck.storage.checkpoint_storage(settings).run_config_kwargs()``, as :func:`fit` does.
    """
    from raydeck.storage import checkpoint_storage

    return checkpoint_storage(settings).uri


def torch_config(scaling_config: Any) -> Any:
    """The ``TorchConfig`` for workers with ``scaling_config``'s resources.

    NCCL refuses two ranks on one GPU (``ncclInvalidUsage: Duplicate GPU detected``, seen on an
    H200 with the gpu-quarter preset), and workers with a share of a GPU (``gpu-half``,
    ``gpu-quarter``, ``gpu-pack``...) share one: they use gloo, which all-reduces CUDA tensors
    too. Whole-GPU and CPU workers keep Ray Train's default (NCCL on GPUs, gloo on CPUs).
    """
    from ray.train.torch import TorchConfig

    resources = scaling_config.resources_per_worker or {}
    gpus = float(resources.get("GPU", 1.0 if scaling_config.use_gpu else 0.0))
    return TorchConfig(backend="gloo") if 0 < gpus < 1 else TorchConfig()


def without_preemption_watcher() -> None:
    """Start the ``TorchTrainer`` runs of this process without Ray Train's preemption watcher,
    unless ``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER`` is set already (a user's choice wins: ``1``
    keeps the watcher, and the ERROR line below with it).

    Why: Ray 2.60's Train v2 controller starts a ``PreemptionWatcher`` actor for every worker
    group (``ray/train/v2/_internal/callbacks/preemption_callback.py``,
    ``PreemptionCallback.after_worker_group_start``) with ``max_restarts=-1`` and the worker
    actors' handles among its constructor arguments. Ray Core's ``CoreWorker::CreateActor``
    logs, at ERROR, that any restartable actor whose arguments carry a reference (an actor
    handle counts, unless its actor is detached) "has constructor arguments in the object
    store and max_restarts > 0" (ray-project/ray#53727; #57931 exempts only detached actors).
    The workers are not detached, so every fit's controller logged that line, and Ray streams
    it into the job's log: a false alarm in every healthy job. Nothing raydeck passes causes
    it, and no Ray option but this switch avoids it.

    What is lost: the watcher only tells the workers ahead of time that their node is being
    drained (``ray.train.get_preemption_info()``) and lets the survivors run until the drain's
    deadline. raydeck's training functions do not read that signal (raydeck's own preemption is
    the queue's, :mod:`raydeck.tracking.client.preemption`), and a worker lost with a drained
    node is still told apart from a failure (``max_preemption_failures``) and restarted from
    the latest checkpoint. It also saves an actor process per fit.

    Ray Train reads the switch from the driver's environment when a fit starts its controller
    (``get_env_vars_to_propagate``) and hands it on to the controller, so it is set in this
    process's ``os.environ``, and stays set for the rest of the process.
    """
    os.environ.setdefault(PREEMPTION_WATCHER_ENV, "0")


def within_queue(scaling_config: Any) -> Any:
    """``scaling_config`` kept within the workers the queue allows this elastic job now
    (:func:`raydeck.tracking.client.preemption.queue_workers`): a range ``(min, max)`` becomes
    ``(min, allowed)``, a fixed ``min`` when the two meet. Ray Train then starts the job at up to
    that size and grows it no further; the queue restarts it at another size through its preemption
    signal. A fixed size, or a job the queue sets no bound for, is returned as it is.
    """
    allowed = preemption.queue_workers()
    workers = scaling_config.num_workers
    if allowed is None or not isinstance(workers, tuple):
        return scaling_config
    low, high = workers
    bound = max(low, min(high, allowed))
    return dataclasses.replace(scaling_config,
                               num_workers=bound if bound == low else (low, bound))


def fit(
    train_fn: Callable[[dict[str, Any]], None],
    *,
    tracker: Tracker,
    settings: Settings,
    train_loop_config: dict[str, Any],
    scaling_config: Any,
    max_failures: int = DEFAULT_MAX_FAILURES,
    checkpoints_to_keep: int = DEFAULT_CHECKPOINTS_TO_KEEP,
) -> Any:
    """Fit ``train_fn`` on Ray Train workers, tracked in ``tracker``'s run.

    Args:
        train_fn: the per-worker training function; it calls ``raydeck.get_tracker()`` and
            lands in ``tracker``'s run (the RunConfig name binds it).
        tracker: the driver's tracker for the run.
        settings: raydeck settings (checkpoint storage).
        train_loop_config: passed to ``train_fn``.
        scaling_config: a ``ray.train.ScalingConfig`` (an elastic one is kept within the
            size the queue allows the job: :func:`within_queue`).
        max_failures: worker-group restarts from the latest checkpoint before giving up.
        checkpoints_to_keep: newest checkpoints kept in storage.

    Returns:
        Ray Train's ``Result``.

    Raises:
        StorageError: object storage is configured but unreachable, refuses the credentials
            or lacks a bucket (checked before any worker starts).
        JobPreemptedError: raydeck's job queue preempted the job; its workers stopped at a
            committed checkpoint and the run ended KILLED (exit unfinished: the queue starts
            the job again and it resumes there).
    """
    from ray.train import CheckpointConfig, FailureConfig
    from ray.train.torch import TorchTrainer

    from raydeck.storage import checkpoint_storage, verify

    verify(settings.storage)
    without_preemption_watcher()
    run_config = tracker.run_config(
        **checkpoint_storage(settings).run_config_kwargs(),
        failure_config=FailureConfig(max_failures=max_failures),
        checkpoint_config=CheckpointConfig(num_to_keep=checkpoints_to_keep),
    )
    trainer = TorchTrainer(
        train_fn,
        train_loop_config=train_loop_config,
        scaling_config=within_queue(scaling_config),
        run_config=run_config,
        torch_config=torch_config(scaling_config),
    )
    result = trainer.fit()
    end_if_preempted(tracker, result)
    return result


def end_if_preempted(tracker: Tracker, result: Any) -> None:
    """After Ray Train returned in a queued job's driver: if its workers stopped because the
    queue asked them to (:func:`raydeck.tracking.client.preemption.stopped_for_queue`, which holds
    even when the queue's confirmation fails or times out), tag the run (``raydeck.preemptions``,
    ``raydeck.preemption.<N>`` when the queue confirms which preemption it was), end it KILLED
    (the next attempt marks it running again) and raise. A job that finished before any rank
    was told goes on as finished.

    Raises:
        JobPreemptedError: the job stopped at a checkpoint for the queue.
    """
    stopped, number = preemption.stopped_for_queue()
    if not stopped:
        return
    epoch = (result.metrics or {}).get("epoch")
    where = f"stopped after epoch {epoch}" if epoch is not None else "stopped at a checkpoint"
    job_id = preemption.queue_job_id()
    if number is None:
        logger.warning("job %s: its workers stopped for the queue, which did not confirm it "
                       "(the run is not tagged with the preemption's number)", job_id)
    else:
        tracker.set_tags({PREEMPTIONS_TAG: number, f"{PREEMPTION_TAG_PREFIX}{number}": where},
                         strict=False)
    tracker.finish("KILLED")
    raise JobPreemptedError(f"job {job_id}: preempted by the queue ({where}, preemption "
                            f"{number or '(unconfirmed)'}); it resumes from that checkpoint in "
                            f"run {tracker.run_id}")
