"""The trial side of a sweep: what runs inside each Tune trial, and what the job calls there.

Owns: the Tune function trainable (binding a trial to its MLflow child run, resuming it,
running the job single-process or as a ``TorchTrainer`` through :mod:`raydeck.tune.distributed`),
the job's API inside a single-process trial: :func:`restore` once, :func:`report` once per
iteration, and the trial's best so far, logged beside the metric as ``best_<metric>``
(:mod:`raydeck.tune.score`). Does not own: why a trial ends (the driver decides,
:mod:`raydeck.tune.monitor`) or what a checkpoint holds (:mod:`raydeck.train.checkpointing`).

Every iteration lands in the child run exactly once, also across ``--resume``:

1. A point is in the tracking proxy (spooled, durable) before Tune hears of its iteration:
   :func:`report` logs and flushes, then reports to Tune with the checkpoint.
2. A resumed sweep starts its trials only after every process of the previous attempt has
   exited (:func:`raydeck.tune.driver.sweep` waits for them), so nothing of an earlier attempt
   can still be on its way.
3. A trial that resumes asks its run which steps it holds and drops repeats of them
   (``Tracker.skip_logged_steps``): iterations re-run from an older checkpoint are reported to
   Tune again but not logged twice.

A trial's step in its child run is its own count of reported iterations, kept in its checkpoint.
Under population-based training a trial that continues from another trial's checkpoint keeps
counting where its own run stopped, so its curve has each step once; the exploit is recorded as
lineage (:mod:`raydeck.tune.lineage`) and the model's age (Tune's ``training_iteration``) goes on
from the source's.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raydeck.config.settings import Settings
from raydeck.errors import ConfigError, TrackingUnavailableError
from raydeck.tune.config import SweepConfig, SweepJob
from raydeck.tune.distributed import fit_distributed
from raydeck.tune.scheduling import LINEAGE_KEY
from raydeck.tune.score import RunningBest
from raydeck.tune.space import as_text, flatten
from raydeck.tune.status import RESUMED_TAG, SWEEP_TAG, TRIAL_ERROR_TAG, TRIAL_ID_TAG, error_line

logger = logging.getLogger(__name__)

TRIAL_FILE = "raydeck_trial.json"
CONFIG_TAG = "raydeck.trial_config"
MAX_TAG_CHARS = 5000
TRIAL_DRIVER_MEMORY_BYTES = 256 * 1024 * 1024
# How long a trial waits for its run to be bound (the proxy retries MLflow meanwhile).
BIND_TIMEOUT_S = 300.0
# Keep every checkpoint of a trial: with a limit, Tune snapshots the whole experiment each
# time a trial has checkpointed that many times (measured ~0.6 s per iteration on 2 cores).
CHECKPOINTS_KEPT_PER_TRIAL: int | None = None


class _Trial:
    """The trial this process runs right now (one at a time: Tune runs one per actor).

    Its tracker binds in the background while the job builds its model and trains its first
    iteration (a fresh single-process trial; see :func:`_run_trial`); :meth:`tracker` waits
    for it.
    """

    def __init__(self, trial_id: str, saved: dict[str, Any] | None, config: SweepConfig) -> None:
        self.trial_id = trial_id
        self.saved = saved
        own = saved is not None and saved["trial_id"] == trial_id
        # The best so far, logged as best_<metric> while it covers every iteration: from the
        # first (no checkpoint), or from the trial's own checkpoint that saved it; not after a
        # PBT exploit or in a resumed distributed trial (_bind): the summary writes it then.
        self.metric, self.best_key = config.metric, config.best_metric
        self.best = (RunningBest(config.mode, saved["best"] if saved else None)
                     if saved is None or (own and "best" in saved) else None)
        # Tune's training_iteration (the model's age) and the child run's step of the last
        # reported point; a PBT exploit takes the source's age and sets the step when bound.
        self.iteration = int(saved["iteration"]) if saved else 0
        self.step = int(saved["step"]) if own and saved else 0
        self.position_known = saved is not None
        self._tracker: Any = None
        self._error: BaseException | None = None
        self._bound = threading.Event()

    def bind(self, attach: Callable[[_Trial], Any], background: bool) -> None:
        """Run ``attach(self)`` (returns the tracker), now or in a thread."""
        def run() -> None:
            try:
                self._tracker = attach(self)
            except BaseException as exc:
                self._error = exc
            finally:
                self._bound.set()

        if background:
            threading.Thread(target=run, name=f"raydeck-bind-{self.trial_id}",
                             daemon=True).start()
        else:
            run()

    def with_best(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """``metrics`` with the trial's best so far as ``best_<metric>``, while it knows it."""
        best = self.best.update(metrics.get(self.metric)) if self.best is not None else None
        return metrics if best is None else {**metrics, self.best_key: best}

    def tracker(self) -> Any:
        """The trial's tracker, once bound.

        Raises:
            TrackingUnavailableError (or whatever binding raised): the run could not be bound.
        """
        if not self._bound.wait(BIND_TIMEOUT_S):
            raise TrackingUnavailableError(
                f"trial {self.trial_id} could not bind to its MLflow run within "
                f"{BIND_TIMEOUT_S:.0f} s; `raydeck tracking status` shows the proxy")
        if self._error is not None:
            raise self._error
        return self._tracker


