"""Hyperparameter sweeps: a Ray Tune ``Tuner`` with ASHA, tracked as one parent run in MLflow.

Owns: search spaces (Python dicts or YAML), sweep settings, running the Tuner (fresh or resumed),
the sweep's MLflow layout (a parent run; one child run per trial with its config, per-iteration
metrics, status ``completed``/``pruned``/``errored`` and stop iteration; the best trial on the
parent) and registering the best trial's model. Does not own: the training code (a
:class:`SweepJob` brings it) or resources (scaling presets).

Trials are Tune function trainables. A single-process trial calls :func:`report` once per
iteration; a distributed trial (``SweepJob(distributed=True)``) runs a ``TorchTrainer`` per trial
whose workers report through :func:`raydeck.checkpointing.report_epoch` and
``TuneReportCallback`` (under Ray Train v2 a TorchTrainer is no longer a Tune trainable).
Start-up cost per trial is kept low: trial actors are reused, and the job's data is put in Ray's
object store once and handed to every trial.

A trial's child run key is ``<sweep key>.<trial id>``, and Tune keeps trial ids across
``Tuner.restore``, so a resumed sweep attaches to the same child runs instead of duplicating them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raydeck.config import RUN_KEY_PATTERN, Settings, load_settings
from raydeck.errors import ConfigError
from raydeck.redaction import redact_text

logger = logging.getLogger(__name__)

DISTRIBUTIONS = ("choice", "uniform", "loguniform", "randint", "grid")
SCHEDULERS = ("asha", "fifo")
TRIAL_STATUS_TAG = "raydeck.trial_status"
STOP_ITERATION_TAG = "raydeck.stop_iteration"
RESUMED_TAG = "raydeck.trial_resumed"
# Keep every checkpoint of a trial: with a limit, Tune snapshots the whole experiment each
# time a trial has checkpointed that many times, which measured ~0.6 s per iteration here
# (a 2 x 8 sweep: 37 s with a limit of 1, 20 s without).
CHECKPOINTS_KEPT_PER_TRIAL: int | None = None


@dataclass(frozen=True)
class Dimension:
    """One searched hyperparameter: a Tune distribution and its arguments, validated."""

    name: str
    kind: str
    values: tuple[Any, ...]

    def __post_init__(self) -> None:
        where = f"search space {self.name!r}"
        if self.kind not in DISTRIBUTIONS:
            raise ConfigError(
                f"{where}: unknown distribution {self.kind!r}; use one of "
                f"{', '.join(DISTRIBUTIONS)}"
            )
        if self.kind in ("choice", "grid"):
            if not self.values:
                raise ConfigError(f"{where}: {self.kind} needs at least one value, got []")
            return
        if len(self.values) != 2:
            raise ConfigError(f"{where}: {self.kind} needs [low, high], got {list(self.values)}")
        low, high = self.values
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)):
            raise ConfigError(f"{where}: {self.kind} bounds must be numbers, got {[low, high]}")
        if not low < high:
            raise ConfigError(f"{where}: {self.kind} needs low < high, got {[low, high]}")
        if self.kind == "loguniform" and low <= 0:
            raise ConfigError(f"{where}: loguniform needs low > 0, got {low}")
        if self.kind == "randint" and not (float(low).is_integer() and float(high).is_integer()):
            raise ConfigError(f"{where}: randint bounds must be integers, got {[low, high]}")

    def to_tune(self) -> Any:
        from ray import tune

        if self.kind == "choice":
            return tune.choice(list(self.values))
        if self.kind == "grid":
            return tune.grid_search(list(self.values))
        low, high = self.values
        if self.kind == "uniform":
            return tune.uniform(low, high)
        if self.kind == "loguniform":
            return tune.loguniform(low, high)
        return tune.randint(int(low), int(high))

    def describe(self) -> str:
        return f"{self.kind}({', '.join(map(str, self.values))})"


@dataclass(frozen=True)
class SearchSpace:
    """Hyperparameters to search (``dimensions``) and fixed values passed to every trial."""

    dimensions: tuple[Dimension, ...]
    constants: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> SearchSpace:
        """Parse ``{"lr": {"loguniform": [1e-4, 1e-1]}, "hidden": {"choice": [64, 128]}, ...}``.

        A value that is not a one-key mapping naming a distribution is a constant.

        Raises:
            ConfigError: unknown distribution, empty choice list, bad bounds (named).
        """
        dimensions, constants = [], {}
        for name, value in spec.items():
            if isinstance(value, Mapping):
                if len(value) != 1:
                    raise ConfigError(
                        f"search space {name!r}: expected one distribution, e.g. "
                        f"{{choice: [...]}}, got keys {sorted(value)}"
                    )
                (kind, args), = value.items()
                values = tuple(args) if isinstance(args, (list, tuple)) else (args,)
                dimensions.append(Dimension(str(name), str(kind), values))
            else:
                constants[str(name)] = value
        if not dimensions:
            raise ConfigError("search space: nothing to search (no distribution given)")
        return cls(tuple(dimensions), constants)

    @classmethod
    def from_yaml(cls, path: str | Path) -> SearchSpace:
        import yaml

        try:
            spec = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"search space file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"search space file {path}: not valid YAML ({exc})") from None
        if not isinstance(spec, Mapping):
            raise ConfigError(f"search space file {path}: expected a mapping of name -> spec")
        return cls.from_dict(spec)

    def to_tune(self) -> dict[str, Any]:
        return {**self.constants, **{d.name: d.to_tune() for d in self.dimensions}}

    def describe(self) -> dict[str, str]:
        return {d.name: d.describe() for d in self.dimensions}


@dataclass(frozen=True)
class SweepConfig:
    """How to run a sweep. Every field is validated at construction.

    Attributes:
        name: the sweep's name: its MLflow parent run and its Tune experiment directory.
        metric, mode: what to optimise (``max`` or ``min``); the job must report ``metric``.
        num_samples: trials drawn from the space (times each grid combination).
        max_t: iterations a trial may run; ``grace_period``: iterations before ASHA may stop
            it; ``reduction_factor``: ASHA keeps 1/reduction_factor of trials at each rung.
        scheduler: ``asha`` (early stopping) or ``fifo`` (every trial runs to ``max_t``).
        preset: scaling preset for each trial's resources (fractional GPUs allowed).
        max_concurrent_trials: cap on parallel trials (default: as many as resources allow).
        seed: seed of the search, so a sweep can be repeated.
        register_model_as: model registry name for the best trial's model (None: skip).
        experiment: MLflow experiment (default ``RAYDECK_TRACKING_EXPERIMENT``).
    """

    name: str
    metric: str = "val_accuracy"
    mode: str = "max"
    num_samples: int = 8
    max_t: int = 8
    grace_period: int = 1
    reduction_factor: float = 2.0
    scheduler: str = "asha"
    preset: str = "cpu-1"
    max_concurrent_trials: int | None = None
    seed: int | None = 0
    register_model_as: str | None = None
    experiment: str | None = None

    def __post_init__(self) -> None:
        if not RUN_KEY_PATTERN.match(self.name):
            raise ConfigError(f"sweep name={self.name!r}: may hold 1-128 letters, digits, _ . -")
        if self.mode not in ("max", "min"):
            raise ConfigError(f"mode={self.mode!r}: must be 'max' or 'min'")
        if self.scheduler not in SCHEDULERS:
            raise ConfigError(f"scheduler={self.scheduler!r}: must be one of {SCHEDULERS}")
        for name in ("num_samples", "max_t", "grace_period"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}: must be an integer >= 1")
        if self.grace_period > self.max_t:
            raise ConfigError(
                f"grace_period={self.grace_period} > max_t={self.max_t}: ASHA could never stop "
                "a trial; lower grace_period or raise max_t"
            )
        if not self.reduction_factor > 1:
            raise ConfigError(f"reduction_factor={self.reduction_factor}: must be > 1")
        if self.max_concurrent_trials is not None and self.max_concurrent_trials < 1:
            raise ConfigError(f"max_concurrent_trials={self.max_concurrent_trials}: must be >= 1")

    @property
    def key(self) -> str:
        """The parent run's key (deterministic, so ``--resume`` finds it)."""
        return f"sweep-{self.name}"

    def trial_key(self, trial_id: str) -> str:
        return f"{self.key}.{trial_id}"


