"""MLflow's tracking-store plugin for ``raydeck://`` URIs: existing MLflow code, unchanged, logs
through raydeck's tracking proxy.

MLflow loads :class:`RaydeckStore` for a tracking URI whose scheme this package registers under
the ``mlflow.tracking_store`` entry point (``pyproject.toml``):

- ``raydeck://``: raydeck's configured backend (``RAYDECK_TRACKING_URI``, raydeck.toml, the
  running stack, else the embedded SQLite file), as :func:`raydeck.get_tracker` resolves it;
- ``raydeck+http://``, ``raydeck+https://``, ``raydeck+postgresql://``, ``raydeck+sqlite://``:
  the backend after ``raydeck+``.

Writes to a run's data (``log_batch`` and everything MLflow builds on it: ``log_metric``,
``log_param``, ``set_tag``; ``log_inputs``' datasets) go to the run's
:class:`~raydeck.tracking.Tracker`: validated at the call site (MLflow's own
``MlflowException`` for a bad key or value), buffered, sent in batches, spooled, retried and
deduplicated by the proxy; the caller never waits on MLflow. Ending a run (``update_run_info``
with a terminal status, what ``mlflow.end_run()`` sends) waits until the run's data is in MLflow.
Creating a run and everything else (reads, experiments, ``delete_tag``, logged models, traces)
goes to the backend store MLflow itself builds for the backend URI, synchronously, as plain
MLflow would. Run identity (which run ``start_run`` binds to on a cluster) lives in
:mod:`raydeck.integrations.mlflow_runs`; ``docs/mlflow-plugin.md`` states the semantics.

With a raydeck URI as the process's tracking URI and no registry URI set, the plugin sets the
registry URI (:func:`default_registry_uri`): MLflow's fluent API otherwise looks for one on every
call, and that look costs more than the plugin's whole write.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from mlflow.entities import DatasetInput, Metric, Param, RunInfo, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.store.tracking.abstract_store import AbstractStore
from mlflow.tracking._model_registry import utils as registry_utils
from mlflow.tracking._tracking_service import utils as tracking_utils
from mlflow.utils.async_logging.run_operations import RunOperations
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT, MLFLOW_RUN_NAME

from raydeck.config.settings import Settings, load_settings
from raydeck.config.tracking_uri import unwrap_tracking_uri
from raydeck.errors import TrackingValidationError
from raydeck.integrations.mlflow_runs import TERMINAL_STATUSES, PluginRuns

logger = logging.getLogger(__name__)

# AbstractStore methods this store implements itself; every other public one (and the private
# search MLflow's base class routes through) is the backend's.
_OWN_METHODS = frozenset({
    "create_run", "update_run_info", "log_batch", "log_batch_async", "log_inputs",
    "flush_async_logging", "shut_down_async_logging", "end_async_logging",
    # MLflow's base implementations of these call log_batch / log_batch_async (above).
    "log_metric", "log_metric_async", "log_param", "log_param_async", "set_tag", "set_tag_async",
})


def backend_settings(store_uri: str) -> Settings:
    """raydeck's settings with the tracking URI that ``store_uri`` names (see the module
    docstring); ``raydeck://`` keeps the configured one.

    Raises:
        ConfigError: the backend URI is not one raydeck can track to (named in the message).
    """
    settings = load_settings()
    backend = unwrap_tracking_uri(store_uri)
    if not backend:
        return settings
    return dataclasses.replace(
        settings, tracking=dataclasses.replace(settings.tracking, uri=backend))


def registry_store(store_uri: str) -> Any:
    """The model registry for a raydeck URI: MLflow's own registry store of the backend (the
    ``mlflow.model_registry_store`` entry point), so ``mlflow.register_model`` and
    ``MlflowClient``'s registry calls work unchanged. Registry calls are not run data: they go
    to the backend directly."""
    backend_uri = backend_settings(store_uri).tracking.uri
    # Built directly, not through MLflow's get_store: MLflow holds its registry's lock here.
    build = registry_utils._get_store_registry().get_store_builder(backend_uri)
    return build(store_uri=backend_uri)


def default_registry_uri(store_uri: str) -> None:
    """Make ``store_uri`` MLflow's registry URI (``mlflow.set_registry_uri``) when it is the
    process's tracking URI and no registry URI is set: a user's own setting wins
    (``mlflow.set_registry_uri``, ``MLFLOW_REGISTRY_URI``, a Spark session's
    ``spark.mlflow.modelRegistryUri``).

    Why: without a registry URI, MLflow's fluent API resolves one for the ``MlflowClient`` it
    builds on every call (``mlflow.log_metric``), and that probes for a Spark session (a failed
    ``import pyspark`` each time where PySpark is absent): 200-400 us, several times the
    plugin's own write. The URI set is the one MLflow would fall back to anyway, the tracking
    URI, whose registry (the ``mlflow.model_registry_store`` entry point, :func:`registry_store`)
    is the backend's: registry calls go where they went before, and a process that inherits
    ``MLFLOW_REGISTRY_URI`` (as ``mlflow.set_registry_uri`` makes it) resolves the backend as
    it resolves its tracking URI. A client with an explicit ``tracking_uri`` and another
    tracking URI for the process sets nothing: the fluent API does not use that store.
    """
    if not tracking_utils.is_tracking_uri_set() or tracking_utils.get_tracking_uri() != store_uri:
        return
    if registry_utils._get_registry_uri_from_context():
        return
    registry_utils.set_registry_uri(store_uri)  # what mlflow.set_registry_uri is
    logger.debug("MLflow's registry URI defaults to %s (the tracking URI)", store_uri)


class RaydeckStore(AbstractStore):
    """MLflow's ``AbstractStore`` whose run writes go through raydeck's tracking proxy and
    whose reads go to the backend store (see the module docstring).

    MLflow builds one per tracking URI and process (its store registry caches them), with
    ``RaydeckStore(store_uri=..., artifact_uri=...)``.
    """

    def __init__(self, store_uri: str, artifact_uri: str | None = None) -> None:
        super().__init__()
        self._settings = backend_settings(store_uri)
        backend_uri = self._settings.tracking.uri
        # MLflow's own builder for the backend URI, called directly: MLflow holds its store
        # registry's (non-reentrant) lock while it builds this store. (tracking_utils is a
        # module, not its names: MLflow imports this plugin while that module initializes.)
        build = tracking_utils._tracking_store_registry.get_store_builder(backend_uri)
        self.backend: AbstractStore = build(store_uri=backend_uri, artifact_uri=artifact_uri)
        self._runs = PluginRuns(self._settings, self.backend)
        self._store_uri = store_uri
        default_registry_uri(store_uri)

    # --- runs ---------------------------------------------------------------------------------
    def create_run(self, experiment_id: str, user_id: str | None, start_time: int | None,
                   tags: list[RunTag], run_name: str | None) -> Any:
        """``mlflow.start_run()``'s run: the context's run on a cluster, else a new one
        (:class:`~raydeck.integrations.mlflow_runs.PluginRuns`). Also the registry default
        (:func:`default_registry_uri`), for a tracking URI set after MLflow built this store."""
        default_registry_uri(self._store_uri)
        return self._runs.create(experiment_id, user_id, start_time, tags or [], run_name)

    def update_run_info(self, run_id: str, run_status: int | None, end_time: int | None,
                        run_name: str | None) -> RunInfo:
        """End (terminal status: waits until the run's data landed), resume (RUNNING: binds
        the run here) or rename a run; returns the run's info as the backend shows it then."""
        if run_name:
            self._write(run_id, lambda t: t.set_tags({MLFLOW_RUN_NAME: run_name}))
        status = RunStatus.to_string(run_status) if run_status is not None else ""
        landed = True
        if status in TERMINAL_STATUSES:
            landed = self._runs.end(run_id, status)
        elif status:
            self._runs.start(run_id)
        if landed:
            info: RunInfo = self.backend.get_run(run_id).info
            return info
        # MLflow did not take the run's data in time (it is spooled and lands later, the end
        # too): no read that would wait on MLflow again; the info the caller asked for.
        return RunInfo(run_id, "", "", status, 0, end_time, "active", run_name=run_name)

    # --- run data -----------------------------------------------------------------------------
    def log_batch(self, run_id: str, metrics: list[Metric], params: list[Param],
                  tags: list[RunTag]) -> None:
        """Hand metrics, params and tags to the run's tracker; returns in microseconds.

        Metrics keep their own step and timestamp. Params are immutable as in MLflow; ranks
        other than 0 do not write params (raydeck's rule: every rank may log the config).

        Raises:
            MlflowException: (``INVALID_PARAMETER_VALUE``) a key or value MLflow would refuse,
                or a param logged again with another value; the batch's other values are kept.
        """
        def write(tracker: Any) -> None:
            if params:
                tracker.log_params({p.key: p.value for p in params})
            if tags:
                tracker.set_tags({t.key: t.value for t in tags})
            if len(metrics) == 1:
                metric = metrics[0]
                tracker.log_metric(metric.key, metric.value, metric.step, None, metric.timestamp)
            elif metrics:
                by_point: dict[tuple[int, int], dict[str, float]] = {}
                for metric in metrics:
                    by_point.setdefault((metric.step, metric.timestamp), {})[metric.key] = (
                        metric.value)
                for (step, timestamp), values in by_point.items():
                    tracker.log_metrics(values, step, None, timestamp)

        self._write(run_id, write)

    def log_metric(self, run_id: str, metric: Metric) -> None:
        """One value (``mlflow.log_metric``): :meth:`log_batch`'s path for a single metric,
        without MLflow's detour through a batch (this is every fluent call's cost).

        Raises:
            MlflowException: (``INVALID_PARAMETER_VALUE``) a key or value MLflow would refuse.
        """
        self._write(run_id, lambda tracker: tracker.log_metric(
            metric.key, metric.value, metric.step, None, metric.timestamp))

    def log_batch_async(self, run_id: str, metrics: list[Metric], params: list[Param],
                        tags: list[RunTag]) -> RunOperations:
        """The same as :meth:`log_batch` (which never waits on MLflow); already complete."""
        self.log_batch(run_id, metrics, params, tags)
        return RunOperations([])

    def log_inputs(self, run_id: str, datasets: list[DatasetInput] | None = None,
                   models: list[Any] | None = None) -> None:
        """Datasets go through the run's tracker; model inputs to the backend directly."""
        if datasets:
            def write(tracker: Any) -> None:
                for dataset_input in datasets:
                    tags = {t.key: t.value for t in dataset_input.tags}
                    context = tags.pop(MLFLOW_DATASET_CONTEXT, None)
                    tracker.log_input(_DatasetEntity(dataset_input.dataset), context, tags)

            self._write(run_id, write)
        if models:
            self.backend.log_inputs(run_id, models=models)

    def delete_tag(self, run_id: str, key: str) -> None:
        """Delete a tag in the backend, after handing the run's earlier writes to the proxy.
        Synchronous, as in plain MLflow; see docs/mlflow-plugin.md for its ordering."""
        self._runs.tracker(run_id).flush()
        self.backend.delete_tag(run_id, key)  # type: ignore[attr-defined]

    def flush_async_logging(self) -> None:
        """Hand every run's buffered writes to the proxy: spooled and durable on return."""
        self._runs.flush()

    def shut_down_async_logging(self) -> None:
        self._runs.flush()

    def end_async_logging(self) -> None:
        """Nothing to stop: the trackers' flushers stop when their runs end."""

    def _write(self, run_id: str, write: Callable[[Any], None]) -> None:
        try:
            self._runs.write(run_id, write)
        except TrackingValidationError as exc:
            raise MlflowException(str(exc), INVALID_PARAMETER_VALUE) from exc

    def __getattr__(self, name: str) -> Any:
        """Backend-specific methods beyond ``AbstractStore`` (e.g. the SQL store's)."""
        if name.startswith("__") or name in ("backend", "_settings", "_runs", "_store_uri"):
            raise AttributeError(name)
        return getattr(self.backend, name)


class _DatasetEntity:
    """An MLflow dataset entity where :meth:`Tracker.log_input` takes an ``mlflow.data``
    dataset: both give the entity the tracker sends."""

    def __init__(self, entity: Any) -> None:
        self._entity = entity

    def _to_mlflow_entity(self) -> Any:
        return self._entity


def _delegate(name: str) -> Callable[..., Any]:
    def method(self: RaydeckStore, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.backend, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"The backend's ``{name}`` (a read, or a write outside a run's data)."
    return method


def _delegate_property(name: str) -> property:
    return property(lambda self: getattr(self.backend, name),
                    doc=f"The backend's ``{name}``.")


def _delegate_the_rest(store_class: type[Any]) -> None:
    """Give ``store_class`` the backend's version of every ``AbstractStore`` member it does not
    implement itself (MLflow adds members between releases; each is the backend's until this
    store says otherwise)."""
    for name, member in vars(AbstractStore).items():
        if name in _OWN_METHODS or (name.startswith("_") and name != "_search_runs"):
            continue
        if isinstance(member, property):
            setattr(store_class, name, _delegate_property(name))
        elif callable(member):
            setattr(store_class, name, _delegate(name))
    abc.update_abstractmethods(store_class)


_delegate_the_rest(RaydeckStore)
