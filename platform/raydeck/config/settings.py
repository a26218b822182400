"""raydeck's settings: one frozen object, read from ``RAYDECK_*`` variables and ``raydeck.toml``.

This module is also the registry of every ``RAYDECK_*`` variable: each field below declares its
variable (derived from the section's prefix and the field name), type, default and a one-line doc.
``raydeck config --markdown`` renders the table README shows, and a test keeps the two equal.
How a declared field becomes its variable and TOML key, and how their text becomes the field's
type, is :mod:`raydeck.config.sections`'s; this module says which settings exist, validates
them and reads them in order of precedence.

Precedence: environment variable > ``raydeck.toml`` (``$RAYDECK_CONFIG`` or ``./raydeck.toml``) >
the running stack's connection file (``raydeck up``; ``$RAYDECK_STACK_FILE``, see
:mod:`raydeck.config.stack_connection`) > default. Defaults make the embedded mode work with nothing
set: a local Ray instance, an MLflow SQLite file and artifacts under ``./.raydeck/``.

The ecosystem's own variables count as well, below raydeck's explicit settings: the tracking URI
is ``RAYDECK_TRACKING_URI`` > ``raydeck.toml`` ``[tracking].uri`` > ``MLFLOW_TRACKING_URI``
(MLflow's variable, which every MLflow user already has) > the stack's > the embedded SQLite
file. ``MLFLOW_TRACKING_URI`` wins over the stack as ``RAY_ADDRESS`` wins over the stack's Ray
address: a process told where its server is keeps it. An empty value counts as unset. A
``raydeck`` MLflow URI (the MLflow plugin's, :mod:`raydeck.config.tracking_uri`) names raydeck's
backend: ``raydeck://`` counts as unset, ``raydeck+http://host`` as ``http://host``.
:func:`load_settings_with_origins` says which source each value came from (``raydeck config``
shows it).

Every value is validated once, at load, and a bad one raises
:class:`~raydeck.errors.ConfigError` naming the variable, the TOML key and what is accepted.
Secrets are :class:`~raydeck.config.secrets.Secret` objects whose ``repr``/``str`` never show the
value.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

from raydeck._internal.redaction import redact_env, redact_value
from raydeck.config.secrets import Secret
from raydeck.config.sections import Section, build_section, format_value, setting
from raydeck.config.stack_connection import MLFLOW_TRACKING_URI_ENV, settings_document
from raydeck.config.tracking_uri import unwrap_tracking_uri
from raydeck.errors import ConfigError

CONFIG_FILE_ENV = "RAYDECK_CONFIG"
DEFAULT_CONFIG_FILE = "raydeck.toml"
# Where a setting's value came from, as load_settings_with_origins names it (a raydeck.toml
# value is named by its file's path, MLFLOW_TRACKING_URI by its name).
ORIGIN_ENVIRONMENT = "environment"
ORIGIN_STACK = "stack file"
ORIGIN_DEFAULT = "default"

TrackingMode = Literal["rank_zero", "all_ranks", "per_rank"]
NonFinitePolicy = Literal["keep", "error"]
SystemMetricsPolicy = Literal["auto", "on", "off"]

RUN_KEY_PATTERN = re.compile(r"^[\w.\-]{1,128}$")
_URI_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "http", "https", "file", "databricks")


def tracking_uri_problem(uri: str) -> str | None:
    """Why raydeck cannot track to ``uri`` (a non-empty tracking URI), or None if it can.

    The rule is the same wherever the URI comes from (``RAYDECK_TRACKING_URI``, raydeck.toml,
    ``MLFLOW_TRACKING_URI``), so each source's error can name its own variable.
    """
    if not re.match(rf"^({'|'.join(_URI_SCHEMES)})(\+\w+)?:", uri):
        return f"must be a URI with one of the schemes {', '.join(_URI_SCHEMES)}"
    if uri.startswith("file:"):
        return ("MLflow's file store cannot tell a refused value from a failure and keeps "
                "repeated points, so raydeck cannot promise exactly-once delivery to it; use a "
                "SQL store instead, e.g. sqlite:////path/to/mlflow.db (or leave it empty for "
                "the embedded default)")
    return None


@dataclass(frozen=True)
class TrackingSettings(Section):
    """The tracking proxy and the MLflow server it writes to."""

    ENV_PREFIX: ClassVar[str] = "RAYDECK_TRACKING_"
    TOML_TABLE: ClassVar[str] = "tracking"

    uri: str = setting(
        "", "MLflow tracking URI; empty: MLFLOW_TRACKING_URI, else sqlite:///<data_dir>/mlflow.db")
    artifact_location: str = setting(
        "", "Artifact root for experiments raydeck creates; empty: S3 if configured, else local"
    )
    write_db: Secret = setting(
        Secret(), "An http(s) uri's own database: the proxy writes runs and values to it directly "
        "(the server's auth and plugins never see them); set on the head only, never shown")
    experiment: str = setting("raydeck", "MLflow experiment for runs that name none")
    enabled: bool = setting(True, "false turns every tracker into a no-op")
    mode: str = setting("rank_zero", "rank_zero, all_ranks or per_rank")
    shards: int = setting(1, "Writer shard actors behind the router (one takes ~700 ranks)")
    writers: int = setting(
        4, "MLflow writer threads per shard (1 for a sqlite: URI, which takes one writer)")
    flush_interval_s: float = setting(0.2, "How often a worker's buffer is sent to its shard")
    max_batch_points: int = setting(
        20000, "Points per batch a worker sends; it sends early once its buffer holds this many")
    max_buffer_points: int = setting(
        500000, "A worker's buffer limit in points; a full buffer makes log calls wait")
    max_buffer_mb: float = setting(
        256.0, "A worker's buffer limit in MiB (points, params, tags, console text)")
    buffer_full_wait_s: float = setting(
        30.0, "How long a log call waits for room in a full buffer before it drops and counts")
    spool_fsync: bool = setting(False, "fsync the spool on every batch (survives a power cut)")
    finish_timeout_s: float = setting(60.0, "finish() waits this long for data to land")
    lost_after_s: float = setting(60.0, "A process silent this long is presumed dead")
    heartbeat_interval_s: float = setting(
        5.0, "How often a process tells the proxy it lives; Ray is asked about one silent 2.5x")
    mlflow_timeout_s: int = setting(
        20, "Seconds an MLflow request of the proxy may take before it fails and is retried")
    retry_max_s: float = setting(
        5.0, "Longest wait between two tries of a failed write (backoff doubles up to it)")
    idle_timeout_s: float = setting(900.0, "The proxy stops itself after this long with no work")
    system_metrics: str = setting(
        "auto", "auto: raydeck's trackers sample system metrics, runs of MLflow's API through a "
        "raydeck URI only when MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING is on; on: both; off: none")
    system_metrics_interval_s: float = setting(10.0, "System metrics sampling period; 0 is off")
    capture_logs: bool = setting(
        True, "Upload each rank's stdout/stderr as logs/rank_<i>/part-<id>.txt")
    nonfinite: str = setting(
        "keep", "NaN/inf metric values: keep (stored as MLflow stores them) or error (reject)")
    cross_rank_stats: bool = setting(
        True, "all_ranks mode: also write <key>/mean, /min, /max and /straggler_rank per step")

    def __post_init__(self) -> None:
        problem = tracking_uri_problem(self.uri) if self.uri else None
        if problem:
            raise self._reject("uri", problem)
        self._check_write_db()
        if self.mode not in get_args(TrackingMode):
            raise self._reject("mode", f"must be one of {', '.join(get_args(TrackingMode))}")
        if self.nonfinite not in get_args(NonFinitePolicy):
            raise self._reject("nonfinite", "must be 'keep' or 'error'")
        if not self.experiment.strip():
            raise self._reject("experiment", "must not be empty")
        if self.shards < 1 or self.shards > 64:
            raise self._reject("shards", "must be between 1 and 64")
        for name in ("max_batch_points", "max_buffer_points", "writers"):
            if getattr(self, name) < 1:
                raise self._reject(name, "must be >= 1")
        if self.max_buffer_points < self.max_batch_points:
            raise self._reject("max_buffer_points", "must be >= max_batch_points")
        if self.max_buffer_mb <= 0:
            raise self._reject("max_buffer_mb", "must be > 0")
        if self.buffer_full_wait_s < 0:
            raise self._reject("buffer_full_wait_s", "must be >= 0 seconds")
        for name in ("flush_interval_s", "finish_timeout_s", "lost_after_s", "idle_timeout_s",
                     "heartbeat_interval_s", "retry_max_s"):
            if getattr(self, name) <= 0:
                raise self._reject(name, "must be > 0 seconds")
        if self.mlflow_timeout_s < 1:  # MLflow reads MLFLOW_HTTP_REQUEST_TIMEOUT as whole seconds
            raise self._reject("mlflow_timeout_s", "must be >= 1 (whole seconds)")
        if self.system_metrics not in get_args(SystemMetricsPolicy):
            raise self._reject("system_metrics",
                               f"must be one of {', '.join(get_args(SystemMetricsPolicy))}")
        if self.system_metrics_interval_s < 0:
            raise self._reject("system_metrics_interval_s", "must be >= 0 (0 turns it off)")

    def _check_write_db(self) -> None:
        """``write_db`` names a database, and only for an http(s) server (a database ``uri`` is
        written to directly already). Its value is never in the message."""
        db = self.write_db.reveal()
        if not db:
            return
        if not re.match(r"^(sqlite|postgresql|mysql|mssql)(\+\w+)?://", db):
            raise self._reject("write_db", "must be the MLflow server's database URI "
                               "(sqlite:///, postgresql://, mysql:// or mssql://)")
        if self.uri and not re.match(r"^https?://", self.uri):
            raise self._reject("write_db", "applies only when uri is an http(s) MLflow server; "
                               "with a database uri the proxy writes to it directly: unset it")


@dataclass(frozen=True)
class StorageSettings(Section):
    """S3-compatible object storage (MinIO in production) for artifacts and checkpoints."""

    ENV_PREFIX: ClassVar[str] = "RAYDECK_S3_"
    TOML_TABLE: ClassVar[str] = "storage"

    endpoint: str = setting("", "S3 endpoint URL, e.g. http://minio:9000; empty: no S3")
    region: str = setting("us-east-1", "S3 region")
    access_key_id: str = setting("", "S3 access key id")
    secret_access_key: Secret = setting(Secret(), "S3 secret key (never printed or logged)")
    artifacts_bucket: str = setting("mlflow", "Bucket for MLflow artifacts")
    checkpoints_bucket: str = setting("checkpoints", "Bucket for Ray Train checkpoints")
    prefix: str = setting("raydeck", "Key prefix inside both buckets")

    def __post_init__(self) -> None:
        if self.endpoint and not re.match(r"^https?://[^/\s]+/?$", self.endpoint):
            raise self._reject("endpoint", "must look like http(s)://host:port")
        # The secret is not required here: Ray workers get the endpoint and key id through the
        # job's runtime env but never the secret (Ray logs runtime envs to disk); operations
        # that need it check for it (raydeck.storage).
        if self.endpoint and not self.access_key_id:
            raise self._reject("endpoint", "needs RAYDECK_S3_ACCESS_KEY_ID as well")
        bucket_rule = r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$"
        for name in ("artifacts_bucket", "checkpoints_bucket"):
            if not re.match(bucket_rule, getattr(self, name)):
                raise self._reject(name, "must be a valid S3 bucket name (3-63 of a-z 0-9 . -)")
        if self.prefix.startswith("/") or self.prefix.endswith("/"):
            raise self._reject("prefix", "must not start or end with '/'")
        if not self.region.strip():
            raise self._reject("region", "must not be empty (MinIO's default is us-east-1)")

    @property
    def configured(self) -> bool:
        return bool(self.endpoint)

    @property
    def secure(self) -> bool:
        return self.endpoint.startswith("https://")


@dataclass(frozen=True)
class Settings(Section):
    """All of raydeck's settings. Build with :func:`load_settings`; never mutate."""

    data_dir: Path = setting(Path(".raydeck"), "Where embedded MLflow, spool and checkpoints live")
    ray_address: str = setting("", "Ray cluster: empty/auto (find or start), local, host:port")
    ray_namespace: str = setting("raydeck", "Ray namespace of raydeck's named actors")
    presets_file: str = setting("", "YAML/TOML file with extra scaling presets")
    run_id: str = setting("", "Shared run id: processes with the same value log to one run")
    log_level: str = setting("INFO", "Log level of raydeck's loggers")
    train_poll_interval_s: float = setting(
        0.5, "Ray Train's worker poll (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S; Ray's default is 2)"
    )
    queue_tick_s: float = setting(
        2.0, "How often the job queue checks its jobs and starts what fits (seconds)"
    )
    tracking: TrackingSettings = field(default_factory=TrackingSettings)
    storage: StorageSettings = field(default_factory=StorageSettings)

    def __post_init__(self) -> None:
        address = self.ray_address
        if address and address not in ("auto", "local") and not re.match(
            r"^(ray://|https?://)?[\w.\-]+:\d+$", address
        ):
            raise self._reject("ray_address", "must be empty, auto, local or host:port")
        if not re.match(r"^[\w.\-]+$", self.ray_namespace):
            raise self._reject("ray_namespace", "may only hold letters, digits, _ . -")
        if self.run_id and not RUN_KEY_PATTERN.match(self.run_id):
            raise self._reject("run_id", "may hold 1-128 letters, digits, _ . - only")
        if not 0 < self.train_poll_interval_s <= 60:
            raise self._reject("train_poll_interval_s", "must be > 0 and <= 60 seconds")
        if not 0 < self.queue_tick_s <= 60:
            raise self._reject("queue_tick_s", "must be > 0 and <= 60 seconds")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise self._reject("log_level", "must be DEBUG, INFO, WARNING or ERROR")

    def to_env(self) -> dict[str, str]:
        """Every non-secret setting as ``RAYDECK_*`` variables, for Ray runtime envs.

        Values are the resolved ones (absolute data dir, concrete tracking URI), so a worker on
        another node reads exactly what the driver read. Secrets are left out: they travel through
        :func:`raydeck.storage.secret_env`, which callers add only where a process needs them.
        Credentials inside values are removed too (:func:`raydeck._internal.redaction.redact_env`):
        the tracking URI comes without its user-info, because workers reach MLflow only through the
        tracking proxy, which gets the full URI from the process that creates it.
        """
        env: dict[str, str] = {}
        for section, obj in _sections(self):
            for f in dataclasses.fields(obj):
                if f.name in ("tracking", "storage"):
                    continue
                value = getattr(obj, f.name)
                if isinstance(value, Secret):
                    continue
                env[section.env_name(f.name)] = format_value(value)
        return redact_env(env)


