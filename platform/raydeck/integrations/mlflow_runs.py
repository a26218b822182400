"""Which raydeck tracker an MLflow run's writes go to: run identity for the MLflow plugin.

Owns: :class:`PluginRuns`, the map from MLflow run ids to the trackers that carry their writes,
and the rule that decides what ``mlflow.start_run()`` (the store's ``create_run``) binds to:

- Inside a Ray Train worker, a Tune trial, or a process with ``RAYDECK_RUN_ID`` (a job
  ``raydeck submit`` started): the run raydeck's own :func:`~raydeck.tracking.get_tracker`
  gives there (the Train run, the trial's run, the job's run), so N ranks calling
  ``mlflow.start_run()`` make one run. The tracking mode decides who writes: in ``rank_zero``
  the other ranks get the run's id and a tracker that logs nothing.
- Anywhere else (a plain script or driver): a new run, created in the backend exactly as plain
  MLflow creates it (experiment, name, tags, user, start time), then attached to by its MLflow
  run id, so every process that writes to that id (``MlflowClient`` in actors too) joins one
  proxy run.
- ``start_run(run_id=...)`` for a run id this process has not bound attaches to that existing
  MLflow run, as its own.
- A write by id alone (``MlflowClient().log_batch(run_id, ...)`` in a Ray actor, say) to a run
  this process neither created nor started is a guest write
  (:func:`~raydeck.tracking.client.attach.attach_guest`): it returns only once the proxy holds the
  values (spooled, durable), as plain MLflow returns only once the server has them, and the
  guest takes no part in the run's life: the run's owner ends it while the guest's process
  lives on (a later guest write lands in the ended run, as in plain MLflow), and the guest's
  process may exit or be killed right after any call. A guest's own ``set_terminated`` waits
  until the run's data is in MLflow and ends the run only if no process holds it.

System metrics: MLflow logs them only when asked, so a run this plugin binds samples them (as
raydeck's tracker does, one node view per node) only when MLflow's own switch is on or raydeck's
``RAYDECK_TRACKING_SYSTEM_METRICS`` says ``on`` (:func:`system_metrics_interval_s`).

Does not own the MLflow store interface (:mod:`raydeck.integrations.mlflow_store`) nor any
delivery: writes go through :class:`~raydeck.tracking.Tracker`, the same client raydeck's own
calls use.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from mlflow.entities import RunTag, ViewType
from mlflow.environment_variables import (
    MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING,
    MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL,
)
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE
from mlflow.store.tracking.abstract_store import AbstractStore
from mlflow.utils.mlflow_tags import MLFLOW_RUN_NAME

from raydeck.cluster.connection import connect
from raydeck.config.settings import Settings
from raydeck.errors import ConfigError, TrackingUnavailableError, TrackingWriteError
from raydeck.tracking import Tracker, get_tracker
from raydeck.tracking.client.attach import attach_guest
from raydeck.tracking.client.context import detect_process
from raydeck.tracking.proxy.actors import end_unowned_run

logger = logging.getLogger(__name__)

# A rank that logs nothing (rank_zero mode) learns its run's MLflow id from the backend, where
# rank 0's shard creates the run; it asks this often and gives up after the tracker's own wait.
RUN_ID_POLL_INTERVAL_S = 0.2
RUN_ID_WAIT_S = 60.0
RUN_KEY_TAG = "raydeck.run_key"
TERMINAL_STATUSES = frozenset({"FINISHED", "FAILED", "KILLED"})


def system_metrics_interval_s(settings: Settings) -> float:
    """How often a run bound through the plugin samples system metrics; 0: never.

    ``RAYDECK_TRACKING_SYSTEM_METRICS``: ``off`` never, ``on`` always, ``auto`` (the default) as
    MLflow decides for a run of its own: only when ``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING`` is on
    (what ``mlflow.enable_system_metrics_logging()`` sets), read with MLflow's own reader when
    the run starts, as ``mlflow.start_run`` reads it. The period is MLflow's
    ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` when MLflow's switch decided and that is set
    (MLflow's reading: 0 is unset), else ``RAYDECK_TRACKING_SYSTEM_METRICS_INTERVAL_S``, whose
    0 turns sampling off whatever else says.

    Raises:
        ConfigError: one of MLflow's two variables holds a value MLflow cannot read, or a
            negative interval (the message names it).
    """
    tracking = settings.tracking
    if tracking.system_metrics == "off" or tracking.system_metrics_interval_s == 0:
        return 0.0
    if tracking.system_metrics == "on":
        return tracking.system_metrics_interval_s
    try:
        if not MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING.get():
            return 0.0
        interval_s = MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL.get()
    except ValueError as exc:  # MLflow's reader names the variable and what it holds
        raise ConfigError(f"{exc}; set it as MLflow documents, or unset it") from exc
    if interval_s is not None and interval_s < 0:
        raise ConfigError(f"{MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL.name} = {interval_s!r}: "
                          "must be a period in seconds > 0 (or unset: "
                          "RAYDECK_TRACKING_SYSTEM_METRICS_INTERVAL_S)")
    return float(interval_s or tracking.system_metrics_interval_s)


class PluginRuns:
    """The trackers this process opened through the plugin for one backend, by MLflow run id.

    Thread-safe. A tracker stays bound until its run is ended (``end``); a later write to the
    same run id attaches again (the router reopens the run, as for raydeck's own calls).
    """

    def __init__(self, settings: Settings, backend: AbstractStore) -> None:
        self._settings = settings
        self._backend = backend
        self._lock = threading.Lock()
        self._trackers: dict[str, Tracker] = {}
        self._guest_run_ids: set[str] = set()

    def create(self, experiment_id: str, user_id: str | None, start_time: int | None,
               tags: list[RunTag], run_name: str | None) -> Any:
        """The run ``mlflow.start_run()`` gets here (see the module docstring); an MLflow Run.

        Raises:
            MlflowException: the backend refused the run or could not be reached, or the
                context's run did not appear in MLflow within ``RUN_ID_WAIT_S``.
        """
        settings = self._run_settings()  # a bad MLflow variable fails before the run exists
        connect(self._settings)
        process = detect_process()
        if not (process.train_run_name or process.trial_id or settings.run_id):
            run = self._backend.create_run(experiment_id, user_id, start_time, tags, run_name)
            self.start(run.info.run_id, settings)
            return run
        # The caller's MLflow experiment, for a run this call creates (a run that exists, e.g.
        # made by a raydeck driver, keeps its own).
        experiment = str(self._backend.get_experiment(experiment_id).name)
        try:
            tracker = get_tracker(experiment=experiment, settings=settings)
            run_id = tracker.run_id if tracker.active else self._wait_run_id(
                tracker, experiment)
        except TrackingUnavailableError as exc:
            raise MlflowException(str(exc), TEMPORARILY_UNAVAILABLE) from exc
        with self._lock:
            self._trackers[run_id] = tracker
        # The context's run keeps its own name; MLflow's context tags (user, source) still land.
        tracker.set_tags({t.key: t.value for t in tags if t.key != MLFLOW_RUN_NAME}, strict=False)
        logger.info("mlflow.start_run() in %s bound to run %s (%s)", process.role, run_id,
                    tracker.run_key)
        return self._backend.get_run(run_id)

    def tracker(self, run_id: str) -> Tracker:
        """The tracker for ``run_id``: bound here already, or attached to that MLflow run now
        as a guest (see the module docstring)."""
        with self._lock:
            tracker = self._trackers.get(run_id)
            if tracker is None:
                tracker = self._trackers[run_id] = attach_guest(run_id, self._settings)
                self._guest_run_ids.add(run_id)
            return tracker

    def start(self, run_id: str, settings: Settings | None = None) -> Tracker:
        """The tracker for ``run_id``, which this process started (``start_run``) or resumed
        (``start_run(run_id=...)``): a participant of the run, its writes buffered, and ``end``
        waits for them. A guest tracker this process had for the run leaves it first (its
        writes are in the proxy already). ``settings``: the run's (:meth:`_run_settings`), when
        the caller has them already."""
        settings = settings or self._run_settings()
        # Ray (and a local Ray's runtime env) gets the store's settings, not this run's.
        connect(self._settings)
        with self._lock:
            tracker = self._trackers.get(run_id)
            if tracker is None or run_id in self._guest_run_ids:
                self._guest_run_ids.discard(run_id)
                if tracker is not None:
                    tracker.finish(wait=False)
                tracker = self._trackers[run_id] = get_tracker(run_id, settings=settings)
            return tracker

    def _run_settings(self) -> Settings:
        """The settings a run starting now gets: the store's, sampling system metrics as
        :func:`system_metrics_interval_s` says at this moment."""
        tracking = dataclasses.replace(
            self._settings.tracking,
            system_metrics_interval_s=system_metrics_interval_s(self._settings))
        return dataclasses.replace(self._settings, tracking=tracking)

    def write(self, run_id: str, write: Callable[[Tracker], None]) -> None:
        """Apply ``write`` to ``run_id``'s tracker; a guest write returns once the proxy holds
        it (see the module docstring)."""
        # A bound run's tracker without the lock (one dict read is atomic): every write's path.
        tracker = self._trackers.get(run_id) or self.tracker(run_id)
        write(tracker)
        if run_id in self._guest_run_ids:  # one read of a set: atomic, no lock on this path
            tracker.flush()

    def end(self, run_id: str, status: str) -> bool:
        """End ``run_id``'s tracker with ``status``: send everything and wait until it is in
        MLflow (at most ``RAYDECK_TRACKING_FINISH_TIMEOUT_S``; what is still pending then stays
        spooled and lands later, and a warning says what). Values MLflow refused for good are
        dead letters: logged, recorded on the run, never raised into the caller's ``end_run``.
        Returns whether everything landed (False: MLflow did not take it all in time).

        In a process that only wrote to the run as a guest (or not at all) this waits the same
        way, but ends the run only if no process holds it (its owner ends it otherwise).

        Raises:
            MlflowException: the proxy could not be reached to take the last data.
        """
        with self._lock:
            tracker = self._trackers.pop(run_id, None)
            guest = run_id in self._guest_run_ids
            self._guest_run_ids.discard(run_id)
        try:
            if tracker is not None and not guest:
                return tracker.finish(status).landed
            # A process that only wrote to the run (or not even that): its writes are in the
            # proxy; the run's owner ends the run, this only if no process holds it.
            tracker = tracker or attach_guest(run_id, self._settings)
            tracker.finish(status)
            if not tracker.active:
                return True
            return end_unowned_run(self._settings, tracker.run_key, status,
                                   self._settings.tracking.finish_timeout_s)
        except TrackingWriteError as exc:
            logger.warning("%s", exc)
            return True
        except TrackingUnavailableError as exc:
            raise MlflowException(str(exc), TEMPORARILY_UNAVAILABLE) from exc

    def flush(self) -> None:
        """Hand every bound tracker's buffered writes to the proxy (spooled, durable)."""
        with self._lock:
            trackers = list(self._trackers.values())
        for tracker in trackers:
            tracker.flush()

    def _wait_run_id(self, tracker: Tracker, experiment: str) -> str:
        """MLflow's id of a silent rank's run: known to the router, or found by its run key
        once the run's shard created it (in the caller's experiment or raydeck's)."""
        if tracker.known_run_id():
            return tracker.known_run_id()
        names = dict.fromkeys((experiment, self._settings.tracking.experiment))
        deadline = time.monotonic() + RUN_ID_WAIT_S
        while time.monotonic() < deadline:
            found_experiments = (self._backend.get_experiment_by_name(name) for name in names)
            ids = [e.experiment_id for e in found_experiments if e is not None]
            found = self._backend.search_runs(
                ids, f"tags.`{RUN_KEY_TAG}` = '{tracker.run_key}'",
                run_view_type=ViewType.ALL, max_results=1) if ids else []
            if found:
                return str(found[0].info.run_id)
            time.sleep(RUN_ID_POLL_INTERVAL_S)
        raise TrackingUnavailableError(
            f"run {tracker.run_key!r} did not appear in MLflow within {RUN_ID_WAIT_S:.0f} s")

