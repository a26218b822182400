"""Object storage (MinIO or any S3): one configuration, derived for every tool that needs it.

Owns: turning :class:`~raydeck.config.settings.StorageSettings` into what each tool wants, so they
all reach the same buckets with the same credentials: the environment MLflow and boto3 read
(:func:`secret_env`), the pyarrow filesystem and storage path Ray Train's ``RunConfig`` takes
(:func:`checkpoint_storage`), and a ``minio.Minio`` client (:func:`minio_client`). Also owns
bucket bootstrap (:func:`init_buckets`), the preflight check a run does before it starts
(:func:`verify`), the storage rows of ``raydeck status`` (:func:`health`), and the one-line
errors that name the endpoint, the bucket and the access key id (never the secret).

Does not own: what a checkpoint holds (:mod:`raydeck.train.checkpointing`), where MLflow puts a
run's artifacts inside the artifacts bucket (MLflow does, under the experiment's artifact location
that :mod:`raydeck.config.settings` derives from these settings), or the S3 server itself.

Nothing here depends on which S3 server answers: production uses MinIO, tests use SeaweedFS.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import pyarrow.fs

from raydeck._internal.environ import environment
from raydeck._internal.redaction import redact_url
from raydeck.config.settings import Settings, StorageSettings
from raydeck.errors import StorageError

if TYPE_CHECKING:
    from minio import Minio

logger = logging.getLogger(__name__)

S3_CONNECT_TIMEOUT_S = 5.0
# How long a request may wait for the next bytes. The AWS SDK's default (3 s) is too short for
# a busy MinIO and costs a retry each time it trips.
S3_READ_TIMEOUT_S = 30.0
# Requests of raydeck's own checks (status, init, preflight) retry a little: a person is waiting.
CHECK_RETRIES = 2
CHECK_BACKOFF_S = 0.2
# Checkpoint traffic (Ray Train workers and controller) uses the AWS SDK's standard retry
# strategy: exponential backoff with full jitter, each wait capped at 20 s. Twelve attempts ride
# out an S3 outage of about two minutes (a MinIO restart) before an upload fails; after that
# Ray Train's FailureConfig restarts the workers from the last persisted checkpoint.
CHECKPOINT_S3_MAX_ATTEMPTS = 12
PROBE_KEY = ".raydeck-probe"
_CREDENTIAL_CODES = {
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
}


def secret_env(storage: StorageSettings) -> dict[str, str]:
    """Environment that lets MLflow, boto3, pyarrow and raydeck itself reach the bucket store.

    Holds the secret, so it goes only into the environment of processes raydeck starts or
    configures itself (the tracking proxy's actors, through their constructor), never into a
    Ray runtime env (Ray's runtime env agent logs those to disk), files, logs, MLflow params or
    tags. Empty when storage is not configured or this process lacks the secret.
    ``AWS_ENDPOINT_URL_S3`` makes plain ``s3://`` URIs (``ray.train.Checkpoint(uri)``,
    ``pyarrow.fs.FileSystem.from_uri``, boto3) resolve to the same endpoint without touching
    other AWS services a job may use.
    """
    if not storage.configured or not storage.secret_access_key:
        return {}
    return {
        "MLFLOW_S3_ENDPOINT_URL": storage.endpoint,
        "AWS_ENDPOINT_URL_S3": storage.endpoint,
        "AWS_ACCESS_KEY_ID": storage.access_key_id,
        "AWS_SECRET_ACCESS_KEY": storage.secret_access_key.reveal(),
        "AWS_DEFAULT_REGION": storage.region,
        "RAYDECK_S3_SECRET_ACCESS_KEY": storage.secret_access_key.reveal(),
    }


@contextlib.contextmanager
def credentials_in_env(storage: StorageSettings) -> Iterator[None]:
    """:func:`secret_env` in this process's environment for the block, restored after.

    For the driver-side MLflow calls that move artifacts themselves (``log_artifacts`` when a
    sweep registers its best model): MLflow's S3 artifact store reads its endpoint and
    credentials from the environment only. A no-op without storage or without the secret.
    """
    with environment(secret_env(storage)):
        yield


def _join(*parts: str) -> str:
    return "/".join(part.strip("/") for part in parts if part.strip("/"))


def artifacts_uri(storage: StorageSettings) -> str:
    """``s3://<artifacts bucket>/<prefix>``: where MLflow artifacts of raydeck's experiments go."""
    return f"s3://{_join(storage.artifacts_bucket, storage.prefix)}"


def checkpoints_uri(storage: StorageSettings) -> str:
    """``s3://<checkpoints bucket>/<prefix>``: Ray Train's storage path; one folder per run."""
    return f"s3://{_join(storage.checkpoints_bucket, storage.prefix)}"


def _host(storage: StorageSettings) -> str:
    """``host:port`` of the endpoint (the form minio and pyarrow take)."""
    return urlparse(storage.endpoint).netloc


# --- clients ---------------------------------------------------------------------------------
def minio_client(storage: StorageSettings) -> Minio:
    """A ``minio.Minio`` client for the configured endpoint and credentials.

    Connects within ``S3_CONNECT_TIMEOUT_S`` and retries a failed request ``CHECK_RETRIES``
    times (minio's own default waits five minutes to connect), so an unreachable endpoint is
    reported in seconds.

    Raises:
        StorageError: storage is not configured.
    """
    import certifi
    import urllib3
    from minio import Minio

    _require(storage)
    http = urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=S3_CONNECT_TIMEOUT_S, read=S3_READ_TIMEOUT_S),
        maxsize=10,
        cert_reqs="CERT_REQUIRED",
        ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
        retries=urllib3.Retry(total=CHECK_RETRIES, backoff_factor=CHECK_BACKOFF_S,
                              status_forcelist=[500, 502, 503, 504]),
    )
    return Minio(_host(storage), access_key=storage.access_key_id,
                 secret_key=storage.secret_access_key.reveal(), secure=storage.secure,
                 region=storage.region, http_client=http)


