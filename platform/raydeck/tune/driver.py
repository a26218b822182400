"""Running a sweep: checks, the Tuner (fresh or resumed), stop signals, summary and registry.

Owns: :func:`sweep`, the sweep's parent run, starting or resuming Tune's experiment in the
sweep's storage, waiting on resume until the previous attempt's processes are gone, handling
SIGTERM/SIGINT (running trials are marked ``preempted`` and ``--resume`` continues them), and
turning a failed summary or registry step into one error that says what to re-run. Does not
own: the trial side (:mod:`raydeck.tune.trial`), statuses (:mod:`raydeck.tune.status`,
:mod:`raydeck.tune.monitor`) or the summary's content (:mod:`raydeck.tune.summary`).
"""

from __future__ import annotations

import _thread
import contextlib
import dataclasses
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from raydeck.config.settings import Settings, load_settings
from raydeck.errors import ConfigError, SweepFinalizeError, SweepInterruptedError
from raydeck.models import RUN_TAG
from raydeck.tune.config import SweepConfig, SweepJob
from raydeck.tune.experiment import SweepStorage, sweep_storage
from raydeck.tune.monitor import SweepMonitor, monitoring, tune_callback
from raydeck.tune.registry import REGISTERED_MODEL_TAG, register_best
from raydeck.tune.scheduling import (
    PrivateRandom,
    make_scheduler,
    pbt_mutations,
    search_algorithm,
)
from raydeck.tune.space import SearchSpace, as_text, flatten
from raydeck.tune.status import PREEMPTED, SWEEP_TAG, error_line
from raydeck.tune.summary import (
    SWEEP_STATE_TAG,
    SweepResult,
    child_runs,
    record_outcomes,
    summarize,
)
from raydeck.tune.trial import CHECKPOINTS_KEPT_PER_TRIAL, trainable

logger = logging.getLogger(__name__)

DRIVER_JOB_TAG = "raydeck.sweep_driver_job"
STORAGE_TAG = "raydeck.sweep_storage"
# `ray job stop` sends SIGTERM and SIGKILLs the driver RAY_JOB_STOP_WAIT_TIME_S (default 3 s)
# later: marking the running trials preempted must fit well inside that.
PREEMPT_MARK_S = 1.5
# On resume, how long to wait for the previous attempt's trial processes to exit (Ray kills
# them once their driver is gone; under load that takes seconds).
PREVIOUS_ATTEMPT_EXIT_S = 120.0
PREVIOUS_ATTEMPT_POLL_S = 0.2


def sweep(
    job: SweepJob,
    space: SearchSpace | Mapping[str, Any] | None,
    config: SweepConfig,
    *,
    settings: Settings | None = None,
    resume: bool = False,
) -> SweepResult:
    """Run (or resume) a sweep: every trial tracked as a child run, the best model registered.

    Everything that can be checked before a trial starts is: the space, the settings, that the
    job reports ``config.metric``, the preset, object storage and that the cluster can ever run
    a trial. ``resume=True`` continues the sweep ``config.name`` as it was started (its stored
    settings win over ``config``'s; ``space`` may be None): finished trials are kept, running
    and pending ones continue from their last checkpoints; a sweep whose trials all ended is
    summarized (and registered) again without re-running any.

    Raises:
        ConfigError: a bad space or setting, a metric the job never reports, a sweep name that
            exists already (pass ``resume=True``) or a missing one to resume.
        InfeasibleResourcesError: the cluster can never run one trial of the preset.
        StorageError: object storage is configured but unusable.
        SweepInterruptedError: the driver got SIGTERM or SIGINT; running trials were marked
            ``preempted`` and ``resume=True`` continues them.
        SweepFinalizeError: every trial ended but the summary or registry step failed; the
            trials' runs and checkpoints are intact and ``resume=True`` redoes the step.
    """
    started = time.perf_counter()
    # Ray Tune's control loop draws from Python's global generator (it shuffles its futures
    # every step), and some libraries draw from it when first imported: the sweep runs on a
    # private state, so the caller's is left as it was.
    with PrivateRandom(config.seed).active():
        result = _sweep(job, space, config, settings or load_settings(), resume)
    return dataclasses.replace(result, wall_time_s=time.perf_counter() - started)


