"""PyTorch Lightning on raydeck: a ``Logger`` that writes through the tracker, and Ray Train
checkpoints that make a Lightning run survive a worker death like a plain PyTorch one.

Owns: :class:`RaydeckLogger` (Lightning's ``Logger`` interface, delegating to a
:class:`~raydeck.tracking.Tracker`: hyperparameters, metrics, checkpoints),
:class:`RaydeckReportCallback` (the counterpart of Ray's ``RayTrainReportCallback``, reporting
raydeck checkpoints), and :func:`resume` (the Lightning checkpoint to pass to
``trainer.fit(ckpt_path=...)``). Does not own the distributed setup: that is Ray Train's
``RayDDPStrategy``, ``RayLightningEnvironment`` and ``prepare_trainer``.

Each step lands exactly once, as epochs do for plain PyTorch (:mod:`raydeck.train.checkpointing`):
inside Ray Train the logger *holds* what Lightning logs for steps after the last committed
checkpoint, and the callback logs it once Ray Train has committed the epoch's checkpoint (which
also stores it). When a worker dies, the held values of the unfinished epoch die with it and are
logged when that epoch is trained again; a rank that survives to see ``fit`` fail (its peer gone
from a collective) logs what it held instead (``finalize("failed")``: the steps before a crash
are what a person debugging it needs), and the epoch trained again drops those steps
(``Tracker.skip_logged_steps``, which :func:`resume` calls after logging the restored epoch's
stored values again, which MLflow keeps once). Without the callback (no Ray Train), the logger
writes at once.

Ranks: the logger does not use Lightning's ``rank_zero_only``; every rank calls the tracker, and
the run's tracking mode decides who writes (``rank_zero``: rank 0; ``all_ranks``: every rank
under its own keys; ``per_rank``: child runs).

Like Lightning's ``MLFlowLogger``, nothing a user logs aborts ``fit``: keys MLflow would refuse
are made legal (``recall@5`` -> ``recall5``), long hyperparameters are cut (the full values go
to the artifact ``lightning/truncated_params.json``), non-numeric metric values are dropped; each
key is warned about once, and the run counts the changed and dropped values in the tags
``raydeck.sanitized_values`` and ``raydeck.dropped_values``
(the tracker's lenient path: ``strict=False``, :mod:`raydeck.tracking.client.validation`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
from argparse import Namespace
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.logger import (
    _add_prefix,
    _convert_params,
    _flatten_dict,
    _sanitize_callable_params,
)
from pytorch_lightning.loggers.logger import Logger
from typing_extensions import override

from raydeck.tracking import Tracker, get_tracker
from raydeck.tracking.client import preemption
from raydeck.tracking.client.validation import truncated_param
from raydeck.train.checkpointing import (
    MetricPoint,
    log_points,
    mark_resumed,
    report_checkpoint,
    stored_points,
)

logger = logging.getLogger(__name__)

LIGHTNING_CHECKPOINT_FILE = "lightning.ckpt"
STATE_FILE = "raydeck_lightning.json"
CHECKPOINT_ARTIFACT_PATH = "checkpoints"
LIGHTNING_TAG_PREFIX = "raydeck.lightning."
TRUNCATED_PARAMS_ARTIFACT = "lightning/truncated_params.json"


def _number(value: Any) -> Any:
    """A plain number from a tensor (Lightning logs tensors); anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


def _logged_step(trainer: pl.Trainer) -> int:
    """The step Lightning logs the next training batch at (its loggers' step counter)."""
    loop = trainer.fit_loop.epoch_loop
    return int(getattr(loop, "_batches_that_stepped", trainer.global_step))


def _epoch_end_log(trainer: pl.Trainer) -> tuple[dict[str, Any], int]:
    """What Lightning logs for the finished training epoch right *after* the callbacks'
    ``on_train_epoch_end`` (``train_loss_epoch``..., and ``epoch``), and at which step, as its
    fit loop's ``update_train_epoch_metrics`` will: computed now, so the epoch's checkpoint
    holds them.

    Lightning has no public accessor for the pending epoch-level values (``logged_metrics``
    mixes them with everything logged before), so this reads its logger connector; on a
    Lightning without it the values are logged when Lightning logs them, as before.
    """
    step = _logged_step(trainer) - 1  # Lightning steps back one for the epoch-end values
    connector = getattr(trainer, "_logger_connector", None)
    try:
        pending = dict(connector.metrics["log"]) if connector is not None else {}
    except (AttributeError, AssertionError, KeyError, TypeError):
        return {}, step
    if "step" in pending:
        return pending, int(_number(pending.pop("step")))
    if pending:
        pending.setdefault("epoch", trainer.current_epoch)
    return pending, step


class RaydeckLogger(Logger):
    """Lightning's ``Logger`` on top of raydeck's tracker.

    Args:
        tracker: the tracker to write to; default ``raydeck.get_tracker()`` on first use (in a
            Ray Train worker: the run of the Train job).
        prefix: put before every metric key, joined with ``-`` (as Lightning's loggers do).
        log_checkpoints: also upload the best checkpoint of a ``ModelCheckpoint`` callback as an
            artifact under ``checkpoints/`` each time it changes. Its path and score are always
            recorded as tags.
        save_dir: the local root directory of this logger's files, as ``MLFlowLogger``'s
            ``save_dir`` with a file store: ``trainer.log_dir`` is this directory, and a
            ``ModelCheckpoint`` without ``dirpath`` writes to
            ``<save_dir>/<experiment id>/<run id>/checkpoints``. Default None, as
            ``MLFlowLogger`` with a tracking server: ``trainer.log_dir`` is None and checkpoints
            go to ``<trainer.default_root_dir>/<experiment id>/<run id>/checkpoints``.

    ``experiment`` is the tracker, so ``self.logger.experiment.log_text(...)`` works in a
    ``LightningModule``. ``name`` is the MLflow experiment id and ``version`` the run id.
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(self, tracker: Tracker | None = None, *, prefix: str = "",
                 log_checkpoints: bool = False, save_dir: str | Path | None = None) -> None:
        super().__init__()
        self._tracker = tracker
        self._prefix = prefix
        self._log_checkpoints = log_checkpoints
        self._save_dir = None if save_dir is None else str(save_dir)
        self._held: list[MetricPoint] | None = None
        self._committed_step = 0
        # Epoch-end values already stored in a committed checkpoint: (step, keys). Lightning
        # logs them once more, after the callbacks' ``on_train_epoch_end``; that call skips them.
        self._committed_late: tuple[int, frozenset[str]] = (-1, frozenset())
        self._uploaded_checkpoint = ""

    @property
    def tracker(self) -> Tracker:
        if self._tracker is None:
            self._tracker = get_tracker()
        return self._tracker

    @property
    def experiment(self) -> Tracker:
        return self.tracker

    @property
    @override
    def name(self) -> str:
        return self.tracker.experiment_id

    @property
    @override
    def version(self) -> str:
        return self.tracker.run_id

    @property
    @override
    def save_dir(self) -> str | None:
        return self._save_dir

    @override
    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any
                        ) -> None:
        """Log hyperparameters as MLflow params (nested dicts flattened with ``/``).

        Never raises on a key or value: keys are made legal, values longer than MLflow's limit
        are cut and logged in full in the artifact ``lightning/truncated_params.json``, a param
        already logged with another value keeps its first value; each is warned about once and
        counted.
        """
        flat = _flatten_dict(_sanitize_callable_params(_convert_params(params)))
        cut = {str(key): str(value) for key, value in flat.items()
               if truncated_param(value)[1] is not None}
        if cut:
            self.tracker.log_dict(cut, TRUNCATED_PARAMS_ARTIFACT)
        self.tracker.log_params(flat, strict=False)

    @override
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log metric values at ``step``, or hold them until their checkpoint is committed.

        Never raises on a key or value: keys are made legal, values that are not numbers are
        dropped; each is warned about once and counted.
        """
        values = self._prefixed(metrics)
        late_step, late_keys = self._committed_late
        if step is not None and step == late_step:
            values = {key: value for key, value in values.items() if key not in late_keys}
            if not values:
                return
        if self._held is not None and step is not None and step >= self._committed_step:
            timestamp_ms = int(time.time() * 1000)
            self._held.extend((key, value, timestamp_ms, int(step))
                              for key, value in values.items())
            return
        self.tracker.log_metrics(values, step=step, strict=False)

    def _prefixed(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        return {key: _number(value)
                for key, value in _add_prefix(dict(metrics), self._prefix,
                                              self.LOGGER_JOIN_CHAR).items()}

    @override
    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """Record a ``ModelCheckpoint``'s best checkpoint (path, score) in the run."""
        best = str(getattr(checkpoint_callback, "best_model_path", "") or "")
        if not best:
            return
        score = _number(getattr(checkpoint_callback, "best_model_score", None))
        tags: dict[str, Any] = {f"{LIGHTNING_TAG_PREFIX}best_model_path": best}
        if isinstance(score, (int, float)):
            tags[f"{LIGHTNING_TAG_PREFIX}best_model_score"] = score
        self.tracker.set_tags(tags)
        if self._log_checkpoints and best != self._uploaded_checkpoint and Path(best).is_file():
            self.tracker.log_artifact(best, CHECKPOINT_ARTIFACT_PATH)
            self._uploaded_checkpoint = best

    @override
    def finalize(self, status: str) -> None:
        """End of ``fit``/``validate``/``test``: log what is held, end the run if it failed.

        Lightning passes ``"success"``, ``"failed"`` (the stage raised) or ``"finished"``
        (before a SLURM requeue); like ``MLFlowLogger``, ``"failed"`` ends the run as FAILED
        (without waiting for MLflow: what was logged is in the proxy's spool and lands).
        After ``"success"`` or ``"finished"`` the values are handed to the proxy and the run
        stays open: it ends FINISHED when its tracker finishes (the ``with`` block, whoever
        created it, or process exit), so ``trainer.test()`` or logging a model after ``fit``
        still land in it.

        Raises:
            TrackingWriteError: (not after ``"failed"``) MLflow refused values logged earlier.
                An unreachable proxy only warns here: the values stay buffered and the
                tracker's ``finish`` retries.
        """
        tracker = self._tracker
        if tracker is None:  # nothing was logged, as MLFlowLogger's uninitialised experiment
            return
        self.release()
        if status == "failed":
            try:
                tracker.finish("FAILED", wait=False)
            except Exception as exc:  # the stage's own exception is what the user must see
                logger.warning("could not end run %s as FAILED: %s", tracker.run_id, exc)
            return
        tracker.flush()

    # --- holding, driven by RaydeckReportCallback -------------------------------------------
    def hold(self, committed_step: int) -> None:
        """From now on, keep values of steps >= ``committed_step`` until :meth:`take_held`."""
        if self._held is None:
            self._held = []
        self._committed_step = committed_step

    def take_held(self, late: Mapping[str, Any], late_step: int) -> list[MetricPoint]:
        """The held values (they are now the caller's to log), keeping the hold on, plus
        ``late``: the epoch-end values Lightning will log at ``late_step`` only after the
        callbacks' ``on_train_epoch_end``. They go into this commit, so a worker killed right
        after it loses none of them; the later call skips them (:meth:`log_metrics`)."""
        held, self._held = self._held or [], ([] if self._held is not None else None)
        values = self._prefixed(late)
        if self._held is not None and values:
            timestamp_ms = int(time.time() * 1000)
            held.extend((key, value, timestamp_ms, late_step) for key, value in values.items()
                        if isinstance(value, (int, float)))
            self._committed_late = (late_step, frozenset(values))
        return held

    def committed(self, step: int) -> None:
        """Values for steps below ``step`` belong to a committed checkpoint: log them at once."""
        self._committed_step = step

    def release(self) -> None:
        """Log every held value and stop holding."""
        held, self._held = self._held or [], None
        if held:
            log_points(self.tracker, held)


class RaydeckReportCallback(pl.Callback):
    """Reports a raydeck checkpoint to Ray Train at the end of every training epoch.

    The counterpart of ``ray.train.lightning.RayTrainReportCallback``: the checkpoint holds
    Lightning's full checkpoint (``lightning.ckpt``: weights, optimizers, schedulers, loop
    state) plus what :mod:`raydeck.train.checkpointing` needs, so the run's metric history stays
    exactly once across worker failures. Ray Train's ``Result.metrics`` get Lightning's
    ``callback_metrics`` plus ``epoch`` and ``step``. Use it with :class:`RaydeckLogger` (whose
    values it logs at each commit) and :func:`resume`.

    Args:
        tracker: default ``raydeck.get_tracker()`` (the Train job's run).
    """

    def __init__(self, tracker: Tracker | None = None) -> None:
        super().__init__()
        self._tracker = tracker

    @property
    def tracker(self) -> Tracker:
        if self._tracker is None:
            self._tracker = get_tracker()
        return self._tracker

    @staticmethod
    def _loggers(trainer: pl.Trainer) -> list[RaydeckLogger]:
        return [item for item in trainer.loggers if isinstance(item, RaydeckLogger)]

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After a resume the loop counters are restored by now, so the hold starts where the
        # restored checkpoint ends.
        for item in self._loggers(trainer):
            item.hold(_logged_step(trainer))

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loggers = self._loggers(trainer)
        epoch = int(trainer.current_epoch)
        with tempfile.TemporaryDirectory(prefix="raydeck-lightning-") as tmp:
            started = time.perf_counter()
            directory = Path(tmp)
            # Every rank calls it (the strategy may gather); only global rank 0 writes.
            trainer.save_checkpoint(directory / LIGHTNING_CHECKPOINT_FILE, weights_only=False)
            if trainer.global_rank == 0:
                (directory / STATE_FILE).write_text(json.dumps({
                    "epoch": epoch, "global_step": int(trainer.global_step),
                    "run_id": self.tracker.parent_run_key,
                }))
            metrics = {key: _number(value) for key, value in trainer.callback_metrics.items()}
            metrics = {key: value for key, value in metrics.items()
                       if isinstance(value, (int, float))}
            metrics.update(epoch=epoch, step=int(trainer.global_step))
            late, late_step = _epoch_end_log(trainer)
            points = [point for item in loggers for point in item.take_held(late, late_step)] \
                if loggers else self._epoch_points(metrics, epoch)
            report_checkpoint(self.tracker, directory, metrics, epoch=epoch, points=points,
                              save_started=started)
            for item in loggers:
                item.committed(_logged_step(trainer))
            # The job queue asked the job to stop (every rank got the same answer): end here,
            # where the job resumes from when the queue starts it again.
            if preemption.stop_requested():
                trainer.should_stop = True
            # No rank deletes its directory while another still uploads the checkpoint.
            trainer.strategy.barrier()

    @staticmethod
    def _epoch_points(metrics: dict[str, float], epoch: int) -> list[MetricPoint]:
        """Without a RaydeckLogger the epoch's metrics are logged at ``step=epoch`` (the
        tracker makes their keys legal for MLflow; Ray Train gets them as they are)."""
        timestamp_ms = int(time.time() * 1000)
        return [(key, value, timestamp_ms, epoch) for key, value in metrics.items()]

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for item in self._loggers(trainer):
            item.release()


@contextlib.contextmanager
def resume(tracker: Tracker | None = None) -> Iterator[str | None]:
    """The Lightning checkpoint to resume from, for ``trainer.fit(..., ckpt_path=...)``.

    Call on every rank inside the Ray Train function, around ``trainer.fit``. Yields None when
    the run starts fresh; after a failure (or when resuming a run whose driver died), yields the
    path of ``lightning.ckpt`` in the latest committed checkpoint, which stays readable until
    the block ends (from S3 it is downloaded first). Logs the restored epoch's stored values
    again and tags the run with ``raydeck.checkpoint.resumed_from_epoch``.
    """
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        yield None
        return
    if tracker is None:
        tracker = get_tracker()
    with checkpoint.as_directory() as directory:
        state = json.loads((Path(directory) / STATE_FILE).read_text())
        if tracker.active and state["run_id"] and state["run_id"] != tracker.parent_run_key:
            logger.warning("checkpoint was written by run %s, resuming in run %s",
                           state["run_id"], tracker.parent_run_key)
        mark_resumed(tracker, int(state["epoch"]), stored_points(directory), checkpoint)
        yield str(Path(directory) / LIGHTNING_CHECKPOINT_FILE)