def _rebuild_filesystem(options: dict[str, Any], max_attempts: int) -> RetryingS3FileSystem:
    if "secret_key" not in options:
        secret = _own_secret(options)
        # pyarrow takes a key id only with its secret; without both it uses its default chain.
        options = ({**options, "secret_key": secret} if secret else
                   {k: v for k, v in options.items() if k != "access_key"})
    return RetryingS3FileSystem(max_attempts=max_attempts, **options)


def _own_secret(options: dict[str, Any]) -> str | None:
    """This process's secret for the endpoint and key id of a filesystem pickled without it
    (None if this process lacks it)."""
    from raydeck.config.settings import load_settings

    try:
        storage = load_settings().storage
    except Exception:
        return None
    if (storage.configured and storage.secret_access_key
            and _host(storage) == options.get("endpoint_override")
            and storage.access_key_id == options.get("access_key")):
        return storage.secret_access_key.reveal()
    return None


def _ray_is_transferring() -> bool:
    """Whether the pickling in progress is Ray moving an object to another process (a task or
    actor argument, an object put in the store), as opposed to pickling to a file."""
    try:
        import ray

        if not ray.is_initialized():
            return False
        context = ray._private.worker.global_worker.get_serialization_context()
        return bool(context.is_in_band_serialization())
    except Exception:
        return False


class RetryingS3FileSystem(pyarrow.fs.S3FileSystem):
    """pyarrow's ``S3FileSystem`` whose retry strategy survives pickling, and whose secret is
    never written to a file.

    pyarrow pickles an ``S3FileSystem`` without its ``retry_strategy``, so the copies Ray Train
    sends to its controller and workers would retry 3 times (about two seconds) and a short S3
    outage would fail the checkpoint upload. This subclass rebuilds itself with
    ``max_attempts`` wherever it is unpickled. Every call of Ray Train's storage goes through
    it: checkpoint uploads, the controller's checkpoint index, downloads on resume.

    Ray moves it to workers by pickling, secret included (in memory, never in a runtime env).
    Ray Tune also pickles it into its experiment state files (``tuner.pkl``,
    ``experiment_state-*.json``, in the bucket); pickled outside a Ray transfer it leaves the
    secret out, and where such a copy is unpickled it takes the secret from that process's own
    settings (a resumed driver has them; Tune replaces the filesystem of restored state anyway).
    """

    def __init__(self, max_attempts: int = CHECKPOINT_S3_MAX_ATTEMPTS, **options: Any) -> None:
        super().__init__(
            retry_strategy=pyarrow.fs.AwsStandardS3RetryStrategy(max_attempts=max_attempts),
            **options,
        )
        self._max_attempts = max_attempts
        self._options = options

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any], int]]:
        options = self._options
        if not _ray_is_transferring():
            options = {k: v for k, v in options.items() if k != "secret_key"}
        return _rebuild_filesystem, (options, self._max_attempts)


def s3_filesystem(storage: StorageSettings) -> RetryingS3FileSystem:
    """A pyarrow S3 filesystem for the configured endpoint, retrying through short outages.

    Raises:
        StorageError: storage is not configured.
    """
    _require(storage)
    return RetryingS3FileSystem(
        access_key=storage.access_key_id,
        secret_key=storage.secret_access_key.reveal(),
        region=storage.region,
        scheme="https" if storage.secure else "http",
        endpoint_override=_host(storage),
        connect_timeout=S3_CONNECT_TIMEOUT_S,
        request_timeout=S3_READ_TIMEOUT_S,
    )