def _sections(settings: Settings) -> list[tuple[type[Section], Any]]:
    return [
        (Settings, settings),
        (TrackingSettings, settings.tracking),
        (StorageSettings, settings.storage),
    ]


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror})") from None


def load_settings(
    env: Mapping[str, str] | None = None, config_file: str | Path | None = None
) -> Settings:
    """Read settings from ``env`` (default ``os.environ``), the TOML file and the running
    stack's connection file, validated.

    Args:
        env: variables to read instead of ``os.environ`` (tests, runtime envs).
        config_file: TOML file; default ``$RAYDECK_CONFIG`` or ``./raydeck.toml`` if present.

    Returns:
        The resolved settings: ``data_dir`` absolute, ``tracking.uri`` and
        ``tracking.artifact_location`` concrete.

    Raises:
        ConfigError: a value is malformed or a key unknown; the message names it (and names
            ``MLFLOW_TRACKING_URI`` when the tracking URI came from it).
    """
    return load_settings_with_origins(env, config_file)[0]


def load_settings_with_origins(
    env: Mapping[str, str] | None = None, config_file: str | Path | None = None
) -> tuple[Settings, dict[str, str]]:
    """:func:`load_settings`, and where each value came from.

    Returns:
        The settings, and for every variable of :func:`settings_reference` its origin:
        :data:`ORIGIN_ENVIRONMENT`, the path of the raydeck.toml that set it,
        :data:`MLFLOW_TRACKING_URI_ENV` (the tracking URI only), :data:`ORIGIN_STACK` or
        :data:`ORIGIN_DEFAULT`.

    Raises:
        ConfigError: as :func:`load_settings`.
    """
    env = os.environ if env is None else env
    path = config_file or env.get(CONFIG_FILE_ENV)
    user: dict[str, Any] = {}
    user_origin = DEFAULT_CONFIG_FILE
    if path:
        if not Path(path).is_file():
            raise ConfigError(f"{CONFIG_FILE_ENV} = {str(path)!r}: no such file")
        user, user_origin = _read_toml(Path(path)), str(path)
    elif Path(DEFAULT_CONFIG_FILE).is_file():
        user = _read_toml(Path(DEFAULT_CONFIG_FILE))
    stack = _stack_document(env)
    document = _under(stack, user)

    tables = {}
    for section in (TrackingSettings, StorageSettings):
        table = document.get(section.TOML_TABLE, {})
        if not isinstance(table, dict):
            raise ConfigError(f"raydeck.toml: [{section.TOML_TABLE}] must be a table")
        tables[section.TOML_TABLE] = build_section(section, env, table, {})
    top = {k: v for k, v in document.items() if k not in tables}
    settings: Settings = build_section(Settings, env, top, tables)
    origins = {
        section.env_name(f.name): _origin(section, f.name, env, (user_origin, user),
                                          (ORIGIN_STACK, stack))
        for section, obj in _sections(settings) for f in dataclasses.fields(obj)
        if f.name not in ("tracking", "storage")
    }
    mlflow_uri = unwrap_tracking_uri(env.get(MLFLOW_TRACKING_URI_ENV, "").strip())
    if mlflow_uri and not settings.tracking.uri:
        problem = tracking_uri_problem(mlflow_uri)
        if problem:
            raise ConfigError(
                f"{MLFLOW_TRACKING_URI_ENV} = {redact_value(MLFLOW_TRACKING_URI_ENV, mlflow_uri)!r}"
                f" (raydeck's tracking URI, as RAYDECK_TRACKING_URI is not set): {problem}; or "
                "set RAYDECK_TRACKING_URI (raydeck.toml [tracking].uri) for raydeck alone"
            )
        settings = dataclasses.replace(
            settings, tracking=dataclasses.replace(settings.tracking, uri=mlflow_uri))
        origins[TrackingSettings.env_name("uri")] = MLFLOW_TRACKING_URI_ENV
    return _resolve(settings), origins