@dataclass(frozen=True)
class SweepJob:
    """What a sweep trains.

    Attributes:
        train_fn: ``train_fn(config, data)``. Single-process: runs in the trial and calls
            :func:`report` once per iteration. Distributed: a Ray Train per-worker loop that
            reports with :func:`raydeck.checkpointing.report_epoch` (``config["data"]``
            carries the data).
        reports: metric names the job reports, checked against ``SweepConfig.metric`` before
            any trial starts.
        load_data: builds the data once on the driver; it goes to Ray's object store once.
        model_factory: ``model_factory(config)`` rebuilds the model to register the best one.
        distributed: run each trial as a ``TorchTrainer`` with the preset's workers.
    """

    train_fn: Callable[..., None]
    reports: tuple[str, ...]
    load_data: Callable[[], Any] | None = None
    model_factory: Callable[[dict[str, Any]], Any] | None = None
    distributed: bool = False


@dataclass(frozen=True)
class TrialSummary:
    trial_id: str
    run_id: str
    status: str
    stop_iteration: int
    best_score: float | None
    config: dict[str, Any]
    time_total_s: float = 0.0


@dataclass(frozen=True)
class SweepResult:
    """What a finished sweep tells its caller."""

    parent_run_id: str
    best_trial_id: str
    best_run_id: str
    best_config: dict[str, Any]
    best_score: float
    trials: tuple[TrialSummary, ...]
    registered_model_uri: str | None
    wall_time_s: float

    @property
    def trial_iterations(self) -> int:
        return sum(t.stop_iteration for t in self.trials)