@dataclass(frozen=True)
class CheckpointStorage:
    """Where Ray Train persists a run's checkpoints: what ``RunConfig`` takes, and its URI.

    ``storage_path`` is relative to ``filesystem`` (pyarrow's convention when a filesystem is
    given); ``uri`` is the same place as a user reads it (``s3://...`` or a local directory).
    """

    storage_path: str
    uri: str
    filesystem: pyarrow.fs.FileSystem | None = field(default=None, repr=False, compare=False)

    def run_config_kwargs(self) -> dict[str, Any]:
        """``storage_path`` and ``storage_filesystem`` for ``ray.train.RunConfig``."""
        return {"storage_path": self.storage_path, "storage_filesystem": self.filesystem}


def checkpoint_storage(settings: Settings) -> CheckpointStorage:
    """The checkpoint bucket when storage is configured, else ``<data_dir>/checkpoints``.

    A run's checkpoints land in ``<uri>/<run key>/epoch_<NNNNNN>``.
    """
    storage = settings.storage
    if not storage.configured:
        local = str(settings.data_dir / "checkpoints")
        return CheckpointStorage(storage_path=local, uri=local)
    return CheckpointStorage(
        storage_path=_join(storage.checkpoints_bucket, storage.prefix),
        uri=checkpoints_uri(storage),
        filesystem=s3_filesystem(storage),
    )


def checkpoint_at(settings: Settings, uri: str) -> Any:
    """The ``ray.train.Checkpoint`` at ``uri``, e.g. a run's ``raydeck.checkpoint.latest`` tag.

    An ``s3://`` URI is read with raydeck's storage settings (endpoint, credentials, retries),
    so it opens anywhere raydeck's settings are, not only where the AWS variables are set.
    """
    from ray.train import Checkpoint

    if uri.startswith("s3://") and settings.storage.configured:
        return Checkpoint(uri.removeprefix("s3://"), filesystem=s3_filesystem(settings.storage))
    return Checkpoint(uri)


# --- errors ----------------------------------------------------------------------------------
def _require(storage: StorageSettings) -> None:
    if not storage.configured:
        raise StorageError(
            f"object storage is not configured; set {StorageSettings.env_name('endpoint')}, "
            f"{StorageSettings.env_name('access_key_id')} and "
            f"{StorageSettings.env_name('secret_access_key')} (or [storage] in raydeck.toml)"
        )
    if not storage.secret_access_key:
        raise StorageError(
            f"{StorageSettings.env_name('secret_access_key')} is not set in this process "
            f"(endpoint {storage.endpoint}, access key id {storage.access_key_id}); set it "
            "where the driver runs: Ray workers never receive it through the runtime env"
        )


def _bucket_setting(storage: StorageSettings, bucket: str) -> str:
    name = "checkpoints_bucket" if bucket == storage.checkpoints_bucket else "artifacts_bucket"
    return StorageSettings.env_name(name)


def _storage_error(
    storage: StorageSettings, bucket: str | None, exc: BaseException
) -> StorageError:
    """One line saying what went wrong with ``bucket``, naming endpoint and access key id.

    Refused credentials, a missing bucket and an unreachable endpoint each get their own
    message and fix; the secret is never part of it. ``bucket=None`` names both buckets (the
    endpoint as a whole failed).
    """
    from minio.error import S3Error

    buckets = (f"bucket {bucket!r}" if bucket else
               f"buckets {storage.artifacts_bucket!r} and {storage.checkpoints_bucket!r}")
    where = f"({buckets}, access key id {storage.access_key_id!r})"
    if isinstance(exc, S3Error):
        if exc.code in _CREDENTIAL_CODES:
            return StorageError(
                f"S3 at {storage.endpoint} refused the credentials {where}: {exc.code}; fix "
                f"{StorageSettings.env_name('access_key_id')} / "
                f"{StorageSettings.env_name('secret_access_key')}"
            )
        if exc.code == "NoSuchBucket" and bucket:
            return _missing_bucket_error(storage, bucket)
        return StorageError(f"S3 at {storage.endpoint} answered {exc.code} {where}: "
                            f"{_first_line(exc.message or '')}")
    return StorageError(
        f"S3 endpoint {storage.endpoint} is unreachable {where}: {_reason(exc)}; start it or "
        f"fix {StorageSettings.env_name('endpoint')}"
    )


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:200] if text.strip() else ""


def _reason(exc: BaseException) -> str:
    """The root cause of a connection failure, without urllib3's object reprs."""
    import urllib3

    if isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason is not None:
        exc = exc.reason
    text = re.sub(r"^<[^>]+>:\s*", "", _first_line(str(exc)))
    return text or type(exc).__name__