def _sweep(job: SweepJob, space: SearchSpace | Mapping[str, Any] | None, config: SweepConfig,
           settings: Settings, resume: bool) -> SweepResult:
    from raydeck.cluster.connection import connect
    from raydeck.storage import verify
    from raydeck.tracking import get_tracker
    from raydeck.train.feasibility import check_feasible
    from raydeck.train.presets import get_preset

    storage = sweep_storage(settings)
    if resume:
        config = _stored_config(storage, config)
    parsed = _parse_space(space, resume)
    _check(job, config, parsed)
    preset = get_preset(config.preset, settings.presets_file)
    trial_preset = preset if job.distributed else preset.with_workers(1)
    connect(settings)
    if settings.storage.configured:
        verify(settings.storage)
    if not resume and storage.exists(config.name):
        raise ConfigError(
            f"sweep {config.name!r} exists under {storage.uri}; pass --resume to continue it "
            "or choose another --name"
        )
    check_feasible(trial_preset)

    parent = get_tracker(config.key, run_name=config.name, settings=settings,
                         experiment=config.experiment or settings.tracking.experiment)
    recorded = _parent_tags(parent, settings) if resume else {}
    if parsed is not None and not parent.resumed:
        parent.log_params(_parent_params(parsed, config))
    job_id = _job_id()
    parent.set_tags({SWEEP_TAG: config.key, "raydeck.kind": "sweep", SWEEP_STATE_TAG: "running",
                     DRIVER_JOB_TAG: job_id, STORAGE_TAG: storage.experiment_uri(config.name)})
    if recorded.get(DRIVER_JOB_TAG) not in (None, job_id):  # this process's own tuning ended
        _wait_for_previous_attempt(recorded[DRIVER_JOB_TAG])

    monitor = SweepMonitor(config, settings.ray_namespace)
    with parent, monitoring(monitor):
        run_trial = trainable(job, config, settings)
        if resume:
            tuner = _restored_tuner(storage, config, run_trial)
        else:
            assert parsed is not None
            tuner = _new_tuner(storage, config, parsed, run_trial, job, trial_preset)
            storage.save_config(config)
        stop = _StopRequest(monitor, parent, config)
        with _stop_signals(stop):
            monitor.loop_started()
            try:
                grid = tuner.fit()
            except KeyboardInterrupt:
                if stop.signal_name is None:
                    raise
            finally:
                monitor.loop_ended()
        if stop.signal_name is not None:
            _interrupted(stop, monitor, parent, config, settings)
        return _finalize(grid, config, monitor, parent, job, settings,
                         recorded.get(REGISTERED_MODEL_TAG))


# --- checks -------------------------------------------------------------------------------------
def _stored_config(storage: SweepStorage, given: SweepConfig) -> SweepConfig:
    if not storage.exists(given.name):
        raise ConfigError(f"no sweep {given.name!r} to resume under {storage.uri}")
    stored = storage.load_config(given.name)
    if stored is None:
        return given
    default = SweepConfig(name=given.name)
    differing = [f.name for f in dataclasses.fields(SweepConfig)
                 if getattr(given, f.name) != getattr(default, f.name)
                 and getattr(given, f.name) != getattr(stored, f.name)]
    if differing:
        logger.warning("resuming sweep %s with the settings it was started with; ignoring %s",
                       given.name, ", ".join(differing))
    return stored


def _parse_space(space: SearchSpace | Mapping[str, Any] | None, resume: bool
                 ) -> SearchSpace | None:
    if space is None:
        if not resume:
            raise ConfigError("a sweep needs a search space (a dict, YAML file or SearchSpace)")
        return None
    return space if isinstance(space, SearchSpace) else SearchSpace.from_dict(space)


