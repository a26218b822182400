"""A shard's per-run queues: what each run has pending, what is in flight, its retry state.

Owns: :class:`RunQueue` (one run's counts, busy flags and backoff), :class:`Work` (one step a
writer takes), :func:`batch_entities` (a tracker's batch as spool entities, each small enough
for one MLflow call), :func:`plan_step` (which step a run takes next) and the backoff between
failed attempts. The shard
(:mod:`raydeck.tracking.proxy.shard`) keeps one queue per run and drains them in turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from raydeck.tracking.messages import Batch, Pending
from raydeck.tracking.proxy.spool import (
    KIND_END,
    KIND_FILE,
    KIND_INPUT,
    KIND_LOG,
    KIND_METRICS,
    KIND_OPEN,
    KIND_PARAMS,
    KIND_TAGS,
    NewEntity,
    RunRecord,
    Spool,
)

MAX_METRICS_PER_CALL = 1000
MAX_PARAMS_TAGS_PER_CALL = 100
WINDOW_ENTITIES = 256
BACKOFF_FIRST_S = 0.25
# A run's console text is uploaded this often, or once this much has gathered.
LOG_UPLOAD_INTERVAL_S = 30.0
LOG_PART_MIN_BYTES = 1024 * 1024

# Kinds counted by their size (points, params, tags, log bytes) rather than one per entity,
# and the Pending field each kind counts in.
BY_SIZE = (KIND_METRICS, KIND_PARAMS, KIND_TAGS, KIND_LOG)
COUNTED = {KIND_METRICS: "points", KIND_PARAMS: "params", KIND_TAGS: "tags",
           KIND_FILE: "files", KIND_LOG: "log_bytes", KIND_OPEN: "other", KIND_END: "other",
           KIND_INPUT: "other"}


class RunQueue:
    """A run's pending work in this shard: counts, what is in flight, and its retry state."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.record: RunRecord | None = None
        self.counts = {"points": 0, "params": 0, "tags": 0, "files": 0, "log_bytes": 0,
                       "other": 0}
        self.entities = 0
        self.ends_pending = 0
        self.in_flight: set[int] = set()
        self.meta_busy = False
        self.file_busy = False
        self.log_busy = False
        self.open_busy = False
        self.backoff_until = 0.0
        self.attempts = 0
        self.unclassified: dict[int, int] = {}
        # Per file entity: failed attempts, monotonic time of the first, retry not before.
        self.file_retry: dict[int, tuple[int, float, float]] = {}
        self.log_due = False
        self.log_since: float | None = None
        self.last_error = ""
        self.warned = ""  # the error warned about since the last success: one warning an outage
        self.failed_open = ""
        self.waiting_parent_since: float | None = None

    def pending(self) -> Pending:
        return Pending(points=self.counts["points"], params=self.counts["params"],
                       tags=self.counts["tags"], files=self.counts["files"],
                       log_bytes=self.counts["log_bytes"], other=self.counts["other"],
                       last_error=self.last_error)

    def backing_off(self, now: float) -> bool:
        """Whether the run, or one of its files, waits out a backoff after a failed write."""
        return self.backoff_until > now or any(
            retry_at > now for _, _, retry_at in self.file_retry.values())

    @property
    def empty(self) -> bool:
        return self.entities == 0

    def logs_due(self, now: float) -> bool:
        """Whether the run's console text should be uploaded now: asked for, the run ends, or
        enough time or text has gathered."""
        return self.log_due or self.ends_pending > 0 or (
            self.log_since is not None and (now - self.log_since > LOG_UPLOAD_INTERVAL_S
                                            or self.counts["log_bytes"] >= LOG_PART_MIN_BYTES))

    def release(self, work: Work) -> None:
        """Free what ``work`` held of this run. Caller holds the shard's lock."""
        self.in_flight.difference_update(work.ids)
        if work.action in ("open", "find"):
            self.open_busy = False
        elif work.action == "meta":
            self.meta_busy = False
        elif work.action == "file":
            self.file_busy = False
        elif work.action == "logs":
            self.log_busy = False


@dataclass
class Work:
    """One step a writer takes for one run: a kind of call and the entities it covers."""

    run: RunQueue
    action: str
    ids: list[int]