def _missing_bucket_error(storage: StorageSettings, bucket: str) -> StorageError:
    return StorageError(
        f"S3 bucket {bucket!r} does not exist at {storage.endpoint} (access key id "
        f"{storage.access_key_id!r}); create it with `raydeck storage init` or fix "
        f"{_bucket_setting(storage, bucket)}"
    )


def _check_reachable(storage: StorageSettings) -> None:
    """Fail fast, without retries, when nothing listens at the endpoint."""
    parsed = urlparse(storage.endpoint)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=S3_CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise _storage_error(storage, None, exc) from None


# --- checks and bootstrap ----------------------------------------------------------------------
@dataclass(frozen=True)
class BucketReport:
    """What :func:`init_buckets` or :func:`verify` found for one bucket."""

    role: str
    bucket: str
    uri: str
    created: bool = False
    probe: str = ""


def _roles(storage: StorageSettings) -> list[tuple[str, str, str]]:
    return [("artifacts", storage.artifacts_bucket, artifacts_uri(storage)),
            ("checkpoints", storage.checkpoints_bucket, checkpoints_uri(storage))]


def verify(storage: StorageSettings) -> list[BucketReport]:
    """Check that the endpoint answers, accepts the credentials and has both buckets.

    A no-op returning ``[]`` when storage is not configured. Runs before a training run starts,
    so a wrong secret or a missing bucket stops it at once with one line, not minutes later in
    a worker's traceback.

    Raises:
        StorageError: unreachable endpoint, refused credentials or a missing bucket.
    """
    if not storage.configured:
        return []
    _check_reachable(storage)
    client = minio_client(storage)
    reports = []
    for role, bucket, uri in _roles(storage):
        try:
            exists = client.bucket_exists(bucket)
        except Exception as exc:
            raise _storage_error(storage, bucket, exc) from None
        if not exists:
            raise _missing_bucket_error(storage, bucket)
        reports.append(BucketReport(role=role, bucket=bucket, uri=uri))
    return reports


def _probe(client: Minio, storage: StorageSettings, bucket: str) -> str:
    """Write, read back and delete a small object under the prefix; describes what worked."""
    key = _join(storage.prefix, f"{PROBE_KEY}-{uuid.uuid4().hex[:12]}")
    payload = uuid.uuid4().bytes
    client.put_object(bucket, key, io.BytesIO(payload), len(payload))
    answer = client.get_object(bucket, key)
    try:
        read = answer.read()
    finally:
        answer.close()
        answer.release_conn()
    client.remove_object(bucket, key)
    if read != payload:
        raise StorageError(f"S3 at {storage.endpoint} returned different bytes for the probe "
                           f"object {bucket}/{key} than were written")
    return "write, read, delete ok"


def init_buckets(storage: StorageSettings, *, probe: bool = True) -> list[BucketReport]:
    """Create the artifacts and checkpoints buckets if missing, then probe each one.

    Idempotent: an existing bucket is left as it is, and the probe object is deleted again, so
    a second call changes nothing.

    Raises:
        StorageError: storage is not configured, the endpoint is unreachable, the credentials
            are refused or may not create buckets, or the probe fails.
    """
    from minio.error import S3Error

    _require(storage)
    _check_reachable(storage)
    client = minio_client(storage)
    reports = []
    for role, bucket, uri in _roles(storage):
        try:
            created = False
            if not client.bucket_exists(bucket):
                try:
                    client.make_bucket(bucket, location=storage.region)
                    created = True
                    logger.info("created bucket %s at %s", bucket,
                                redact_url(storage.endpoint))
                except S3Error as exc:
                    # Another process created it between our check and our call.
                    if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                        raise
            outcome = _probe(client, storage, bucket) if probe else ""
        except StorageError:
            raise
        except Exception as exc:
            raise _storage_error(storage, bucket, exc) from None
        reports.append(BucketReport(role=role, bucket=bucket, uri=uri, created=created,
                                    probe=outcome))
    return reports


def health(storage: StorageSettings) -> tuple[list[tuple[str, str, str]], str | None]:
    """Rows for ``raydeck status`` about object storage, and an error line if it is unusable.

    Checks what a run needs: the endpoint answers, the credentials are accepted and both
    buckets exist (see :func:`verify`).
    """
    if not storage.configured:
        return [("storage", "not configured", "artifacts and checkpoints on local disk")], None
    try:
        reports = verify(storage)
    except StorageError as exc:
        return [("storage", storage.endpoint, "[red]unusable[/]")], str(exc)
    rows = [("storage", storage.endpoint,
             f"reachable, credentials of {storage.access_key_id!r} accepted")]
    rows += [(f"bucket {r.bucket}", "exists", f"{r.role}: {r.uri}") for r in reports]
    return rows, None