def _origin(section: type[Section], name: str, env: Mapping[str, str],
            *documents: tuple[str, Mapping[str, Any]]) -> str:
    """Where ``name`` of ``section`` was read from: the environment, the first of ``documents``
    (label, raydeck.toml-shaped document; highest precedence first) that sets it, or default.
    An empty value counts as set here; :func:`load_settings_with_origins` handles the one
    setting whose empty value defers to another variable (the tracking URI).
    """
    if section.env_name(name) in env:
        return ORIGIN_ENVIRONMENT
    for label, document in documents:
        table = document.get(section.TOML_TABLE, {}) if section.TOML_TABLE else document
        if isinstance(table, dict) and name in table:
            return label
    return ORIGIN_DEFAULT


def _resolve(settings: Settings) -> Settings:
    """Fill the defaults that depend on other settings, so every consumer sees final values."""
    data_dir = settings.data_dir.expanduser().resolve()
    tracking = settings.tracking
    uri = tracking.uri or f"sqlite:///{data_dir / 'mlflow.db'}"
    artifact_location = tracking.artifact_location
    if not artifact_location:
        if settings.storage.configured:
            storage = settings.storage
            artifact_location = "s3://" + "/".join(
                part for part in (storage.artifacts_bucket, storage.prefix, "mlflow") if part
            )
        elif not uri.startswith(("http://", "https://", "databricks")):
            artifact_location = (data_dir / "mlartifacts").as_uri()
    tracking = dataclasses.replace(tracking, uri=uri, artifact_location=artifact_location)
    return dataclasses.replace(settings, data_dir=data_dir, tracking=tracking)