# --- trial side -------------------------------------------------------------------------------
def report(
    metrics: dict[str, float],
    *,
    model: Any | None = None,
    optimizer: Any | None = None,
    extra: dict[str, Any] | None = None,
) -> int:
    """Report one iteration of a single-process trial; returns the iteration number (1-based).

    Logs ``metrics`` to the trial's child run at ``step=iteration``, hands them to the proxy
    (so a trial stopped by ASHA right after keeps them), and reports them to Tune with a
    checkpoint of ``model``/``optimizer`` when given (the best one is registered at the end).
    """
    from ray import tune

    from raydeck.checkpointing import write_state
    from raydeck.tracking import get_tracker

    tracker = get_tracker()
    iteration = _trial_iterations.get(tracker.run_key, 0) + 1
    _trial_iterations[tracker.run_key] = iteration
    tracker.log_metrics(metrics, step=iteration, strict=False)
    tracker.flush()
    if model is None:
        tune.report(metrics)
        return iteration
    with tempfile.TemporaryDirectory(prefix="raydeck-trial-") as tmp:
        write_state(Path(tmp), model=model, optimizer=optimizer, scheduler=None,
                    epoch=iteration, step=iteration, run_id=tracker.run_key, extra=extra)
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(tmp))
    return iteration


def restore(model: Any, optimizer: Any | None = None) -> int:
    """Restore a resumed single-process trial from its latest checkpoint.

    Returns:
        The number of iterations already done (0 for a fresh trial).
    """
    from ray import tune

    from raydeck.checkpointing import read_state
    from raydeck.tracking import get_tracker

    checkpoint = tune.get_checkpoint()
    done = 0
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            done = read_state(directory, model=model, optimizer=optimizer).epoch
    _trial_iterations[get_tracker().run_key] = done
    return done


