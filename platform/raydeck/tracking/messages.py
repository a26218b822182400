"""What travels between a tracker, the router and the shards.

Plain dataclasses, pickled by Ray. Kept in one module so the three sides cannot drift apart.
A metric point is the tuple ``(key, value, timestamp_ms, step)``: tuples pickle several times
faster than objects, and points are the bulk of every batch.

Everything a shard writes is addressed by raydeck's *run key* (a shared ``RAYDECK_RUN_ID``, a
generated ``run-<hex>``, ``<key>.rank_<i>`` for a per-rank child), never by MLflow's run id: the
shard creates or finds the MLflow run itself, when MLflow answers, so attaching and logging work
while MLflow is down (:class:`OpenRun`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

Point = tuple[str, float, int, int]


@dataclass(frozen=True)
class ProcessInfo:
    """Who is logging: enough to label values and to recognise a restarted process.

    ``role_key`` is stable across restarts of the same logical process (rank 1 of Train run X in
    job J), so a restarted worker replaces its dead predecessor instead of joining beside it.
    ``actor_id`` (Ray actors: Train workers, Tune trials) lets the router ask Ray whether the
    process still lives instead of guessing from silence.
    """

    role: str
    role_key: str
    job_id: str | None
    node_ip: str
    hostname: str
    pid: int
    world_rank: int | None = None
    local_rank: int | None = None
    node_rank: int | None = None
    world_size: int | None = None
    train_run_name: str | None = None
    trial_id: str | None = None
    actor_id: str | None = None

    @property
    def is_primary_candidate(self) -> bool:
        """A driver, a Tune trial or rank 0 may own a run; other ranks only join one."""
        return self.world_rank in (None, 0)


@dataclass(frozen=True)
class AttachRequest:
    """A tracker asking the router for the run it should write to.

    ``guest``: the process only writes to an existing run by its id (``run_key``) and takes no
    part in its life: it never becomes primary, never holds the run open nor reopens it, and
    sends no heartbeats; each of its writes is handed to the proxy before the call returns.
    """

    client_id: str
    process: ProcessInfo
    tracking_uri: str
    run_key: str | None
    run_name: str | None
    experiment: str
    mode: str
    parent_key: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    guest: bool = False


@dataclass(frozen=True)
class OpenRun:
    """Create the MLflow run for ``key``, or find and reopen it (tag ``raydeck.run_key``).

    Idempotent, so the router may send it again after a restart. A shard handles it before any
    other data of the run, retrying while MLflow is down; ``parent_key`` is resolved to the
    parent's MLflow run id at that moment (``mlflow.parentRunId``).
    """

    key: str
    name: str
    experiment: str
    artifact_location: str
    mode: str
    tags: dict[str, str] = field(default_factory=dict)
    parent_key: str | None = None


@dataclass(frozen=True)
class RunBinding:
    """The router's answer: where this tracker's values go and what role it plays.

    ``run_key`` receives this tracker's metrics, tags and artifacts (a per-rank child's key in
    ``per_rank`` mode); ``params_run_key`` receives params and console logs (the run itself).
    ``run_id`` is MLflow's id when the run already exists there, else empty until the shard
    created it (ask the shard: ``resolve``).
    """

    run_key: str
    params_run_key: str
    run_id: str
    experiment: str
    run_name: str
    mode: str
    shard_index: int
    is_primary: bool
    created: bool
    resumed: bool
    sample_system: bool
    active: bool = True
    existing_params: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FileRef:
    """An artifact file already streamed into a shard's spool (``upload_id``).

    ``artifact_dir`` is the directory under the run's artifact root ("" for the root) and
    ``name`` the file's name there: one path component, never ``.``, ``..`` or holding ``/``.
    """

    upload_id: str
    artifact_dir: str
    name: str
    size: int


@dataclass(frozen=True)
class DatasetRef:
    """A dataset input, as MLflow's ``log_inputs`` records it (name, digest, source, schema)."""

    name: str
    digest: str
    source_type: str
    source: str
    schema: str = ""
    profile: str = ""
    context: str = ""
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class Batch:
    """One flush of one tracker. ``(client_id, seq)`` makes re-delivery idempotent.

    ``points``, ``tags``, ``files`` and ``inputs`` go to ``run_key``; ``params`` and ``logs`` to
    ``params_run_key``. ``rank_of`` is ``(rank, world_size)`` in ``all_ranks`` mode, so the shard
    can derive the cross-rank views of ``points`` keyed ``<key>/rank_<rank>``.
    """

    client_id: str
    seq: int
    run_key: str
    params_run_key: str
    points: list[Point] = field(default_factory=list)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    files: list[FileRef] = field(default_factory=list)
    inputs: list[DatasetRef] = field(default_factory=list)
    # (log file name, text) console output for logs/<name>/ of params_run_key.
    logs: list[tuple[str, str]] = field(default_factory=list)
    rank_of: tuple[int, int] | None = None

    def is_empty(self) -> bool:
        return not (self.points or self.params or self.tags or self.files or self.inputs
                    or self.logs)

    def size(self) -> int:
        """Entities in the batch, the unit the proxy's metrics count."""
        return (len(self.points) + len(self.params) + len(self.tags) + len(self.files)
                + len(self.inputs))