def settings_reference() -> list[tuple[str, str, str, str]]:
    """(variable, TOML key, default, doc) for every setting, in declaration order."""
    rows = []
    for section in (Settings, TrackingSettings, StorageSettings):
        for f in dataclasses.fields(section):
            if f.name in ("tracking", "storage"):
                continue
            default = f.default if f.default is not dataclasses.MISSING else ""
            shown = "" if isinstance(default, Secret) else format_value(default)
            rows.append((section.env_name(f.name), section.toml_key(f.name), shown,
                         f.metadata["doc"]))
    return rows


def settings_markdown() -> str:
    """The settings table of docs/reference.md, rendered from this registry."""
    lines = ["| Variable | raydeck.toml key | Default | Meaning |", "|---|---|---|---|"]
    for var, key, default, doc in settings_reference():
        lines.append(f"| `{var}` | `{key}` | {f'`{default}`' if default else '(empty)'} | {doc} |")
    return "\n".join(lines)


def _stack_document(env: Mapping[str, str]) -> dict[str, Any]:
    """The running stack's settings (``raydeck up``), in raydeck.toml's shape; ``{}`` if none."""
    return settings_document(env)


def _under(lower: Mapping[str, Any], upper: Mapping[str, Any]) -> dict[str, Any]:
    """``upper`` (raydeck.toml) over ``lower`` (the stack), table by table."""
    merged: dict[str, Any] = dict(lower)
    for key, value in upper.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged
