"""Distributed trials: each trial of a sweep a ``TorchTrainer``, its epochs passed on to Tune.

Owns: running a distributed job's trial (:func:`fit_distributed`), called by the trial's Tune
function (:mod:`raydeck.tune.trial`, which binds the trial to its run first): the TorchTrainer
in a thread, its controller handing each committed epoch to the trial, the epoch's stored points
and the trial's best so far logged before Tune hears of it, and stopping the TorchTrainer when
Tune stops the trial. Does not own: what a checkpoint holds (:mod:`raydeck.train.checkpointing`)
or the run's binding (:mod:`raydeck.tune.trial`).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from raydeck.config.settings import Settings
from raydeck.tune.config import SweepConfig, SweepJob
from raydeck.tune.score import RunningBest

logger = logging.getLogger(__name__)

# A distributed trial polls its TorchTrainer's reports this often, and after Tune stops it waits
# this long for the TorchTrainer to abort before leaving (Tune reuses the process only if the
# trial ends within ~2 s, else it replaces the process, which stops the TorchTrainer anyway).
REPORT_POLL_S = 0.5
ABORT_WAIT_S = 1.5


def fit_distributed(job: SweepJob, config: SweepConfig, trial_config: dict[str, Any], data: Any,
                    tracker: Any, best: RunningBest | None, preset: Any, settings: Settings
                    ) -> None:
    """Run the job as a TorchTrainer for the trial whose run ``tracker`` writes, and pass each
    of its epochs on to Tune; ``best`` is the trial's best so far (None: it is not known here).

    Checkpoints go where training jobs put theirs (the checkpoint bucket, with raydeck's
    credentialed filesystem), under the trial's run key, so a resumed trial's TorchTrainer
    continues from its own latest checkpoint. The TorchTrainer runs in a thread; its controller
    hands each committed epoch to this trial through a queue, and the trial logs the epoch's
    stored points (the same points, with the same timestamps, that rank 0 logs: MLflow keeps
    one copy) before Tune hears of it, so a trial Tune stops right after keeps its last epoch.
    """
    from queue import Empty

    from ray import tune
    from ray.train import CheckpointConfig, FailureConfig
    from ray.train.torch import TorchTrainer
    from ray.util.queue import Queue

    from raydeck.storage import checkpoint_storage
    from raydeck.train.checkpointing import log_points
    from raydeck.train.trainer import torch_config, within_queue, without_preemption_watcher

    reports: Any = Queue(maxsize=1, actor_options={"num_cpus": 0})
    outcome: dict[str, Any] = {}
    finished = threading.Event()
    without_preemption_watcher()  # as fit: Ray 2.60's watcher logs a false ERROR per fit
    trainer = TorchTrainer(
        job.train_fn,
        train_loop_config={**trial_config, "data": data},
        # An elastic preset's range, kept within the workers the queue allows the sweep's job
        # (as raydeck.train.trainer.fit keeps a training job's).
        scaling_config=within_queue(preset.scaling_config()),
        torch_config=torch_config(preset.scaling_config()),
        run_config=tracker.run_config(
            **checkpoint_storage(settings).run_config_kwargs(),
            failure_config=FailureConfig(max_failures=preset.max_failures),
            # Keep the best epochs by the sweep's metric (the best one is registered) and,
            # as Ray Train always does, the latest (to resume from).
            checkpoint_config=CheckpointConfig(num_to_keep=preset.checkpoints_to_keep,
                                               checkpoint_score_attribute=config.metric,
                                               checkpoint_score_order=config.mode),
            callbacks=[_forward_reports(reports)],
        ),
    )

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            finished.set()

    thread = threading.Thread(target=fit, name=f"raydeck-trial-{tracker.run_key}", daemon=True)
    thread.start()
    controller = None
    try:
        while True:
            try:
                item = reports.get(timeout=REPORT_POLL_S)
            except Empty:
                if finished.is_set() and reports.empty():
                    break
                continue
            controller = item["controller"]
            log_points(tracker, item["points"])
            _log_best(tracker, config, best, item["points"])
            tracker.flush()
            metrics = dict(item["metrics"])
            if "epoch" in metrics:
                metrics["training_iteration"] = int(metrics["epoch"]) + 1
            tune.report(metrics)
    except SystemExit:
        _abort(controller, thread)
        raise
    finally:
        _shutdown(reports)
    if "error" in outcome:
        raise outcome["error"]


def _log_best(tracker: Any, config: SweepConfig, best: RunningBest | None,
              points: list[Any]) -> None:
    """Log the trial's best so far as ``best_<metric>``, at the step and time of the epoch's last
    point of the metric (so a point delivered twice stays one point)."""
    scored = sorted((point for point in points if point[0] == config.metric),
                    key=lambda point: point[3])
    if best is None or not scored:
        return
    for _, value, _, _ in scored:
        best.update(value)
    if best.value is not None:
        _, _, timestamp_ms, step = scored[-1]
        tracker.log_metrics({config.best_metric: best.value}, step=int(step),
                            timestamp=int(timestamp_ms), strict=False)


def _forward_reports(reports: Any) -> Any:
    """A Ray Train callback (it runs in the TorchTrainer's controller) that puts each committed
    report into ``reports``: rank 0's metrics, the points stored in the checkpoint, and the
    controller's handle (so the trial can abort it)."""
    from ray.train import UserCallback

    class ForwardReports(UserCallback):
        def after_report(self, run_context: Any, metrics: list[dict[str, Any]],
                         checkpoint: Any) -> None:
            import ray

            from raydeck.train.checkpointing import uri_of

            points = _stored_points(checkpoint)
            reported = dict(metrics[0])
            if checkpoint is not None:
                reported["checkpoint_uri"] = uri_of(checkpoint)
            reports.put({
                "metrics": reported,
                "points": points,
                "controller": ray.get_runtime_context().current_actor,
            })

    return ForwardReports()


def _stored_points(checkpoint: Any) -> list[Any]:
    """Rank 0's stored metric points of a raydeck checkpoint (read alone, not downloaded)."""
    from raydeck.train.checkpointing import metrics_file

    if checkpoint is None:
        return []
    try:
        path = f"{checkpoint.path.rstrip('/')}/{metrics_file(0)}"
        with checkpoint.filesystem.open_input_stream(path) as stream:
            return list(json.loads(stream.read())["points"])
    except (FileNotFoundError, OSError, ValueError, KeyError) as exc:
        logger.debug("checkpoint %s holds no raydeck metrics: %s", checkpoint, exc)
        return []


def _abort(controller: Any, thread: threading.Thread) -> None:
    """Stop the trial's TorchTrainer (Tune stopped the trial); waits at most ABORT_WAIT_S."""
    if controller is not None:
        try:
            controller.abort.remote()
        except Exception as exc:
            logger.debug("could not abort the trial's TorchTrainer: %s", exc)
    thread.join(ABORT_WAIT_S)


def _shutdown(reports: Any) -> None:
    try:
        reports.shutdown(force=True)
    except Exception as exc:
        logger.debug("could not stop the trial's report queue: %s", exc)