# Per child run key in this trial process: iterations reported.
_trial_iterations: dict[str, int] = {}


def _make_trainable(job: SweepJob, config: SweepConfig, settings: Settings) -> Callable[..., None]:
    """The Tune function trainable: binds each trial to its child run, then runs the job."""
    from ray import tune

    from raydeck.scaling import get_preset

    preset = get_preset(config.preset, settings.presets_file)
    experiment = config.experiment or settings.tracking.experiment

    def trial(trial_config: dict[str, Any], data: Any = None) -> None:
        from raydeck.tracking import get_tracker

        context = tune.get_context()
        trial_id = str(context.get_trial_id())
        tracker = get_tracker(
            config.trial_key(trial_id), parent_run_id=config.key, experiment=experiment,
            run_name=f"{config.name}-{trial_id}", settings=settings,
        )
        # The trial's status tag is written by the driver alone (Tune knows why a trial
        # ended); two writers of one MLflow tag race.
        tracker.set_tags({"raydeck.trial_id": trial_id, "raydeck.sweep": config.key})
        if tracker.resumed:
            # A trial restarted from an older checkpoint re-runs iterations that had landed:
            # they are reported to Tune again but not logged twice.
            tracker.skip_logged_steps(job.reports)
            tracker.set_tags({RESUMED_TAG: "true"})
        tracker.log_params(trial_config, strict=False)
        try:
            if job.distributed:
                _fit_distributed(job, trial_config, data, tracker, preset, settings)
            else:
                job.train_fn(trial_config, data)
        except SystemExit:
            # Tune stops a trial (ASHA pruned it, or it reached max_t) by raising SystemExit
            # from tune.report; the sweep's callback records which it was. Leave fast: Tune
            # reuses this process for the next trial only if the function ends within seconds.
            tracker.finish(wait=False)
            raise
        except BaseException:
            tracker.finish("FAILED")
            raise
        tracker.finish()

    trainable: Any = trial
    if job.load_data is not None:
        # Put the data in the object store once; every trial (and reused actor) reads it there.
        trainable = tune.with_parameters(trial, data=job.load_data())
    if job.distributed:
        # The trial only drives its TorchTrainer; the workers reserve the preset's resources.
        resources: dict[str, float] = {"CPU": 0.0}
    else:
        resources = preset.resources_per_worker()
    return tune.with_resources(trainable, resources)


def _fit_distributed(job: SweepJob, trial_config: dict[str, Any], data: Any, tracker: Any,
                     preset: Any, settings: Settings) -> None:
    from ray.train import CheckpointConfig
    from ray.train.torch import TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    from raydeck.training import checkpoint_storage_path

    TorchTrainer(
        job.train_fn,
        train_loop_config={**trial_config, "data": data},
        scaling_config=preset.scaling_config(),
        run_config=tracker.run_config(
            storage_path=checkpoint_storage_path(settings),
            checkpoint_config=CheckpointConfig(num_to_keep=CHECKPOINTS_KEPT_PER_TRIAL),
            callbacks=[TuneReportCallback()],
        ),
    ).fit()


