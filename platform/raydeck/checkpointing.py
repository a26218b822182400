"""Full training state as a Ray Train ``Checkpoint``, and epochs that land in MLflow exactly once.

Owns: saving and restoring model, optimizer, scheduler, epoch/step, RNG states and the tracking
run id; reporting an epoch to Ray Train and to the tracker together; recording each checkpoint's
URI in the run. Does not own: where checkpoints are stored (``RunConfig.storage_path``, see
:mod:`raydeck.training` and :mod:`raydeck.storage`) or how many are kept (``CheckpointConfig``).

Why epochs land exactly once after a worker dies: :func:`report_epoch` writes the epoch's metric
values, with their timestamps, *into* the checkpoint before reporting it, and logs them to the
tracker only after Ray Train has persisted it. On resume, :func:`restore` logs the stored values
of the restored epoch again with the same timestamps: if they had landed, MLflow keeps one copy
(identical key, step, timestamp and value), and if the worker died before they were sent, they
land now. Epochs after the checkpoint are re-run and logged as new.
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
from raydeck.tracking.client import Tracker

logger = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
CHECKPOINT_DIR_FORMAT = "epoch_{epoch:06d}"
CHECKPOINT_TAG_PREFIX = "raydeck.checkpoint."


@dataclass
class TrainState:
    """What :func:`restore` found: continue with epoch ``epoch + 1``."""

    epoch: int
    step: int
    run_id: str
    extra: dict[str, Any] = field(default_factory=dict)


def _metrics_file(rank: int) -> str:
    return f"metrics_rank_{rank}.json"


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DistributedDataParallel, so checkpoints load into a plain model."""
    return model.module if hasattr(model, "module") else model


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


def _rank() -> int:
    import ray.train

    return int(ray.train.get_context().get_world_rank())


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
) -> None:
    """Checkpoint and report one finished epoch from a Ray Train worker; call on every rank.

    Rank 0 stores the full training state; every rank stores its own metric values. The
    checkpoint directory is named ``epoch_<NNNNNN>`` so its URI is predictable, and rank 0 records
    it in the run as the tags ``raydeck.checkpoint.latest`` and ``raydeck.checkpoint.epoch_<N>``.
    The metrics are logged to ``tracker`` at ``step=epoch`` after the checkpoint is persisted.
    Prometheus gets this rank's progress (step, its time, throughput, losses) and the
    checkpoint's save time and size (:class:`~raydeck.observability.metrics.TrainingMetrics`).
    """
    import ray.train

    rank = _rank()
    progress = training_metrics(tracker.run_name, tracker.parent_run_id, rank)
    timestamp_ms = int(time.time() * 1000)
    with tempfile.TemporaryDirectory(prefix="raydeck-ckpt-") as tmp:
        save_started = time.perf_counter()
        directory = Path(tmp)
        (directory / _metrics_file(rank)).write_text(
            json.dumps({"epoch": epoch, "timestamp_ms": timestamp_ms, "metrics": metrics})
        )
        if rank == 0:
            torch.save(
                {
                    "epoch": epoch,
                    "step": step,
                    "run_id": tracker.parent_run_id,
                    "model": _unwrap(model).state_dict(),
                    "optimizer": optimizer.state_dict() if optimizer else None,
                    "scheduler": scheduler.state_dict() if scheduler else None,
                    "rng": _rng_state(),
                    "extra": extra or {},
                },
                directory / STATE_FILE,
            )
        name = CHECKPOINT_DIR_FORMAT.format(epoch=epoch)
        size_bytes = sum(entry.stat().st_size for entry in os.scandir(tmp) if entry.is_file())
        ray.train.report(
            metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp), checkpoint_dir_name=name
        )
        progress.checkpoint_saved(time.perf_counter() - save_started, size_bytes)
    progress.step_reported(epoch, metrics)
    tracker.log_metrics(metrics, step=epoch, timestamp_ms=timestamp_ms)
    if rank == 0:
        uri = checkpoint_uri(name)
        tracker.set_tags({f"{CHECKPOINT_TAG_PREFIX}latest": uri,
                          f"{CHECKPOINT_TAG_PREFIX}latest_epoch": epoch,
                          f"{CHECKPOINT_TAG_PREFIX}epoch_{epoch}": uri})


def checkpoint_uri(name: str) -> str:
    """Where Ray Train persisted the checkpoint directory ``name`` of the current run."""
    import ray.train

    storage = ray.train.get_context().get_storage()
    path = storage.build_checkpoint_path_from_name(name)
    scheme = storage.storage_filesystem.type_name
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
    rank = _rank()
    with checkpoint.as_directory() as directory:
        state = torch.load(Path(directory) / STATE_FILE, map_location=map_location,
                           weights_only=False)
        metrics_path = Path(directory) / _metrics_file(rank)
        stored = json.loads(metrics_path.read_text()) if metrics_path.exists() else None
    _unwrap(model).load_state_dict(state["model"])
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    if stored is not None:
        tracker.log_metrics(stored["metrics"], step=stored["epoch"],
                            timestamp_ms=stored["timestamp_ms"])
    if tracker.active and state["run_id"] and state["run_id"] != tracker.parent_run_id:
        logger.warning("checkpoint was written by run %s, resuming in run %s",
                       state["run_id"], tracker.parent_run_id)
    tracker.set_tags({f"{CHECKPOINT_TAG_PREFIX}resumed_from_epoch": state["epoch"]})
    logger.info("resumed from epoch %d", state["epoch"])
    return TrainState(epoch=int(state["epoch"]), step=int(state["step"]),
                      run_id=str(state["run_id"]), extra=dict(state["extra"]))


def load_model_state(checkpoint_dir: str | Path, model: torch.nn.Module) -> torch.nn.Module:
    """Load the model weights of a raydeck checkpoint directory (e.g. to serve or register)."""
    state = torch.load(Path(checkpoint_dir) / STATE_FILE, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    return model