@dataclass(frozen=True)
class Pending:
    """What a shard has accepted for a run but not yet written to MLflow."""

    points: int = 0
    params: int = 0
    tags: int = 0
    files: int = 0
    log_bytes: int = 0
    other: int = 0
    last_error: str = ""

    @property
    def empty(self) -> bool:
        return not (self.points or self.params or self.tags or self.files or self.log_bytes
                    or self.other)

    def describe(self) -> str:
        parts = [
            f"{n} {what}"
            for n, what in (
                (self.points, "metric points"),
                (self.params, "params"),
                (self.tags, "tags"),
                (self.files, "artifact files"),
                (self.log_bytes, "bytes of console log"),
                (self.other, "run updates"),
            )
            if n
        ]
        text = ", ".join(parts) or "nothing"
        return f"{text} (last error: {self.last_error})" if self.last_error else text


@dataclass(frozen=True)
class DeadLetter:
    """One entity MLflow or the artifact store refused for good, set aside with the reason."""

    run_key: str
    kind: str
    key: str
    reason: str
    kept_at: str = ""


@dataclass(frozen=True)
class LandedReport:
    """A shard's answer to "has this run's data been written?".

    ``dead_letters`` are the entities refused for good (never retried; the rest landed).
    ``stuck`` names each run that still had something pending, with what (when not landed).
    """

    landed: bool
    pending: Pending
    dead_letters: tuple[DeadLetter, ...] = ()
    stuck: tuple[str, ...] = ()


@dataclass(frozen=True)
class ShardConfig:
    """What a shard needs to run; built by the router from raydeck's settings."""

    index: int
    tracking_uri: str
    spool_dir: str
    fsync: bool
    writers: int
    mlflow_timeout_s: int
    retry_max_s: float
    env: dict[str, str] = field(repr=False)
    # Where runs and values are written when it is not ``tracking_uri`` (an http(s) server's
    # own database, ``[tracking].write_db``); it may hold the database's password.
    write_uri: str = field(default="", repr=False)


@dataclass(frozen=True)
class ProxyConfig:
    """Everything the proxy actors need, fixed by the process that first creates them.

    ``tracking_uri`` may hold credentials: it reaches the actors as a constructor argument,
    never through a runtime env or a log line (``repr`` hides it).
    """

    namespace: str
    tracking_uri: str = field(repr=False)
    artifact_location: str
    shards: int
    writers: int
    spool_dir: str
    fsync: bool
    lost_after_s: float
    idle_timeout_s: float
    heartbeat_interval_s: float
    mlflow_timeout_s: int
    retry_max_s: float
    env: dict[str, str] = field(default_factory=dict, repr=False)
    write_uri: str = field(default="", repr=False)  # see ShardConfig.write_uri


@dataclass(frozen=True)
class IngestResult:
    """``ingest``'s answer. ``missing_uploads``: send these files' bytes again, then the batch."""

    accepted: bool
    missing_uploads: tuple[str, ...] = ()


@dataclass(frozen=True)
class Resolution:
    """A run key as MLflow knows it: what ``Tracker.run_id`` and friends report."""

    run_id: str
    experiment_id: str
    mode: str
    name: str
    resumed: bool
    params: dict[str, str]