# --- driver side ------------------------------------------------------------------------------
class _SweepTracking:
    """A Tune callback (built lazily, see :func:`_tune_callback`) marking each child run's end.

    Tune, not the trial, knows why a trial ended: ASHA stops it between iterations, so the
    trial's own code never sees "pruned". The callback records the status and stop iteration and
    ends the child run through the router, which also releases the trial's participation.
    """

    def __init__(self, config: SweepConfig, namespace: str) -> None:
        self.config = config
        self.namespace = namespace
        self.ended: dict[str, str] = {}
        self.best: float | None = None

    def publish(self, trials: list[Any], result: Mapping[str, Any] | None = None) -> None:
        """Export the sweep's trial states and best score to Prometheus."""
        from raydeck.observability.metrics import SweepMetrics

        metrics = SweepMetrics(self.config.name, self.config.metric, self.config.mode)
        score = (result or {}).get(self.config.metric)
        if isinstance(score, (int, float)) and not math.isnan(score):
            better = max if self.config.mode == "max" else min
            self.best = score if self.best is None else better(self.best, score)
        if self.best is not None:
            metrics.best_score(self.best)
        counts = {state: 0 for state in ("pending", "running", "pruned", "completed", "errored")}
        for trial in trials:
            state = self.ended.get(trial.trial_id) or {
                "PENDING": "pending", "RUNNING": "running", "PAUSED": "pending",
                "ERROR": "errored",
            }.get(trial.status, "running")
            counts[state] += 1
        metrics.trial_states(counts)

    def end_trial(self, trial_id: str, iteration: int, errored: bool, wait: bool) -> str:
        """Record why a trial ended and end its child run; returns the status.

        Never raises: a failure here must not fail the trial in Tune. Tune's callbacks do not
        wait (they run in Tune's control loop, which would stall every trial); the sweep's
        summary calls this again for every trial and waits, so the final record is certain.
        """
        import ray

        from raydeck.tracking.proxy import find_router

        if errored:
            status, run_status = "errored", "FAILED"
        elif iteration >= self.config.max_t:
            status, run_status = "completed", "FINISHED"
        else:
            status, run_status = "pruned", "FINISHED"
        self.ended[trial_id] = status
        try:
            router = find_router(self.namespace)
            if router is None:
                raise RuntimeError("tracking proxy not running")
            ref = router.end_run.remote(
                self.config.trial_key(trial_id), run_status,
                {TRIAL_STATUS_TAG: status, STOP_ITERATION_TAG: str(iteration)},
            )
            if wait:
                ray.get(ref, timeout=60)
        except Exception as exc:
            logger.warning("could not mark trial %s %s yet: %s", trial_id, status,
                           redact_text(str(exc)))
        return status


def _tune_callback(tracking: _SweepTracking) -> Any:
    from ray.tune import Callback

    class SweepTrackingCallback(Callback):
        def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            tracking.publish(trials)

        def on_trial_result(self, iteration: int, trials: list, trial: Any,
                            result: dict[str, Any], **info: Any) -> None:
            tracking.publish(trials, result)

        def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any
                              ) -> None:
            tracking.end_trial(trial.trial_id, _iterations(trial.last_result), errored=False,
                               wait=False)
            tracking.publish(trials)

        def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            tracking.end_trial(trial.trial_id, _iterations(trial.last_result), errored=True,
                               wait=False)
            tracking.publish(trials)

    return SweepTrackingCallback()


def _iterations(result: Mapping[str, Any] | None) -> int:
    return int((result or {}).get("training_iteration", 0) or 0)


def _scheduler(config: SweepConfig) -> Any:
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if config.scheduler == "fifo":
        return FIFOScheduler()
    return ASHAScheduler(max_t=config.max_t, grace_period=config.grace_period,
                         reduction_factor=config.reduction_factor)


def sweep_storage_path(settings: Settings) -> str:
    """Where Tune keeps sweep state (for ``--resume``) and trial checkpoints."""
    return str(settings.data_dir / "sweeps")