_current: _Trial | None = None
# Trials of this process still leaving their runs (see _finish_in_background), by trial id.
_leaving: dict[str, threading.Thread] = {}
_leaving_lock = threading.Lock()


def _active() -> _Trial:
    if _current is None:
        raise ConfigError("raydeck.tune.report/restore called outside a raydeck sweep trial; "
                          "run the job with raydeck.tune.sweep")
    return _current


# --- the job's API ------------------------------------------------------------------------------
def report(
    metrics: dict[str, float],
    *,
    model: Any | None = None,
    optimizer: Any | None = None,
    extra: dict[str, Any] | None = None,
) -> int:
    """Report one iteration of a single-process trial; returns the iteration (1-based).

    Logs ``metrics`` to the trial's child run, with the trial's best value of the sweep's metric
    so far as ``best_<metric>``, and waits until the tracking proxy holds them; then reports
    them to Tune, with a checkpoint of ``model``/``optimizer`` when given: the trial resumes from
    it, PBT clones it, the best one is registered. Tune may stop the trial here (it raises
    ``SystemExit``; let it propagate).

    Raises:
        ConfigError: called outside a sweep trial.
    """
    from ray import tune

    from raydeck.train.checkpointing import write_state

    trial = _active()
    tracker = trial.tracker()
    trial.iteration += 1
    trial.step += 1
    tracker.log_metrics(trial.with_best(metrics), step=trial.step, strict=False)
    tracker.flush()
    reported = {**metrics, "training_iteration": trial.iteration}
    if model is None:
        tune.report(reported)
        return trial.iteration
    with tempfile.TemporaryDirectory(prefix="raydeck-trial-") as tmp:
        write_state(Path(tmp), model=model, optimizer=optimizer, scheduler=None,
                    epoch=trial.iteration, step=trial.step, run_id=tracker.run_key, extra=extra)
        (Path(tmp) / TRIAL_FILE).write_text(json.dumps(
            {"trial_id": trial.trial_id, "iteration": trial.iteration, "step": trial.step,
             **({"best": trial.best.value} if trial.best is not None else {})}))
        tune.report(reported, checkpoint=tune.Checkpoint.from_directory(tmp))
    return trial.iteration


def restore(model: Any, optimizer: Any | None = None) -> int:
    """Load the trial's checkpoint into ``model``/``optimizer`` (resume, or a PBT exploit).

    Call once, after building model and optimizer. Under PBT the optimizer's state comes from
    another trial: set hyperparameters that PBT changes (e.g. ``lr`` on
    ``optimizer.param_groups``) from the trial's config *after* this call.

    Returns:
        Iterations the model has trained (0 for a fresh trial).
    """
    from ray import tune

    from raydeck.train.checkpointing import read_state

    trial = _active()
    checkpoint = tune.get_checkpoint()
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as directory:
        state = read_state(directory, model=model, optimizer=optimizer)
    if not trial.position_known:  # a checkpoint written by other code than report()
        trial.iteration = trial.step = state.epoch
    return trial.iteration


# --- the trainable ------------------------------------------------------------------------------
def trainable(job: SweepJob, config: SweepConfig, settings: Settings) -> Any:
    """The Tune function trainable of ``job``, with its resources.

    A single-process trial takes one worker of the preset; a distributed trial's process only
    drives its ``TorchTrainer`` (0 CPU), whose workers reserve the preset's resources.
    """
    from ray import tune

    from raydeck.train.presets import get_preset

    preset = get_preset(config.preset, settings.presets_file)
    experiment = config.experiment or settings.tracking.experiment

    def run_trial(trial_config: dict[str, Any], data: Any = None) -> None:
        # Tune pickles this closure by value; the trial's state must live in this module's
        # own globals (where report() reads it), so the work is a module-level function.
        _run_trial(job, config, settings, preset, experiment, trial_config, data)

    runnable: Any = run_trial
    if job.load_data is not None:
        # Put the data in the object store once; every trial (and reused actor) reads it there.
        runnable = tune.with_parameters(run_trial, data=job.load_data())
    # A distributed trial's process only drives its TorchTrainer, whose workers reserve the
    # preset's resources; it asks for no CPU (Tune needs some resource in a request: memory).
    resources = ({"CPU": 0.0, "memory": TRIAL_DRIVER_MEMORY_BYTES} if job.distributed
                 else preset.resources_per_worker())
    return tune.with_resources(runnable, resources)


