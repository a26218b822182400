"""Full training state as a Ray Train ``Checkpoint``, and epochs that land in MLflow exactly once.

Owns: saving and restoring model, optimizer, scheduler, epoch/step, RNG states and the tracking
run id; reporting an epoch to Ray Train and to the tracker together; recording each checkpoint's
URI in the run. Does not own: where checkpoints are stored (``RunConfig.storage_path``, see
:mod:`raydeck.train.trainer` and :mod:`raydeck.storage`) or how many are kept
(``CheckpointConfig``).

Why epochs land exactly once after a worker dies:

1. An epoch's metrics are logged only after Ray Train has *committed* its checkpoint (its
   controller has the reports of every worker: :func:`report_checkpoint` waits with
   ``ray.train.get_all_reported_checkpoints(COMMITTED)``, at most one controller poll,
   ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``). A checkpoint that was uploaded but not committed
   when a worker died is not the one training restarts from, so the epoch it holds is trained
   again; had its metrics been logged already, the history would hold that epoch twice.
2. The metric points, with their timestamps, are stored *in* the checkpoint. On resume,
   :func:`restore` logs the stored points of the restored epoch again: if they had landed, MLflow
   keeps one copy (identical key, step, timestamp and value); if the worker died between the
   commit and sending them, they land now.
3. Rank 0 records each committed checkpoint in the run's tags (``raydeck.checkpoint.latest``,
   ``.latest_epoch``, ``.epoch_<N>``) after the commit; on resume it records the restored one
   again, so a rank 0 that died between a commit and its tags leaves no committed checkpoint
   out of the run's record.

Epochs after the restored checkpoint are re-run and logged as new.

Why the world size is logged with every checkpoint: an elastic job (a preset with a worker range,
:mod:`raydeck.train.presets`) is resized by Ray Train as a restart from the latest checkpoint, at a
new world size. Each rank stores ``raydeck/world_size`` with its checkpoint's points, so it lands
exactly once per checkpoint like the metrics, and the run's history shows the size each epoch
(each logged step, for Lightning) was trained at: a resize is a change in that series.
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raydeck.observability.metrics import training_metrics
from raydeck.tracking.client import preemption
from raydeck.tracking.client.tracker import Tracker

logger = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
CHECKPOINT_DIR_FORMAT = "epoch_{epoch:06d}"
CHECKPOINT_TAG_PREFIX = "raydeck.checkpoint."
# How long a worker waits for Ray Train to commit a checkpoint before logging its epoch anyway
# (a warning says so): committing takes one controller poll once every worker has reported.
COMMIT_TIMEOUT_S = 600.0
WORLD_SIZE_METRIC = "raydeck/world_size"

MetricPoint = tuple[str, float, int, int]
"""One logged value: ``(key, value, timestamp_ms, step)``."""


@dataclass
class TrainState:
    """What :func:`restore` found: continue with epoch ``epoch + 1``."""

    epoch: int
    step: int
    run_id: str
    extra: dict[str, Any] = field(default_factory=dict)


def metrics_file(rank: int) -> str:
    """Name of the file in a raydeck checkpoint holding rank ``rank``'s metric points."""
    return f"metrics_rank_{rank}.json"


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DistributedDataParallel, so checkpoints load into a plain model."""
    inner = getattr(model, "module", model)
    return inner if isinstance(inner, torch.nn.Module) else model


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_state(
    directory: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    epoch: int,
    step: int,
    run_id: str,
    extra: dict[str, Any] | None,
) -> None:
    """Write the full training state into ``directory`` (the one file raydeck checkpoints hold)."""
    torch.save(
        {
            "epoch": epoch,
            "step": step,
            "run_id": run_id,
            "model": _unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict() if optimizer else None,
            "scheduler": scheduler.state_dict() if scheduler else None,
            "rng": _rng_state(),
            "extra": extra or {},
        },
        directory / STATE_FILE,
    )


def read_state(
    directory: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    map_location: str | torch.device = "cpu",
    restore_rng: bool = True,
) -> TrainState:
    """Load a state written by :func:`write_state` into model, optimizer, scheduler and RNGs."""
    state = torch.load(Path(directory) / STATE_FILE, map_location=map_location,
                       weights_only=False)
    _unwrap(model).load_state_dict(state["model"])
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        _set_rng_state(state["rng"])
    return TrainState(epoch=int(state["epoch"]), step=int(state["step"]),
                      run_id=str(state["run_id"]), extra=dict(state["extra"]))


def _rank() -> int:
    import ray.train

    return int(ray.train.get_context().get_world_rank())


def _world_size() -> int:
    import ray.train

    return int(ray.train.get_context().get_world_size())


def report_epoch(
    tracker: Tracker,
    metrics: dict[str, float],
    *,
    epoch: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    step: int = 0,
    extra: dict[str, Any] | None = None,
) -> bool:
    """Checkpoint and report one finished epoch from a Ray Train worker; call on every rank.

    Rank 0 stores the full training state; every rank stores its own metric values. The metrics
    are logged to ``tracker`` at ``step=epoch`` once Ray Train has committed the checkpoint (see
    :func:`report_checkpoint`, which also records the checkpoint in the run).

    Returns:
        True when raydeck's job queue asks this job to stop for a higher-priority one
        (``tracker.should_preempt()``): the same on every rank; return from the training
        function, and the job resumes from this checkpoint when the queue starts it again.
    """
    rank = _rank()
    with tempfile.TemporaryDirectory(prefix="raydeck-ckpt-") as tmp:
        save_started = time.perf_counter()
        if rank == 0:
            write_state(Path(tmp), model=model, optimizer=optimizer, scheduler=scheduler,
                        epoch=epoch, step=step, run_id=tracker.parent_run_key, extra=extra)
        report_checkpoint(tracker, Path(tmp), metrics, epoch=epoch, save_started=save_started)
    return preemption.stop_requested()


def report_checkpoint(
    tracker: Tracker,
    directory: Path,
    metrics: dict[str, Any],
    *,
    epoch: int,
    points: list[MetricPoint] | None = None,
    save_started: float | None = None,
) -> bool:
    """Report ``directory`` as epoch ``epoch``'s checkpoint, and log its metrics once committed.

    The building block of :func:`report_epoch` and of the Lightning integration. Call on every
    rank with a directory holding what this rank saves (rank 0 the training state, others
    possibly nothing); the directory is named ``epoch_<NNNNNN>`` in storage so its URI is
    predictable. Rank 0 records the committed checkpoint in the run as the tags
    ``raydeck.checkpoint.latest``, ``.latest_epoch`` and ``.epoch_<N>``. Prometheus gets this
    rank's progress and the checkpoint's save time and size
    (:class:`~raydeck.observability.metrics.TrainingMetrics`).

    Args:
        tracker: this rank's tracker.
        directory: the checkpoint's files; this function adds ``metrics_rank_<r>.json``.
        metrics: reported to Ray Train (``Result.metrics``, with ``epoch`` added); plain numbers.
        epoch: the finished epoch.
        points: what to log to the tracker after the commit; default ``metrics`` at
            ``step=epoch``, timestamped now. Stored in the checkpoint for :func:`restore`,
            with :data:`WORLD_SIZE_METRIC` added at the last step of ``points``.
        save_started: ``time.perf_counter()`` when saving began (for the save-time metric).

    Returns:
        True when Ray Train committed the checkpoint within ``COMMIT_TIMEOUT_S``; after a
        timeout the points are logged anyway (nothing is dropped) and a warning says so.
    """
    import ray.train

    rank = _rank()
    progress = training_metrics(tracker.run_name, tracker.known_run_id(), rank)
    started = time.perf_counter() if save_started is None else save_started
    if points is None:
        timestamp_ms = int(time.time() * 1000)
        points = [(key, value, timestamp_ms, epoch) for key, value in metrics.items()]
    last = max(points, key=lambda point: point[3], default=None)
    points = [*points, (WORLD_SIZE_METRIC, float(_world_size()),
                        last[2] if last else int(time.time() * 1000),
                        last[3] if last else epoch)]
    (directory / metrics_file(rank)).write_text(
        json.dumps({"epoch": epoch, "points": points}, default=float)
    )
    name = CHECKPOINT_DIR_FORMAT.format(epoch=epoch)
    size_bytes = sum(entry.stat().st_size for entry in os.scandir(directory) if entry.is_file())
    # The epoch goes with the metrics, so a consumer of the report (a sweep's trial turns it
    # into Tune's iteration) knows which epoch it is, also after a restart.
    ray.train.report(
        {"epoch": epoch, **metrics},
        checkpoint=ray.train.Checkpoint.from_directory(str(directory)),
        checkpoint_dir_name=name,
    )
    progress.checkpoint_saved(time.perf_counter() - started, size_bytes)
    progress.step_reported(epoch, metrics)
    committed = _wait_committed(name) if tracker.active else True
    log_points(tracker, points)
    # Hand the epoch to the proxy now: a worker stopped right after (a pruned Tune trial, a
    # preempted node) must not take its last epoch with it.
    tracker.flush()
    if rank == 0:
        _record_committed(tracker, epoch, checkpoint_uri(name))
    # Every rank, always: rank 0's answer is shared with a collective.
    preemption.checkpoint_committed(rank)
    return committed


def _wait_committed(name: str) -> bool:
    """Block until Ray Train's controller has committed this worker's latest report."""
    import ray.train

    started = time.monotonic()
    ray.train.get_all_reported_checkpoints(
        consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED,
        timeout_s=COMMIT_TIMEOUT_S,
    )
    waited_s = time.monotonic() - started
    if waited_s >= COMMIT_TIMEOUT_S:
        logger.warning("checkpoint %s was not committed after %.0f s; logging its metrics anyway "
                       "(after a failure now, that epoch may appear twice)", name, waited_s)
        return False
    logger.debug("checkpoint %s committed after %.2f s", name, waited_s)
    return True


def log_points(tracker: Tracker, points: list[MetricPoint]) -> None:
    """Log stored points with their own steps and timestamps (re-logging one is idempotent)."""
    grouped: dict[tuple[int, int], dict[str, float]] = {}
    for key, value, timestamp_ms, step in points:
        grouped.setdefault((int(step), int(timestamp_ms)), {})[key] = value
    for (step, timestamp_ms), values in grouped.items():
        tracker.log_metrics(values, step=step, timestamp=timestamp_ms, strict=False)


def stored_points(directory: str | Path) -> list[MetricPoint]:
    """The metric points this rank stored in a raydeck checkpoint directory (empty if none)."""
    path = Path(directory) / metrics_file(_rank())
    if not path.exists():
        return []
    return [(str(key), float(value), int(timestamp_ms), int(step))
            for key, value, timestamp_ms, step in json.loads(path.read_text())["points"]]


def _record_committed(tracker: Tracker, epoch: int, uri: str) -> None:
    """Rank 0's record of committed checkpoint ``uri`` of ``epoch`` in the run's tags."""
    tracker.set_tags({f"{CHECKPOINT_TAG_PREFIX}latest": uri,
                      f"{CHECKPOINT_TAG_PREFIX}latest_epoch": epoch,
                      f"{CHECKPOINT_TAG_PREFIX}epoch_{epoch}": uri}, strict=False)


def mark_resumed(tracker: Tracker, epoch: int, points: list[MetricPoint],
                 checkpoint: Any | None = None) -> None:
    """After restoring epoch ``epoch``: log its stored points again and tag the run. Given the
    ``ray.train.Checkpoint`` it came from (in a Ray Train worker), rank 0 records it as committed
    again (module docstring, 3).

    Values the failed attempt logged after this checkpoint stay in the run; the epochs trained
    again do not log them twice (:meth:`~raydeck.tracking.Tracker.skip_logged_steps`).
    """
    log_points(tracker, points)
    tracker.skip_logged_steps({key for key, _, _, _ in points})
    if checkpoint is not None and _rank() == 0:
        _record_committed(tracker, epoch, uri_of(checkpoint))
    tracker.set_tags({f"{CHECKPOINT_TAG_PREFIX}resumed_from_epoch": epoch}, strict=False)
    logger.info("resumed from epoch %d", epoch)


def uri_of(checkpoint: Any) -> str:
    """A ``ray.train.Checkpoint``'s URI: its path, with its filesystem's scheme unless local."""
    return _with_scheme(checkpoint.path, checkpoint.filesystem)


def checkpoint_uri(name: str) -> str:
    """Where Ray Train persisted the checkpoint directory ``name`` of the current run."""
    import ray.train

    storage = ray.train.get_context().get_storage()
    return _with_scheme(storage.build_checkpoint_path_from_name(name),
                        storage.storage_filesystem)


def _with_scheme(path: str, filesystem: Any) -> str:
    """``path`` on pyarrow ``filesystem`` as a URI (a local path stays a path)."""
    scheme = filesystem.type_name
    return path if scheme == "local" else f"{scheme}://{path}"


def restore(
    tracker: Tracker,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    checkpoint: Any | None = None,
    map_location: str | torch.device = "cpu",
) -> TrainState | None:
    """Restore the latest checkpoint (``ray.train.get_checkpoint()``) into model and optimizer.

    Call on every rank at the start of the training function. Re-logs the restored epoch's
    metrics with their original timestamps (see the module docstring), so the run's history
    has every epoch exactly once.

    Returns:
        The restored state (resume at ``epoch + 1``), or None when starting fresh.
    """
    import ray.train

    checkpoint = checkpoint or ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        state = read_state(directory, model=model, optimizer=optimizer, scheduler=scheduler,
                           map_location=map_location)
        points = stored_points(directory)
    if tracker.active and state.run_id and state.run_id != tracker.parent_run_key:
        logger.warning("checkpoint was written by run %s, resuming in run %s",
                       state.run_id, tracker.parent_run_key)
    mark_resumed(tracker, state.epoch, points, checkpoint)
    return state


def load_model_state(checkpoint_dir: str | Path, model: torch.nn.Module) -> torch.nn.Module:
    """Load the model weights of a raydeck checkpoint directory (e.g. to serve or register)."""
    read_state(checkpoint_dir, model=model, restore_rng=False)
    return model