def sweep(
    job: SweepJob,
    space: SearchSpace | Mapping[str, Any],
    config: SweepConfig,
    *,
    settings: Settings | None = None,
    resume: bool = False,
) -> SweepResult:
    """Run (or resume) a sweep: every trial tracked as a child run, the best model registered.

    Everything that can be checked before a trial starts is: the space, the settings, that the
    job reports ``config.metric``, that the preset exists and the cluster can ever run a trial.

    Raises:
        ConfigError: a bad space or setting, a metric the job never reports, a sweep name that
            exists already (pass ``resume=True``) or a missing one to resume.
        InfeasibleResourcesError: the cluster can never run one trial of the preset.
    """
    from ray import tune

    from raydeck.cluster import connect
    from raydeck.scaling import check_feasible, get_preset
    from raydeck.tracking import get_tracker

    started = time.perf_counter()
    settings = settings or load_settings()
    space = space if isinstance(space, SearchSpace) else SearchSpace.from_dict(space)
    if config.metric not in job.reports:
        raise ConfigError(
            f"metric={config.metric!r} is never reported by this job; it reports "
            f"{', '.join(job.reports)}"
        )
    preset = get_preset(config.preset, settings.presets_file)
    trial_preset = preset if job.distributed else preset.with_workers(1)
    experiment_dir = Path(sweep_storage_path(settings)) / config.name
    if resume and not (experiment_dir / "tuner.pkl").exists():
        raise ConfigError(f"no sweep {config.name!r} to resume under {experiment_dir.parent}")
    if not resume and experiment_dir.exists():
        raise ConfigError(
            f"sweep {config.name!r} exists under {experiment_dir.parent}; pass --resume to "
            "continue it or choose another --name"
        )
    connect(settings)
    check_feasible(trial_preset)

    parent = get_tracker(config.key, run_name=config.name, settings=settings,
                         experiment=config.experiment or settings.tracking.experiment)
    parent.log_params({
        **{f"space.{name}": text for name, text in space.describe().items()},
        **{f"fixed.{name}": value for name, value in space.constants.items()},
        "metric": config.metric, "mode": config.mode, "scheduler": config.scheduler,
        "num_samples": config.num_samples, "max_t": config.max_t,
        "grace_period": config.grace_period, "reduction_factor": config.reduction_factor,
        "preset": config.preset, "seed": config.seed,
    })
    parent.set_tags({"raydeck.sweep": config.key, "raydeck.kind": "sweep"})
    trainable = _make_trainable(job, config, settings)
    callback = _tune_callback(_SweepTracking(config, settings.ray_namespace))
    if resume:
        tuner = tune.Tuner.restore(str(experiment_dir), trainable=trainable,
                                   resume_unfinished=True, restart_errored=False,
                                   param_space=_seeded(space, config))
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=_seeded(space, config),
            tune_config=tune.TuneConfig(
                metric=config.metric, mode=config.mode, scheduler=_scheduler(config),
                num_samples=config.num_samples,
                max_concurrent_trials=config.max_concurrent_trials, reuse_actors=True,
            ),
            run_config=tune.RunConfig(
                name=config.name, storage_path=sweep_storage_path(settings),
                stop={"training_iteration": config.max_t}, callbacks=[callback],
                checkpoint_config=tune.CheckpointConfig(
                    num_to_keep=CHECKPOINTS_KEPT_PER_TRIAL,
                    checkpoint_score_attribute=config.metric,
                    checkpoint_score_order=config.mode,
                ),
                verbose=0,
            ),
        )
    with parent:
        grid = tuner.fit()
        result = _summarize(grid, config, parent, job, settings)
    return dataclasses.replace(result, wall_time_s=time.perf_counter() - started)


def _seeded(space: SearchSpace, config: SweepConfig) -> dict[str, Any]:
    """The Tune param space; with a seed, the random draws repeat from sweep to sweep."""
    if config.seed is not None:
        import random

        import numpy as np

        random.seed(config.seed)
        np.random.seed(config.seed)
    return space.to_tune()