def batch_entities(batch: Batch) -> list[NewEntity]:
    """Split a batch into spool entities, each small enough for one MLflow call."""
    out: list[NewEntity] = []
    points = batch.points
    for start in range(0, len(points), MAX_METRICS_PER_CALL):
        chunk = points[start:start + MAX_METRICS_PER_CALL]
        out.append(NewEntity(batch.run_key, KIND_METRICS, len(chunk), chunk))
    for kind, values, key in ((KIND_PARAMS, batch.params, batch.params_run_key),
                              (KIND_TAGS, batch.tags, batch.run_key)):
        items = list(values.items())
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_CALL):
            values_chunk = dict(items[start:start + MAX_PARAMS_TAGS_PER_CALL])
            out.append(NewEntity(key, kind, len(values_chunk), values_chunk))
    out += [NewEntity(batch.run_key, KIND_FILE, 1, ref, ref=ref.upload_id)
            for ref in batch.files]
    out += [NewEntity(batch.run_key, KIND_INPUT, 1, dataset) for dataset in batch.inputs]
    out += [NewEntity(batch.params_run_key, KIND_LOG, len(text.encode()), (name, text))
            for name, text in batch.logs if text]
    return out


def backoff_s(attempts: int, max_s: float) -> float:
    """The wait after the ``attempts``-th failure in a row: doubling from
    :data:`BACKOFF_FIRST_S`, never longer than ``max_s`` (``RAYDECK_TRACKING_RETRY_MAX_S``)."""
    return min(max_s, BACKOFF_FIRST_S * (2 ** min(attempts - 1, 8)))


def sum_pending(items: list[Pending]) -> Pending:
    last_error = next((p.last_error for p in items if p.last_error), "")
    return Pending(points=sum(p.points for p in items), params=sum(p.params for p in items),
                   tags=sum(p.tags for p in items), files=sum(p.files for p in items),
                   log_bytes=sum(p.log_bytes for p in items), other=sum(p.other for p in items),
                   last_error=last_error)


def plan_step(run: RunQueue, spool: Spool, now: float) -> Work | None:
    """The next step ``run`` can take now, None when it must wait (busy, backing off, a
    barrier behind work in flight). Caller holds the shard's lock; the step's entities are
    marked in flight.

    ``open`` and ``end`` are barriers; metric chunks go together up to one MLflow call; params,
    tags and inputs go one call at a time, in order; so do files, and one path keeps its order.
    """
    if run.record is None and not run.failed_open:
        if run.open_busy:
            return None
        open_id = spool.first_id_of_kind(run.key, KIND_OPEN)
        run.open_busy = True
        return Work(run, "open" if open_id is not None else "find",
                    [open_id] if open_id is not None else [])
    window = spool.window(run.key, WINDOW_ENTITIES)
    due = run.logs_due(now)
    metrics: list[int] = []
    points = 0
    meta: list[int] = []
    meta_kind = ""
    before_clear = True  # nothing before this entity is pending or in flight
    waiting_paths: set[tuple[str, str]] = set()  # of files backing off, in order
    for entity_id, kind, n in window:
        if entity_id in run.in_flight:
            before_clear = False
            continue
        if kind in (KIND_OPEN, KIND_END):
            if before_clear and not metrics and not meta:
                return _take(run, "fail" if run.failed_open else kind, [entity_id])
            break
        if run.failed_open:
            return _take(run, "fail", [entity_id])
        if kind == KIND_METRICS:
            if points + n <= MAX_METRICS_PER_CALL or not metrics:
                metrics.append(entity_id)
                points += n
        elif kind in (KIND_PARAMS, KIND_TAGS, KIND_INPUT):
            if not run.meta_busy and (not meta or (meta_kind == kind != KIND_INPUT)):
                meta.append(entity_id)
                meta_kind = kind
        elif kind == KIND_FILE:
            if not run.file_busy and _file_ready(run, spool, entity_id, now, waiting_paths):
                run.file_busy = True
                return _take(run, "file", [entity_id])
        elif kind == KIND_LOG and due and not run.log_busy:
            run.log_busy = True
            return Work(run, "logs", [])
        before_clear = False
    if meta and (not metrics or meta[0] < metrics[0]):
        run.meta_busy = True
        return _take(run, "meta", meta)
    if metrics:
        return _take(run, "metrics", metrics)
    if meta:
        run.meta_busy = True
        return _take(run, "meta", meta)
    return None

def _file_ready(run: RunQueue, spool: Spool, entity_id: int, now: float,
                waiting_paths: set[tuple[str, str]]) -> bool:
    """Whether a file may upload now: not backing off, and no earlier file of the same
    path is (files of one run upload in any order, but one path keeps its order)."""
    retry = run.file_retry.get(entity_id)
    if retry is None and not waiting_paths:
        return True
    loaded = spool.load(run.key, [entity_id])
    if not loaded:
        return False
    entity = loaded[0]
    path = (entity.payload.artifact_dir, entity.payload.name)
    if retry is not None and retry[2] > now:
        waiting_paths.add(path)
        return False
    return path not in waiting_paths

def _take(run: RunQueue, action: str, ids: list[int]) -> Work:
    run.in_flight.update(ids)
    return Work(run, action, ids)
