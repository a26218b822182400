"""Writing to MLflow and its artifact store, and telling a passing failure from a refusal.

Owns: the calls (``log_batch`` within MLflow's per-call limits, artifact uploads, dataset inputs,
creating, finding, reopening and ending runs) and :class:`FailurePolicy`, the one place that
decides whether a failed write is *transient* (retry the same data later, as long as it takes) or
*permanent* (set exactly the refused entity aside; never retry it). A permanent refusal inside a
multi-value ``log_batch`` is bisected down to the values MLflow refuses, so one bad value never
sinks the rest. Does not own: when to retry (the shard) or durability (the spool).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import importlib
import logging
import os
import re
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from raydeck._internal.redaction import quiet_mlflow_urls
from raydeck.config.settings import TrackingSettings
from raydeck.tracking.messages import DatasetRef, Point
from raydeck.tracking.proxy.direct_store import (
    SchemaMismatchError,
    check_schema,
    is_database_uri,
    pool_env,
    transient_db_failure,
)
from raydeck.tracking.proxy.sql_batch import SqlBatchWriter

if TYPE_CHECKING:
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

logger = logging.getLogger(__name__)

# The writer's request timeout unless its caller names one (the proxy's shards pass
# RAYDECK_TRACKING_MLFLOW_TIMEOUT_S): the setting's default, declared once in raydeck.config.
DEFAULT_REQUEST_TIMEOUT_S: int = TrackingSettings.mlflow_timeout_s
RUN_KEY_TAG = "raydeck.run_key"
MODE_TAG = "raydeck.mode"

# S3 error codes worth retrying (everything else a server answers is a refusal).
_TRANSIENT_S3_CODES = {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout",
                       "RequestTimeTooSkewed", "OperationAborted", "Throttling",
                       "ThrottlingException", "RequestLimitExceeded", "503", "500", "502", "504"}
# OS errors no retry can fix: permissions, read-only or full file systems, bad names.
_PERMANENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT,
                     errno.ENAMETOOLONG, errno.EISDIR, errno.ENOTDIR, errno.EINVAL, errno.EFBIG,
                     errno.ENOENT}
_S3_CODE_IN_TEXT = re.compile(r"An error occurred \(([\w.]+)\)")
_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]")
# A server that answered with an error status (not one that could not be reached).
_ANSWERED_IN_TEXT = re.compile(r"too many \d{3} error responses|Response body|error code \d{3}")


_MLFLOW_IMPORT_LOCK = threading.Lock()


def mlflow_request_env(timeout_s: int) -> dict[str, str]:
    """MLflow's client settings for raydeck's own calls: each request fails after ``timeout_s``
    and MLflow does not retry it. MLflow's client retries a failed request for minutes by
    default; the shard has its own retry loop with a visible backlog, so each request fails
    fast and the loop decides."""
    return {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(timeout_s)}


def mlflow_client_api() -> ModuleType:
    """The ``mlflow`` package with its client, entities and exceptions imported.

    Why not a module-level import: every training process imports this module through the
    tracker, and importing any part of MLflow costs about 2 CPU-s, while only the proxy's shards
    and lookups talk to MLflow. :class:`MlflowWriter` calls this when it is made, before its
    threads start. The lock: writer threads that imported MLflow at once deadlocked on Python's
    per-module import locks ("partially initialized module 'mlflow'").
    """
    with _MLFLOW_IMPORT_LOCK:
        for name in ("mlflow.entities", "mlflow.exceptions", "mlflow.tracking"):
            importlib.import_module(name)
        return importlib.import_module("mlflow")


class TransientWriteError(Exception):
    """MLflow or the artifact store is unreachable or overloaded; retry the same data later.

    ``answered`` is True when a server did answer (with a 5xx), as opposed to not being
    reachable: the shard's evidence rule for artifact stores that answer 500 to a file they
    will never take (MLflow's artifact proxy says nothing more) needs the difference.
    """

    def __init__(self, message: str, answered: bool = False) -> None:
        super().__init__(message)
        self.answered = answered


class PermanentWriteError(Exception):
    """The server refused this entity for good (its reason is the message); never retry it."""


@dataclass(frozen=True)
class Verdict:
    transient: bool
    reason: str
    answered: bool = False


class FailurePolicy:
    """Classifies every failure MLflow, S3 or the local disk can produce.

    Transient: connection refused or reset, timeouts, HTTP 5xx, 401 (credentials), 408 and 429,
    S3 throttling and internal errors, a locked, restarting or unreachable database (the direct
    path: SQLAlchemy's error decides, :func:`~raydeck.tracking.proxy.direct_store.
    transient_db_failure`), a database whose schema is not MLflow's (nothing is written until it
    is upgraded). Permanent: any
    other 4xx answer
    (a refused value, a conflicting param, an unknown run, 403 access denied, 413 too large),
    S3's refusals (AccessDenied, NoSuchBucket, InvalidAccessKeyId, EntityTooLarge, ...), missing
    credentials, and OS errors no retry fixes (permission, read-only or full disk). An error of a
    type this policy does not know is treated as transient, but the shard gives up on the entity
    after a bounded number of such attempts, so nothing unknown is retried forever.
    """

    def classify(self, exc: BaseException) -> Verdict:
        chain = _chain(exc)
        if any(isinstance(cause, SchemaMismatchError) for cause in chain):
            return Verdict(True, _short(exc))  # never written; waits for the upgrade
        # The direct path: the database's own error decides, not MLflow's wrapping of it.
        by_database = transient_db_failure(chain)
        if by_database is not None:
            return Verdict(by_database, _short(exc))
        for cause in chain:
            verdict = self._classify_one(cause)
            if verdict is not None:
                return verdict
        return Verdict(True, f"unclassified {_short(exc)}")

    def _classify_one(self, exc: BaseException) -> Verdict | None:
        text = _short(exc)
        if isinstance(exc, mlflow_client_api().exceptions.MlflowException):
            status = exc.get_http_status_code()
            # 401: the proxy's credentials are missing or expired, which is about the
            # connection, not the value: retried (loudly) until someone fixes them.
            if status >= 500 or status in (401, 408, 429):
                # The tracking server answers 500 for everything its artifact proxy fails at,
                # permanent or not; the message may keep the OS error number or the S3 code.
                by_text = _verdict_from_text(str(exc), text)
                if by_text is not None:
                    return by_text
                if exc.__cause__ is not None:
                    return None
                return Verdict(True, text, answered=_ANSWERED_IN_TEXT.search(str(exc)) is not None)
            return Verdict(False, text, answered=True)
        name = type(exc).__name__
        module = type(exc).__module__
        if module.startswith("botocore"):
            # ClientError and the per-code subclasses botocore makes (NoSuchBucket, ...).
            if isinstance(getattr(exc, "response", None), dict):
                error = getattr(exc, "response", {}).get("Error", {})
                code = str(error.get("Code", ""))
                status = getattr(exc, "response", {}).get("ResponseMetadata", {}).get(
                    "HTTPStatusCode", 0)
                transient = code in _TRANSIENT_S3_CODES or int(status or 0) >= 500
                return Verdict(transient, text, answered=True)
            if name in ("NoCredentialsError", "PartialCredentialsError",
                        "NoRegionError", "ParamValidationError", "InvalidS3AddressingStyleError"):
                return Verdict(False, text)
            return Verdict(True, text)  # connection, timeout and protocol errors
        if name == "S3UploadFailedError":
            return _verdict_from_text(str(exc), text)
        if module.startswith(("requests", "urllib3")):
            response = getattr(exc, "response", None)
            status = getattr(response, "status_code", None)
            if status is not None:
                return Verdict(status >= 500 or status in (408, 429), text, answered=True)
            return Verdict(True, text)
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return Verdict(True, text)
        if isinstance(exc, OSError):
            return Verdict(exc.errno not in _PERMANENT_ERRNOS, text)
        return None


def _verdict_from_text(message: str, text: str) -> Verdict | None:
    """A verdict from an error number or S3 code quoted in a server's error message."""
    number = _ERRNO_IN_TEXT.search(message)
    if number:
        return Verdict(int(number.group(1)) not in _PERMANENT_ERRNOS, text)
    code = _S3_CODE_IN_TEXT.search(message)
    if code:
        return Verdict(code.group(1) in _TRANSIENT_S3_CODES, text)
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes, outermost first (bounded: chains can loop)."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 10:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


@dataclass(frozen=True)
class OpenedRun:
    """A run as found or created in MLflow."""

    run_id: str
    experiment_id: str
    mode: str
    name: str
    resumed: bool
    params: dict[str, str]


@contextlib.contextmanager
def _store_init_lock(tracking_uri: str) -> Iterator[None]:
    """Serialize opening a ``sqlite:`` store across processes.

    Opening a new SQLite store runs MLflow's schema migrations; two shards (or a shard and the
    router) doing it at once on a fresh file break each other's migration. Other stores need no
    lock: a server or a SQL database migrates once, elsewhere.
    """
    if not tracking_uri.startswith("sqlite:///"):
        yield
        return
    lock_path = tracking_uri[len("sqlite:///"):].split("?")[0] + ".raydeck-open.lock"
    try:
        fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o600)
    except OSError:  # no directory (yet): MLflow's own error says so on first use
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class MlflowWriter:
    """Writes to one MLflow backend. Thread-safe: the shard's writers share it.

    ``write_uri`` (default ``tracking_uri``) is where runs, values and ends go: a database URI is
    the direct path (MLflow's SQL store, its schema checked before the first write, a pool of
    ``writers + 1`` connections). Files always go through ``tracking_uri`` (an http(s) server's
    artifact proxy and default artifact root), and so do experiments when the two differ.
    """

    def __init__(self, tracking_uri: str, policy: FailurePolicy | None = None,
                 request_timeout_s: int = DEFAULT_REQUEST_TIMEOUT_S, write_uri: str = "",
                 writers: int = 1) -> None:
        # MLflow reads these per request from the process's environment: one timeout per
        # process (a shard, the router, the queue actor), set by the writer it makes.
        os.environ.update(mlflow_request_env(request_timeout_s))
        self.write_uri = write_uri or tracking_uri
        self.direct = is_database_uri(self.write_uri)
        # Read by MLflow when it makes the engine, once per process and URI (a shard is one
        # process with one writer).
        os.environ.update(pool_env(self.write_uri, writers))
        self._mlflow = mlflow_client_api()
        quiet_mlflow_urls(tracking_uri)
        self.tracking_uri = tracking_uri
        self.policy = policy or FailurePolicy()
        self._client: MlflowClient | None = None
        self._server: MlflowClient | None = None
        self._batches: SqlBatchWriter | MlflowClient | None = None
        self._client_lock = threading.Lock()

    @property
    def client(self) -> MlflowClient:
        """MLflow's client for writes, made on first use: for a SQL URI making it connects to the
        database (and migrates a new one), which may fail while the database is down; that failure
        is a write error like any other, never one that stops the shard from starting. A database
        whose schema revision is not the installed MLflow's is refused here
        (:class:`~raydeck.tracking.proxy.direct_store.SchemaMismatchError`), before any write,
        and checked again at the next write until it matches."""
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    with _store_init_lock(self.write_uri):
                        if self.direct:
                            check_schema(self.write_uri)
                        self._client = self._mlflow.tracking.MlflowClient(
                            tracking_uri=self.write_uri)
        return self._client

    @property
    def server(self) -> MlflowClient:
        """The client for files and experiments: the write client unless ``write_uri`` is a
        server's database, then the server's own."""
        if self.write_uri == self.tracking_uri:
            return self.client
        if self._server is None:
            with self._client_lock:
                if self._server is None:
                    self._server = self._mlflow.tracking.MlflowClient(
                        tracking_uri=self.tracking_uri)
        return self._server

    @property
    def batches(self) -> SqlBatchWriter | MlflowClient:
        """What ``log_batch`` calls: on the direct path MLflow's SQL store written in bulk
        (:class:`~raydeck.tracking.proxy.sql_batch.SqlBatchWriter`, the same rows as MLflow's
        ``log_batch``), else the write client."""
        client = self.client
        if self._batches is None:
            with self._client_lock:
                if self._batches is None:
                    bulk = SqlBatchWriter.for_uri(self.write_uri) if self.direct else None
                    self._batches = bulk or client
        return self._batches

    def _call(self, what: str, method: str, *args: Any, via_server: bool = False,
              batches: bool = False, **kwargs: Any) -> Any:
        """Run ``client.<method>`` (``server.<method>`` with ``via_server``, ``batches.<method>``
        with ``batches``); failures come out as Transient- or PermanentWriteError."""
        try:
            client = self.server if via_server else self.batches if batches else self.client
            return getattr(client, method)(*args, **kwargs)
        except Exception as exc:
            verdict = self.policy.classify(exc)
            if verdict.transient:
                raise TransientWriteError(f"{what}: {verdict.reason}", verdict.answered) from exc
            raise PermanentWriteError(f"{what}: {verdict.reason}") from exc

    # --- values -----------------------------------------------------------------------------
    def log_batch(self, run_id: str, points: Sequence[Point], params: dict[str, str],
                  tags: dict[str, str]) -> list[tuple[str, str, str]]:
        """Write one chunk (within MLflow's limits) to a run.

        Returns ``(kind, key, reason)`` for each value MLflow refused for good; the rest landed.

        Raises:
            TransientWriteError: nothing can be said yet; call again with the same values.
        """
        refused: list[tuple[str, str, str]] = []
        entities = self._mlflow.entities
        self._chunk(run_id, [entities.Metric(k, v, ts, step) for k, v, ts, step in points],
                    [entities.Param(k, v) for k, v in params.items()],
                    [entities.RunTag(k, v) for k, v in tags.items()], refused)
        return refused

    def _chunk(self, run_id: str, metrics: list[Metric], params: list[Param],
               tags: list[RunTag], refused: list[tuple[str, str, str]]) -> None:
        if not (metrics or params or tags):
            return
        try:
            self._call("log_batch", "log_batch", run_id, metrics=metrics,
                       params=params, tags=tags, synchronous=True, batches=True)
            return
        except PermanentWriteError as exc:
            if len(metrics) + len(params) + len(tags) == 1:
                entity = (metrics or params or tags)[0]
                kind = "metric" if metrics else "param" if params else "tag"
                refused.append((kind, entity.key, str(exc)))
                return
        for part in _halves(metrics, params, tags):
            self._chunk(run_id, *part, refused)

    def log_input(self, run_id: str, dataset: DatasetRef) -> None:
        entities = self._mlflow.entities
        tags = [entities.InputTag(k, v) for k, v in dataset.tags.items()]
        if dataset.context:
            tags.append(entities.InputTag("mlflow.data.context", dataset.context))
        entity = entities.Dataset(name=dataset.name, digest=dataset.digest,
                         source_type=dataset.source_type, source=dataset.source,
                         schema=dataset.schema or None, profile=dataset.profile or None)
        self._call("log_inputs", "log_inputs", run_id,
                   datasets=[entities.DatasetInput(dataset=entity, tags=tags)])

    # --- artifacts --------------------------------------------------------------------------
    def upload_file(self, run_id: str, path: Path, artifact_dir: str) -> None:
        """Upload one local file to ``<artifact root>/<artifact_dir>/<path.name>``."""
        self._call(f"artifact upload {artifact_dir + '/' if artifact_dir else ''}{path.name}",
                   "log_artifact", run_id, str(path), artifact_dir or None, via_server=True)

    def history_steps(self, run_id: str, key: str) -> list[int]:
        """Steps of every point of metric ``key`` MLflow holds for a run."""
        history = self._call("metric history", "get_metric_history", run_id, key)
        return [m.step for m in history]

    # --- runs -------------------------------------------------------------------------------
    def find_run(self, key: str, experiment_ids: list[str] | None = None) -> Any | None:
        """The run tagged ``raydeck.run_key = key`` (an MLflow run id works too), or None."""
        from raydeck.config.settings import RUN_KEY_PATTERN

        if not RUN_KEY_PATTERN.match(key):
            raise PermanentWriteError(f"run key {key!r} is not a valid run key")
        if re.fullmatch(r"[0-9a-f]{32}", key):
            try:
                return self._call("get_run", "get_run", key)
            except PermanentWriteError as exc:
                cause = exc.__cause__
                if not (isinstance(cause, self._mlflow.exceptions.MlflowException)
                        and cause.get_http_status_code() == 404):
                    raise
        if experiment_ids is None:
            experiments = self._call("search_experiments", "search_experiments",
                                     max_results=1000)
            experiment_ids = [e.experiment_id for e in experiments]
        if not experiment_ids:
            return None
        hits = self._call("search_runs", "search_runs", experiment_ids,
                          filter_string=f"tags.`{RUN_KEY_TAG}` = '{key}'", max_results=1)
        return hits[0] if hits else None

    def experiment_id(self, name: str, artifact_location: str) -> str:
        # Through the server: an experiment made through its database would get this process's
        # default artifact root, not the server's.
        exp = self._call("get_experiment_by_name", "get_experiment_by_name", name,
                         via_server=True)
        if exp is not None:
            return str(exp.experiment_id)
        try:
            return str(self._call("create_experiment", "create_experiment", name,
                                  artifact_location=artifact_location or None, via_server=True))
        except PermanentWriteError:
            # Another shard or router created it first.
            exp = self._call("get_experiment_by_name", "get_experiment_by_name", name,
                             via_server=True)
            if exp is None:
                raise
            return str(exp.experiment_id)

    def open_run(self, key: str, name: str, experiment: str, artifact_location: str, mode: str,
                 tags: dict[str, str], parent_run_id: str | None) -> OpenedRun:
        """Find the run of ``key`` and mark it RUNNING, or create it. Idempotent."""
        experiment_id = self.experiment_id(experiment, artifact_location)
        found = self.find_run(key, [experiment_id])
        if found is None and re.fullmatch(r"[0-9a-f]{32}", key) is None:
            all_tags = {RUN_KEY_TAG: key, MODE_TAG: mode, **tags}
            if parent_run_id:
                all_tags["mlflow.parentRunId"] = parent_run_id
            created = self._call("create_run", "create_run", experiment_id,
                                 run_name=name, tags=all_tags)
            return OpenedRun(created.info.run_id, experiment_id, mode, name, False, {})
        if found is None:
            raise PermanentWriteError(
                f"run id {key!r} looks like an MLflow run id, but MLflow has no such run; pass "
                "an existing run id, or a name of your own (letters, digits, _ . -)")
        if found.info.status != "RUNNING":
            self._call("update_run", "update_run", found.info.run_id, status="RUNNING")
        return OpenedRun(found.info.run_id, found.info.experiment_id,
                         found.data.tags.get(MODE_TAG, mode), found.info.run_name or name, True,
                         dict(found.data.params))

    def end_run(self, run_id: str, status: str) -> None:
        self._call("set_terminated", "set_terminated", run_id, status=status,
                   end_time=int(time.time() * 1000))


def _halves(
    metrics: list[Metric], params: list[Param], tags: list[RunTag]
) -> list[tuple[list[Metric], list[Param], list[RunTag]]]:
    if metrics and (params or tags):
        return [(metrics, [], []), ([], params, tags)]
    if params and tags:
        return [([], params, []), ([], [], tags)]
    if len(metrics) > 1:
        mid = len(metrics) // 2
        return [(metrics[:mid], [], []), (metrics[mid:], [], [])]
    if len(params) > 1:
        mid = len(params) // 2
        return [([], params[:mid], []), ([], params[mid:], [])]
    mid = len(tags) // 2
    return [([], [], tags[:mid]), ([], [], tags[mid:])]


def _short(exc: BaseException) -> str:
    """The first line of an error, at most 300 characters, with URL credentials removed."""
    from raydeck._internal.redaction import redact_text

    text = f"{type(exc).__name__}: {exc}"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return redact_text(first[:300])
