"""What travels between a tracker, the router and the shards.

Plain dataclasses, pickled by Ray. Kept in one module so the three sides cannot drift apart.
A metric point is the tuple ``(key, value, timestamp_ms, step)``: tuples pickle several times
faster than objects, and points are the bulk of every batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Point = tuple[str, float, int, int]


@dataclass(frozen=True)
class ProcessInfo:
    """Who is logging: enough to label values and to recognise a restarted process.

    ``role_key`` is stable across restarts of the same logical process (rank 1 of Train run X in
    job J), so a restarted worker replaces its dead predecessor instead of joining beside it.
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

    @property
    def is_primary_candidate(self) -> bool:
        """A driver, a Tune trial or rank 0 may own a run; other ranks only join one."""
        return self.world_rank in (None, 0)


@dataclass(frozen=True)
class AttachRequest:
    """A tracker asking the router for the run it should write to."""

    client_id: str
    process: ProcessInfo
    tracking_uri: str
    run_key: str | None
    run_name: str | None
    experiment: str
    mode: str
    parent_key: str | None = None
    tags: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RunBinding:
    """The router's answer: where this tracker's values go and what role it plays.

    ``run_id`` receives this tracker's metrics, tags and artifacts (a per-rank child in
    ``per_rank`` mode); ``params_run_id`` receives params and console logs (the run itself).
    """

    run_key: str
    run_id: str
    params_run_id: str
    experiment_id: str
    run_name: str
    mode: str
    shard_index: int
    is_primary: bool
    created: bool
    resumed: bool
    sample_system: bool
    active: bool = True
    existing_params: dict[str, str] = field(default_factory=dict)


@dataclass
class Batch:
    """One flush of one tracker. ``(client_id, seq)`` makes re-delivery idempotent."""

    client_id: str
    seq: int
    run_id: str
    params_run_id: str
    points: list[Point] = field(default_factory=list)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    # (path under the run's artifact root, bytes) for every file of every logged artifact.
    files: list[tuple[str, bytes]] = field(default_factory=list)
    # (log file name, text) console output to append to logs/<name> in params_run_id.
    logs: list[tuple[str, str]] = field(default_factory=list)
    # all_ranks mode with cross-rank mean: (rank, world_size) of the sender.
    mean_of: tuple[int, int] | None = None

    def is_empty(self) -> bool:
        return not (self.points or self.params or self.tags or self.files or self.logs)

    def size(self) -> int:
        """Entities in the batch, the unit the proxy's metrics count."""
        return len(self.points) + len(self.params) + len(self.tags) + len(self.files)


@dataclass(frozen=True)
class Pending:
    """What a shard has accepted for a run but not yet written to MLflow."""

    points: int = 0
    params: int = 0
    tags: int = 0
    files: int = 0
    log_bytes: int = 0
    last_error: str = ""

    @property
    def empty(self) -> bool:
        return not (self.points or self.params or self.tags or self.files or self.log_bytes)

    def describe(self) -> str:
        parts = [
            f"{n} {what}"
            for n, what in (
                (self.points, "metric points"),
                (self.params, "params"),
                (self.tags, "tags"),
                (self.files, "artifact files"),
                (self.log_bytes, "bytes of console log"),
            )
            if n
        ]
        text = ", ".join(parts) or "nothing"
        return f"{text} (last error: {self.last_error})" if self.last_error else text


@dataclass(frozen=True)
class LandedReport:
    """A shard's answer to "has this run's data been written?"."""

    landed: bool
    pending: Pending
    rejected: tuple[str, ...] = ()
