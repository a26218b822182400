"""The Serve replica: one registered model behind MLflow's scoring protocol, batched, following
an alias.

Owns: :class:`ModelServer`, the class every replica of a ``raydeck serve`` application runs:
HTTP routes (``POST /invocations``, ``GET /ping``, ``/health``, ``/version``), adaptive batching
(:mod:`raydeck.serving.batching`, sizes settable through the deployment's ``user_config``), and
following a registry alias. Does not own: building or deploying the application
(:mod:`raydeck.serving.app`) or the request format (:mod:`raydeck.serving.protocol`).

Why a replica follows its alias itself instead of being redeployed: a replica that loads the new
version beside the one it serves, checks it on the model's own input example, and only then swaps
one reference never fails a request, needs no driver to stay alive (``serve deploy`` on a
cluster has none), and keeps the version it has when the new one fails its check: that is the
rollback, with the refusal shown on ``/health``, logged, and counted, and not tried again until
the alias moves on.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from ray import serve

from raydeck._internal.pytorch_flavor import import_pytorch_flavor
from raydeck._internal.redaction import redact_text
from raydeck.models import ModelRef, resolve_model_uri
from raydeck.serving.batching import AdaptiveBatcher
from raydeck.serving.protocol import (
    JSON_TYPE,
    InputError,
    Parsed,
    TensorInput,
    UnsupportedMediaType,
    media_type,
    parse_json_object,
    parse_request,
    predictions_json,
    too_large,
)

if TYPE_CHECKING:
    from mlflow.exceptions import MlflowException
    from starlette.requests import Request
    from starlette.responses import Response

    from raydeck.config.settings import Settings
    from raydeck.serving.options import ServeOptions

logger = logging.getLogger(__name__)

VERSION_HEADER = "x-raydeck-model-version"
# The longest wait between tries of a version that failed to load transiently.
RETRY_MAX_S = 60.0


def _replica_id() -> str:
    """This replica's id in Serve (``/health`` shows it, so a client can tell replicas apart);
    empty when the class runs outside a Serve replica (in-process tests)."""
    from ray.serve.exceptions import RayServeException

    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except RayServeException:
        return ""


@dataclass(frozen=True)
class LoadedModel:
    """A loaded model version: what a batch is predicted with, swapped as one reference."""

    ref: ModelRef
    model: Any
    expected: TensorInput | None
    device: str | None

    @property
    def version(self) -> str:
        return self.ref.version or self.ref.uri

    def predict(self, rows: np.ndarray) -> np.ndarray:
        return np.asarray(self.model.predict(rows))


def model_device(model: Any) -> str | None:
    """Where a loaded pyfunc model predicts: its torch module's device (``cpu``, ``cuda:0``);
    None for a model that is not a torch module.

    MLflow's pytorch flavor loads onto CUDA whenever the process sees a GPU (a replica sees
    only the GPU Ray gave it, see :data:`~raydeck.serving.options.HIDE_UNASSIGNED_ACCELERATORS`)
    and moves each input there; this says which it chose.
    """
    try:
        raw = model.get_raw_model()
    except NotImplementedError:
        return None
    if not isinstance(raw, torch.nn.Module):
        return None
    tensor = next(itertools.chain(raw.parameters(), raw.buffers()), None)
    return str(tensor.device) if tensor is not None else None


class HealthCheckFailed(Exception):
    """A version that loaded but does not predict its own input example: refused for good (until
    the alias moves), unlike a failure to load, which may pass (see :func:`is_transient`)."""


def load(ref: ModelRef, settings: Settings) -> LoadedModel:
    """Load one version and check it predicts its own input example (its health check).

    Raises:
        HealthCheckFailed: it loaded, and predicting its input example raised or gave a wrong
            answer.
        Exception: whatever loading raised; the caller keeps its current model.
    """
    import mlflow.pyfunc

    from raydeck.storage import credentials_in_env

    # A pytorch-flavor model's loader is mlflow.pytorch: imported here without Lightning.
    import_pytorch_flavor()
    with credentials_in_env(settings.storage):
        mlflow.set_tracking_uri(settings.tracking.uri)
        model = mlflow.pyfunc.load_model(ref.pinned_uri)
    # A model with a params schema takes MLflow's own request handling, which checks and passes
    # the params; the tensor path ignores them, as MLflow does for a model without one.
    expected = (TensorInput.from_schema(model.metadata.get_input_schema())
                if model.metadata.get_params_schema() is None else None)
    loaded = LoadedModel(ref, model, expected, model_device(model))
    example = getattr(model, "input_example", None)
    if example is not None:
        try:
            answer = loaded.predict(np.asarray(example))
        except Exception as exc:
            raise HealthCheckFailed(f"predicting its input example raised {exc!r}") from exc
        if len(answer) != len(example) or not np.isfinite(answer.astype(float)).all():
            raise HealthCheckFailed(f"predicting its input example gave {answer!r}")
    return loaded


# MLflow's error codes for a server or store that may answer on a later try (its REST client
# raises INTERNAL_ERROR when the server is unreachable or answers 5xx).
_TRANSIENT_MLFLOW_CODES = frozenset({"INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE",
                                     "REQUEST_LIMIT_EXCEEDED", "DEADLINE_EXCEEDED"})


def is_transient(exc: BaseException) -> bool:
    """Whether loading may succeed on a later try: the network, a store or MLflow failed
    (an S3 blip, an MLflow timeout), not the model."""
    from mlflow.exceptions import MlflowException

    if isinstance(exc, (OSError, TimeoutError)):  # requests' and urllib3's errors are OSErrors
        return True
    if isinstance(exc, MlflowException):
        return exc.error_code in _TRANSIENT_MLFLOW_CODES
    # boto3's connection, timeout and throttling errors (S3 artifacts).
    return type(exc).__module__.startswith(("botocore", "urllib3")) and type(exc).__name__ in {
        "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
        "ConnectTimeoutError", "ProxyConnectionError", "ConnectionError", "HTTPClientError"}


@dataclass
class _Retry:
    """A version whose load failed transiently: when to try again."""

    attempts: int
    next_at: float
    reason: str


class ModelServer:
    """One replica of a served model (see the module docstring for the contract)."""

    def __init__(self, options: ServeOptions, settings: Settings | None = None) -> None:
        from raydeck.config.settings import load_settings
        from raydeck.observability.metrics import (
            SERVING_BAD_REQUESTS,
            SERVING_MODEL_UPDATES,
            SERVING_MODEL_VERSION,
            counter,
            gauge,
            zero_counter,
        )

        logging.getLogger("raydeck").setLevel(logging.INFO)
        self._options = options
        self._settings = settings or load_settings()
        self._replica = _replica_id()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="raydeck-predict")
        self._tags = {"app": options.name, "model": options.model_uri}
        self._version_gauge = gauge(SERVING_MODEL_VERSION)
        self._updates = counter(SERVING_MODEL_UPDATES)
        self._bad_requests = counter(SERVING_BAD_REQUESTS)
        for outcome in ("switched", "rejected"):
            zero_counter(SERVING_MODEL_UPDATES, {**self._tags, "outcome": outcome})
        zero_counter(SERVING_BAD_REQUESTS, self._tags)
        self._loaded = load(resolve_model_uri(options.model_uri, self._settings.tracking.uri),
                            self._settings)
        self._publish_version()
        self._rejected: dict[str, str] = {}
        self._retrying: dict[str, _Retry] = {}
        self._stop = threading.Event()
        self._batcher: AdaptiveBatcher[tuple[Parsed, LoadedModel], tuple[np.ndarray, str]] = \
            AdaptiveBatcher(self._predict_batch, 1)
        self.reconfigure(options.user_config())
        if options.follows_alias:
            threading.Thread(target=self._follow, name="raydeck-follow-alias",
                             daemon=True).start()

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's in-place update: new batch settings without restarting the replica."""
        self._max_batch_size = int(user_config["max_batch_size"])
        self._batcher.configure(self._max_batch_size, float(user_config["batch_wait_timeout_s"]))

    def check_health(self) -> None:
        """Serve's replica health check: a replica always holds a loaded model."""
        if self._loaded is None:
            raise RuntimeError("no model loaded")

    def describe(self) -> dict[str, Any]:
        """What this replica serves: ``raydeck serve status`` and ``/health`` show it."""
        loaded = self._loaded
        return {"replica": self._replica,
                "model_uri": self._options.model_uri, "version": loaded.ref.version,
                "pinned_uri": loaded.ref.pinned_uri, "run_id": loaded.ref.run_id,
                "device": loaded.device,
                "max_batch_size": self._max_batch_size, "in_batches": self._batcher.pending,
                "rejected": dict(self._rejected),
                "retrying": {version: f"attempt {retry.attempts}: {retry.reason}"
                             for version, retry in self._retrying.items()}}

    async def __call__(self, request: Request) -> Response:
        from starlette.responses import Response

        path = "/" + request.url.path.rstrip("/").rsplit("/", 1)[-1]
        method = "POST" if path == "/invocations" else "GET"
        if path not in ("/invocations", "/ping", "/health", "/version"):
            return _not_routed(404, "Not Found")
        if request.method != method:
            return _not_routed(405, "Method Not Allowed")
        if path != "/invocations":
            state = {"status": "ok", **self.describe()} if path != "/ping" else {"status": "ok"}
            return Response(json.dumps(state), media_type=JSON_TYPE)
        loaded = self._loaded
        content_type = request.headers.get("content-type")
        try:
            body = await _read_body(request, self._options.max_request_bytes)
            if loaded.expected is None:
                return await self._predict_other(loaded, body, content_type)
            parsed = parse_request(body, loaded.expected, self._options.max_request_bytes,
                                   content_type)
        except UnsupportedMediaType as exc:
            self._bad_requests.inc(1, self._tags)
            return Response(str(exc), status_code=415, media_type="text/plain")
        except InputError as exc:
            self._bad_requests.inc(1, self._tags)
            return _error(str(exc))
        if self._max_batch_size > 1:
            # The batch is predicted by the version this request was validated against, even
            # when the alias moves while it waits.
            predictions, version = await self._batcher.submit((parsed, loaded))
        else:
            predictions = await asyncio.get_running_loop().run_in_executor(
                self._executor, loaded.predict, parsed.rows)
            version = loaded.version
        return Response(predictions_json(predictions), media_type=JSON_TYPE,
                        headers={VERSION_HEADER: version})

    async def _predict_batch(self, requests: list[tuple[Parsed, LoadedModel]]
                             ) -> list[tuple[np.ndarray, str]]:
        """Predict the rows of every queued request in one call per model version (normally
        one); each request gets its own rows back, predicted by the version it was validated
        against."""
        answers: list[tuple[np.ndarray, str]] = [(np.empty(0), "")] * len(requests)
        by_version: dict[int, list[int]] = {}
        for index, (_, loaded) in enumerate(requests):
            by_version.setdefault(id(loaded), []).append(index)
        for indices in by_version.values():
            loaded = requests[indices[0]][1]
            rows = np.concatenate([requests[i][0].rows for i in indices])
            predictions = await asyncio.get_running_loop().run_in_executor(
                self._executor, loaded.predict, rows)
            ends = np.cumsum([len(requests[i][0].rows) for i in indices])
            for index, part in zip(indices, np.split(predictions, ends[:-1]), strict=True):
                answers[index] = (part, loaded.version)
        return answers

    async def _predict_other(self, loaded: LoadedModel, body: bytes,
                             content_type: str | None) -> Response:
        """A model without a 2-D tensor signature: MLflow's own request handling (content
        types, forms, ``params``, schema checks, the answer's shape), run beside the loop."""
        from mlflow.exceptions import MlflowException
        from mlflow.pyfunc.scoring_server import invocations
        from starlette.responses import Response

        # JSON is parsed here, so that what Python's parser raises besides a JSONDecodeError
        # (nesting too deep, an integer of too many digits) is a 400 too; MLflow takes the dict.
        data: bytes | dict[str, Any] = (parse_json_object(body)
                                        if media_type(content_type) == JSON_TYPE else body)
        try:
            answer = await asyncio.get_running_loop().run_in_executor(
                self._executor, invocations, data, content_type or JSON_TYPE, loaded.model,
                loaded.model.metadata.get_input_schema())
        except MlflowException as exc:
            if exc.get_http_status_code() < 500:
                self._bad_requests.inc(1, self._tags)
            return _error(exc)
        headers = {VERSION_HEADER: loaded.version} if answer.status == 200 else None
        return Response(answer.response, status_code=answer.status, media_type=answer.mimetype,
                        headers=headers)

    def _follow(self) -> None:
        """Poll the alias; load, check and swap in each new version it points to."""
        while not self._stop.wait(self._options.poll_interval_s):
            try:
                ref = resolve_model_uri(self._options.model_uri, self._settings.tracking.uri)
            except Exception as exc:
                # The registry is down or the alias was deleted: keep serving what we have.
                logger.warning("cannot resolve %s (%s); still serving version %s",
                               self._options.model_uri, _reason(exc), self._loaded.version)
                continue
            retry = self._retrying.get(str(ref.version))
            if (ref.version == self._loaded.ref.version or ref.version in self._rejected
                    or (retry is not None and time.monotonic() < retry.next_at)):
                continue
            self._switch(ref)

    def _switch(self, ref: ModelRef) -> None:
        """Load ``ref`` and swap it in; a transient failure is tried again with backoff (the
        replicas converge on the alias's version), any other is refused until the alias
        moves."""
        started = time.perf_counter()
        previous = self._loaded
        version = str(ref.version)
        try:
            self._loaded = load(ref, self._settings)
        except Exception as exc:
            reason = _reason(exc)
            if is_transient(exc):
                attempts = self._retrying[version].attempts + 1 if version in self._retrying else 1
                delay = min(RETRY_MAX_S, self._options.poll_interval_s * 2 ** attempts)
                self._retrying[version] = _Retry(attempts, time.monotonic() + delay, reason)
                logger.warning("%s moved to version %s, which could not be loaded (%s); trying "
                               "again in %.0f s, still serving version %s",
                               self._options.model_uri, version, reason, delay,
                               previous.version)
                return
            self._retrying.pop(version, None)
            self._rejected[version] = reason
            self._updates.inc(1, {**self._tags, "outcome": "rejected"})
            logger.error("%s moved to version %s, which failed its health check (%s); still "
                         "serving version %s", self._options.model_uri, version, reason,
                         previous.version)
            return
        self._retrying.pop(version, None)
        self._updates.inc(1, {**self._tags, "outcome": "switched"})
        self._publish_version()
        logger.info("%s: switched from version %s to %s in %.1f s", self._options.model_uri,
                    previous.version, ref.version, time.perf_counter() - started)

    def _publish_version(self) -> None:
        version = self._loaded.ref.version
        self._version_gauge.set(float(version) if version else 0.0, self._tags)

    def __del__(self) -> None:
        self._stop.set()


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body, refused once it passes ``max_bytes``: what is over the limit is read
    (a reply before the client finished sending makes Serve's proxy reset the connection
    instead of delivering the 400) but not kept.

    Raises:
        InputError: the body is over ``max_bytes``.
    """
    body = bytearray()
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= max_bytes:
            body += chunk
    if size > max_bytes:
        raise too_large(size, max_bytes)
    return bytes(body)


def _reason(exc: BaseException) -> str:
    """One line naming ``exc``, safe to log and to show on ``/health`` (MLflow's and boto's
    messages quote URIs, credentials included)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return redact_text(f"{type(exc).__name__}: {text}")


def _error(error: str | MlflowException) -> Response:
    """MLflow's scoring server's error answer, key for key: an ``MlflowException`` serialized
    without its stack trace (it names the replica's files and helps no client), or a message as
    the ``BAD_REQUEST`` MLflow raises for a request it cannot parse."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import BAD_REQUEST
    from starlette.responses import Response

    if isinstance(error, str):
        error = MlflowException(error, error_code=BAD_REQUEST)
    body = {key: value for key, value in json.loads(error.serialize_as_json()).items()
            if key != "stack_trace"}
    return Response(json.dumps(body), status_code=error.get_http_status_code(),
                    media_type=JSON_TYPE)


def _not_routed(status: int, detail: str) -> Response:
    """The answer ``mlflow models serve`` (FastAPI) gives a path it has no route for (404) or a
    route called with the wrong method (405), byte for byte."""
    from starlette.responses import JSONResponse

    return JSONResponse({"detail": detail}, status_code=status)