def _check(job: SweepJob, config: SweepConfig, space: SearchSpace | None) -> None:
    if config.metric not in job.reports:
        raise ConfigError(
            f"metric={config.metric!r} is never reported by this job; it reports "
            f"{', '.join(job.reports)}"
        )
    if config.scheduler == "pbt":
        if job.distributed:
            raise ConfigError(
                "scheduler='pbt' runs single-process trials: an exploit restarts a trial from "
                "another trial's Tune checkpoint; use asha or fifo for distributed trials")
        if space is not None:
            pbt_mutations(config, space)  # validates the names


def _parent_params(space: SearchSpace, config: SweepConfig) -> dict[str, Any]:
    return {
        **{f"space.{name}": text for name, text in space.describe().items()},
        **{f"fixed.{name}": as_text(value) for name, value in flatten(space.constants).items()},
        "metric": config.metric, "mode": config.mode, "scheduler": config.scheduler,
        "num_samples": config.num_samples, "max_t": config.max_t,
        "grace_period": config.grace_period, "reduction_factor": config.reduction_factor,
        "preset": config.preset, "seed": config.seed,
        **({"perturbation_interval": config.pbt_interval} if config.scheduler == "pbt" else {}),
    }


def _parent_tags(parent: Any, settings: Settings) -> dict[str, str]:
    from mlflow.tracking import MlflowClient

    return dict(MlflowClient(settings.tracking.uri).get_run(parent.run_id).data.tags)


def _job_id() -> str:
    import ray

    return str(ray.get_runtime_context().get_job_id())


# --- the Tuner ----------------------------------------------------------------------------------
def _new_tuner(storage: SweepStorage, config: SweepConfig, space: SearchSpace, run_trial: Any,
               job: SweepJob, trial_preset: Any) -> Any:
    from ray import tune

    return tune.Tuner(
        run_trial,
        param_space=space.to_tune(),
        tune_config=tune.TuneConfig(
            metric=config.metric, mode=config.mode,
            scheduler=make_scheduler(config, space),
            search_alg=search_algorithm(config, config.max_concurrent_trials or (
                _capacity(trial_preset) if job.distributed else None)),
            num_samples=config.num_samples,
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(
            name=config.name, **storage.run_config_kwargs(),
            stop={"training_iteration": config.max_t},
            callbacks=[tune_callback(config.key)],
            checkpoint_config=tune.CheckpointConfig(
                num_to_keep=CHECKPOINTS_KEPT_PER_TRIAL,
                checkpoint_score_attribute=config.metric,
                checkpoint_score_order=config.mode,
            ),
            verbose=0,
        ),
    )


def _restored_tuner(storage: SweepStorage, config: SweepConfig, run_trial: Any) -> Any:
    from ray import tune

    return tune.Tuner.restore(storage.experiment_path(config.name), trainable=run_trial,
                              resume_unfinished=True, restart_errored=False,
                              storage_filesystem=storage.filesystem)


def _capacity(preset: Any) -> int:
    """How many distributed trials fit on the cluster at once (their trial processes take no
    CPU, so Tune would otherwise start every trial and leave their TorchTrainers waiting)."""
    import ray

    total = ray.cluster_resources()
    per_trial = {name: amount * preset.max_workers
                 for name, amount in preset.resources_per_worker().items() if amount > 0}
    fits = [math.floor(total.get(name, 0.0) / amount) for name, amount in per_trial.items()]
    return max(1, min(fits, default=1))


# --- resume: the previous attempt -----------------------------------------------------------------
def _wait_for_previous_attempt(job_id: str) -> None:
    """Wait until every trial process of the sweep's previous driver (Ray job ``job_id``) has
    exited, so none can still log a point after the resumed trials asked what their runs hold."""
    alive = _alive_processes(job_id)
    if not alive:
        return
    logger.info("waiting for %d process(es) of the previous sweep driver to exit", alive)
    deadline = time.monotonic() + PREVIOUS_ATTEMPT_EXIT_S
    while alive and time.monotonic() < deadline:
        time.sleep(PREVIOUS_ATTEMPT_POLL_S)
        alive = _alive_processes(job_id)
    if alive:
        logger.warning("%d process(es) of the previous sweep driver (Ray job %s) still run "
                       "after %.0f s; resuming anyway", alive, job_id, PREVIOUS_ATTEMPT_EXIT_S)


def _alive_processes(job_id: str) -> int:
    """Worker processes of Ray job ``job_id``'s non-detached actors that have not exited.

    An actor is marked dead in Ray's control store as soon as its owner dies; its process exits
    later, when its raylet kills it. The worker table records the exit itself.
    """
    import ray
    from ray.core.generated import gcs_pb2

    try:
        accessor = ray._private.state.state._connect_and_get_accessor()
        exited = {
            worker.worker_address.worker_id
            for worker in map(gcs_pb2.WorkerTableData.FromString,  # type: ignore[attr-defined]
                              accessor.get_worker_table())
            if not worker.is_alive
        }
        actors = map(gcs_pb2.ActorTableData.FromString,  # type: ignore[attr-defined]
                     accessor.get_actor_table(ray.JobID(bytes.fromhex(job_id)), None))
        return sum(1 for actor in actors
                   if not actor.is_detached and actor.address.worker_id
                   and actor.address.worker_id not in exited)
    except Exception as exc:
        logger.debug("cannot list the previous driver's processes: %s", exc)
        return 0


# --- stop signals -------------------------------------------------------------------------------
class _StopRequest:
    """What the driver does on SIGTERM (``ray job stop``) or SIGINT: mark the running trials
    ``preempted`` (bounded, the driver may be killed seconds later), record it on the parent,
    then stop Tune, which saves the sweep's state for ``--resume``."""

    def __init__(self, monitor: SweepMonitor, parent: Any, config: SweepConfig) -> None:
        self.monitor = monitor
        self.parent = parent
        self.config = config
        self.signal_name: str | None = None
        self.preempted: list[str] = []
        self._thread: threading.Thread | None = None

    def handle(self, signum: int, frame: Any) -> None:
        if self.signal_name is not None:  # asked twice: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signal_name = signal.Signals(signum).name
        logger.warning("%s: marking running trials preempted and saving the sweep's state "
                       "(send it again to stop at once)", self.signal_name)
        self._thread = threading.Thread(target=self._preempt, name="raydeck-sweep-preempt",
                                        daemon=True)
        self._thread.start()

    def _preempt(self) -> None:
        try:
            self.preempted = self.monitor.preempt(PREEMPT_MARK_S)
            _record_preemption(self.parent, self.preempted)
            self.parent.flush(PREEMPT_MARK_S)
        except Exception as exc:
            logger.warning("could not record the preemption: %s", exc)
        finally:
            _interrupt_tune()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join(PREEMPT_MARK_S * 3)


def _interrupt_tune() -> None:
    """Ask Tune's loop to stop and save its state (its SIGUSR1 handler), or, outside the loop,
    interrupt the main thread."""
    handler = signal.getsignal(signal.SIGUSR1)
    if callable(handler):
        os.kill(os.getpid(), signal.SIGUSR1)
    else:
        _thread.interrupt_main()


@contextlib.contextmanager
def _stop_signals(stop: _StopRequest) -> Iterator[None]:
    """Route SIGTERM and SIGINT to ``stop`` while the block runs (main thread only).

    Tune handles SIGINT itself (it stops and saves its state); it is told not to here, so that
    the trials are marked preempted before Tune stops them.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    saved_env = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
    for sig in previous:
        signal.signal(sig, stop.handle)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if saved_env is None:
            os.environ.pop("TUNE_DISABLE_SIGINT_HANDLER", None)
        else:
            os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = saved_env


def _record_preemption(parent: Any, preempted: list[str]) -> None:
    parent.set_tags({SWEEP_STATE_TAG: PREEMPTED, f"raydeck.trials_{PREEMPTED}": len(preempted)})


def _interrupted(stop: _StopRequest, monitor: SweepMonitor, parent: Any, config: SweepConfig,
                 settings: Settings) -> None:
    """After Tune stopped: make the preempted trials' records certain (a trial that had just
    started may have bound to its run only after it was marked), end the parent, and raise."""
    from mlflow.tracking import MlflowClient

    stop.join()
    outcomes = {t: o for t in stop.preempted if (o := monitor.outcome(t)) is not None}
    # A trial Tune started a moment before the signal may have no run yet: it has nothing to
    # mark and --resume starts it like any pending trial, so the parent counts trials with runs.
    # A trial that was running at the signal but reported its last iteration before Tune
    # stopped it ended ``completed``: it is not counted as preempted.
    preempted = stop.preempted
    with contextlib.suppress(Exception):
        client = MlflowClient(settings.tracking.uri)
        recorded = record_outcomes(config, monitor, outcomes, child_runs(client, parent), client)
        preempted = [t for t in recorded if outcomes[t].status == PREEMPTED]
    _record_preemption(parent, preempted)
    parent.finish("KILLED")
    raise SweepInterruptedError(
        f"sweep {config.name!r} stopped by {stop.signal_name}: {len(preempted)} running "
        f"trial(s) marked {PREEMPTED}; continue it with `raydeck sweep --name {config.name} "
        "--resume` (finished trials are kept)"
    )


# --- summary and registry -----------------------------------------------------------------
def _finalize(grid: Any, config: SweepConfig, monitor: SweepMonitor, parent: Any, job: SweepJob,
              settings: Settings, registered: str | None) -> SweepResult:
    """The summary and registry steps; a failure says what is intact and what to re-run."""
    from raydeck.tracking.proxy.actors import wait_runs_landed

    rerun = f"`raydeck sweep --name {config.name} --resume`"
    trial_keys = [config.trial_key(str(r.metrics["trial_id"])) for r in grid
                  if r.metrics and r.metrics.get("trial_id")]
    pending = wait_runs_landed(settings.ray_namespace, trial_keys,
                               settings.tracking.finish_timeout_s)
    if pending:
        parent.set_tags({SWEEP_STATE_TAG: "summary_failed"})
        raise SweepFinalizeError(
            f"sweep {config.name!r}: every trial ended and their data is kept by the tracking "
            f"proxy, but it did not reach MLflow within {settings.tracking.finish_timeout_s:.0f}"
            f" s ({pending}; is MLflow reachable? `raydeck tracking status` shows what is "
            f"pending); run {rerun} once it is, to summarize (no trial re-runs)")
    try:
        result = summarize(grid, config, monitor, parent, settings)
    except ConfigError:
        raise
    except Exception as exc:
        parent.set_tags({SWEEP_STATE_TAG: "summary_failed"})
        raise SweepFinalizeError(
            f"sweep {config.name!r}: every trial ended and their runs and checkpoints are kept, "
            f"but the summary failed ({error_line(exc)}); run {rerun} to summarize again (no "
            "trial re-runs)"
        ) from exc
    if not (config.register_model_as and job.model_factory is not None):
        return result
    if registered and result.best_run_id and _same_best(registered, result, settings):
        return dataclasses.replace(result, registered_model_uri=registered)
    try:
        uri = register_best(grid, _best_trial(result), config, job, parent, settings)
    except Exception as exc:
        parent.set_tags({SWEEP_STATE_TAG: "registry_failed"})
        raise SweepFinalizeError(
            f"sweep {config.name!r}: the best trial {result.best_trial_id} (run "
            f"{result.best_run_id}, {result.best_metric} {result.best_score:.4f}) is recorded "
            f"on the sweep run {result.parent_run_id}, but registering it as "
            f"{config.register_model_as!r} failed ({error_line(exc)}); fix that and run {rerun} "
            "to register it (no trial re-runs)"
        ) from exc
    return dataclasses.replace(result, registered_model_uri=uri)


def _best_trial(result: SweepResult) -> Any:
    return next(t for t in result.trials if t.trial_id == result.best_trial_id)


def _same_best(registered: str, result: SweepResult, settings: Settings) -> bool:
    """Whether the model already registered by an earlier driver is this sweep's best."""
    from mlflow.tracking import MlflowClient

    try:
        name, version = registered.removeprefix("models:/").rsplit("/", 1)
        found = MlflowClient(settings.tracking.uri).get_model_version(name, version)
    except Exception:
        return False
    return bool(found.tags.get(RUN_TAG) == result.best_run_id)