def _run_trial(job: SweepJob, config: SweepConfig, settings: Settings, preset: Any,
               experiment: str, trial_config: dict[str, Any], data: Any) -> None:
    global _current
    from ray import tune

    # Imported here, in this thread, before the binding thread starts: report() imports it and
    # the binding thread imports raydeck.tracking, and two threads importing that cycle at once
    # can see a half-initialized module (ImportError: "partially initialized module").
    import raydeck.train.checkpointing  # noqa: F401

    trial_config = dict(trial_config)
    exploit = trial_config.pop(LINEAGE_KEY, None)
    trial_id = str(tune.get_context().get_trial_id())
    _wait_until_left(trial_id)
    checkpoint = tune.get_checkpoint()
    trial = _Trial(trial_id, _saved_position(checkpoint), config)
    if trial.iteration >= config.max_t:
        # Restored at its last iteration (the previous driver died before it recorded the
        # end): nothing is left to train, and one more iteration would exceed max_t.
        return
    # Binding to the run takes the tracking proxy a few MLflow calls. A fresh single-process
    # trial does it while the job builds its model and trains its first iteration; report()
    # waits for it. A distributed trial's workers need the run first; a resumed or exploited
    # trial needs it to know which steps its run holds.
    trial.bind(
        functools.partial(_bind, config=config, settings=settings, experiment=experiment,
                          trial_config=trial_config, exploit=exploit, job=job),
        background=not job.distributed and checkpoint is None and exploit is None,
    )
    _current = trial
    try:
        if job.distributed:
            fit_distributed(job, config, trial_config, data, trial.tracker(), trial.best,
                            preset, settings)
        else:
            job.train_fn(trial_config, data)
    except SystemExit:
        # Tune stops a trial (the scheduler, max_t, a pause) by raising SystemExit from
        # tune.report; the driver records why. Tune reuses this process for the next trial only
        # if the function ends within ~2 s, so the run is left in the background.
        _finish_in_background(trial)
        raise
    except BaseException as exc:
        with contextlib.suppress(Exception):
            tracker = trial.tracker()
            tracker.set_tags({TRIAL_ERROR_TAG: error_line(exc)})
            tracker.finish("FAILED")
        raise
    finally:
        _current = None
    trial.tracker().finish()


def _finish_in_background(trial: _Trial) -> None:
    """Leave the trial's run (deliver what is buffered, detach) in a thread of this process."""
    def leave() -> None:
        try:
            trial.tracker().finish(wait=False)
        except Exception as exc:
            logger.warning("trial %s could not leave its run cleanly: %s", trial.trial_id, exc)

    thread = threading.Thread(target=leave, name=f"raydeck-leave-{trial.trial_id}", daemon=True)
    with _leaving_lock:
        _leaving[trial.trial_id] = thread
    thread.start()


def _wait_until_left(trial_id: str) -> None:
    """A trial restarted in this process (PBT) binds again only once it has left its run."""
    with _leaving_lock:
        thread = _leaving.pop(trial_id, None)
    if thread is not None:
        thread.join(BIND_TIMEOUT_S)


def _bind(trial: _Trial, *, config: SweepConfig, settings: Settings, experiment: str,
          trial_config: dict[str, Any], exploit: dict[str, Any] | None, job: SweepJob) -> Any:
    """Attach the trial to its child run: tags, params, where its steps continue, lineage."""
    from raydeck.tracking import get_tracker
    from raydeck.tune.lineage import record_exploit

    tracker = get_tracker(config.trial_key(trial.trial_id), parent_run_id=config.key,
                          experiment=experiment, run_name=f"{config.name}-{trial.trial_id}",
                          settings=settings)
    # The trial's status tag is written by the driver alone (Tune knows why a trial ended).
    tags: dict[str, Any] = {TRIAL_ID_TAG: trial.trial_id, SWEEP_TAG: config.key}
    text = json.dumps(flatten(trial_config), sort_keys=True)
    if len(text) <= MAX_TAG_CHARS:
        tags[CONFIG_TAG] = text
    held_through = 0
    if tracker.resumed:
        held = tracker.last_steps(job.reports)
        held_through = max([step for step in held.values() if step >= 0], default=0)
        # Iterations re-run from an older checkpoint are reported to Tune again but not logged
        # twice; the previous attempt's processes are gone (the driver waited), so this is all.
        tracker.skip_logged_steps((*job.reports, config.best_metric))
        tags[RESUMED_TAG] = "true"
        if job.distributed:  # its TorchTrainer goes on from epochs this process never saw
            trial.best = None
    tracker.set_tags(tags)
    if trial.saved is not None and trial.saved["trial_id"] != trial.trial_id:
        # PBT: this trial continues from another trial's checkpoint, after its own last step.
        trial.step = held_through
    if exploit is not None:
        record_exploit(tracker, exploit, trial_config, first_step=trial.step + 1)
    else:
        tracker.log_params({name: as_text(value) for name, value in flatten(trial_config).items()},
                           strict=False)
    return tracker


def _saved_position(checkpoint: Any) -> dict[str, Any] | None:
    """Trial id, iteration and step stored in a checkpoint by :func:`report` (None if none)."""
    if checkpoint is None:
        return None
    path = f"{checkpoint.path.rstrip('/')}/{TRIAL_FILE}"
    try:
        with checkpoint.filesystem.open_input_stream(path) as stream:
            data = json.loads(stream.read())
    except (FileNotFoundError, OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "trial_id" in data else None