def _summarize(grid: Any, config: SweepConfig, parent: Any, job: SweepJob,
               settings: Settings) -> SweepResult:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(settings.tracking.uri)
    tracking = _SweepTracking(config, settings.ray_namespace)
    better = max if config.mode == "max" else min
    trials = []
    for result in grid:
        trial_id = str(result.metrics["trial_id"])
        stop_iteration = _iterations(result.metrics)
        status = tracking.end_trial(trial_id, stop_iteration, errored=result.error is not None,
                                    wait=True)
        history = result.metrics_dataframe
        scores = (history[config.metric].dropna().tolist()
                  if history is not None and config.metric in history else [])
        run = client.search_runs(
            [parent.experiment_id],
            filter_string=f"tags.`raydeck.run_key` = '{config.trial_key(trial_id)}'",
            max_results=1,
        )
        trials.append(TrialSummary(
            trial_id=trial_id, run_id=run[0].info.run_id if run else "",
            status=status, stop_iteration=stop_iteration,
            best_score=better(scores) if scores else None,
            config={k: v for k, v in result.config.items() if k != "data"},
            time_total_s=float(result.metrics.get("time_total_s", 0.0) or 0.0),
        ))
    scored = [(t.best_score, t) for t in trials
              if t.best_score is not None and not math.isnan(t.best_score)]
    if not scored:
        raise ConfigError(
            f"no trial reported {config.metric!r}; check the job's reports "
            f"(statuses: {sorted({t.status for t in trials})})"
        )
    best_score, best = better(scored, key=lambda pair: pair[0])
    parent.set_tags({"raydeck.best_trial_id": best.trial_id, "raydeck.best_run_id": best.run_id,
                     **{f"best.{k}": v for k, v in best.config.items()},
                     **{f"raydeck.trials_{s}": sum(t.status == s for t in trials)
                        for s in ("completed", "pruned", "errored")}})
    parent.log_metrics({f"best_{config.metric}": best_score}, step=0)
    parent.log_dict({"trial_id": best.trial_id, "run_id": best.run_id, "config": best.config,
                     config.metric: best_score}, "sweep/best_trial.json")
    uri = None
    if config.register_model_as and job.model_factory is not None:
        from raydeck.storage import credentials_in_env

        with credentials_in_env(settings.storage):
            uri = _register_best(grid, best, config, job, client, parent)
    return SweepResult(
        parent_run_id=parent.run_id, best_trial_id=best.trial_id, best_run_id=best.run_id,
        best_config=best.config, best_score=best_score, trials=tuple(trials),
        registered_model_uri=uri, wall_time_s=0.0,
    )


def _register_best(grid: Any, best: TrialSummary, config: SweepConfig, job: SweepJob,
                   client: Any, parent: Any) -> str:
    """Log the best trial's best checkpoint as an MLflow model in its run, and register it."""
    import mlflow

    from raydeck.checkpointing import load_model_state
    from raydeck.models import MODEL_ARTIFACT_PATH, save_torch_model

    assert job.model_factory is not None and config.register_model_as is not None
    result = next(r for r in grid if str(r.metrics["trial_id"]) == best.trial_id)
    checkpoint = result.get_best_checkpoint(config.metric, config.mode)
    path = result.metrics.get("checkpoint_path") if checkpoint is None else None
    model = job.model_factory(best.config)
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            load_model_state(directory, model)
    elif path:
        load_model_state(path, model)
    else:
        raise ConfigError(f"best trial {best.trial_id} saved no checkpoint to register")
    with tempfile.TemporaryDirectory() as tmp:
        saved = save_torch_model(model.cpu(), Path(tmp))
        client.log_artifacts(best.run_id, str(saved), MODEL_ARTIFACT_PATH)
    mlflow.set_tracking_uri(client.tracking_uri)
    version = mlflow.register_model(
        f"runs:/{best.run_id}/{MODEL_ARTIFACT_PATH}", config.register_model_as,
        tags={"raydeck.sweep": config.key, "raydeck.sweep_run_id": parent.run_id,
              "raydeck.trial_id": best.trial_id, "raydeck.trial_run_id": best.run_id,
              f"raydeck.{config.metric}": json.dumps(best.best_score)},
    )
    uri = f"models:/{config.register_model_as}/{version.version}"
    parent.set_tags({"raydeck.registered_model": uri})
    return uri
