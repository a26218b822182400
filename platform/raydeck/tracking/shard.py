"""A writer shard: accepts trackers' batches, spools them, writes them to MLflow run by run.

Owns: acknowledging a batch only once it is in the spool; per-run queues drained fairly by a
few writer threads (one run's trouble, a refused artifact or a huge backlog, never delays another
run's data); creating, reopening and ending runs in order with their data (so a tracker can
attach and log while MLflow is down); retrying transient failures with backoff, as long as it
takes; setting permanent refusals aside as dead letters, recorded on the run when it ends; each
run's console logs, uploaded in parts that hold only what is new; the cross-rank views of
``all_ranks`` mode; answering "has this run's data landed?". Does not own: run membership (the
router) or validation (the tracker).

Life of one entity: ``ingest`` -> spool (durable; the batch is acknowledged) -> a writer takes it
when its run's turn comes -> MLflow -> removed from the spool (or set aside as a dead letter).
A shard killed at any point resumes from the spool when Ray restarts it: the queue is the
database, so nothing is replayed into memory.

Order within a run: ``open`` (create or reopen the MLflow run) and ``end`` are barriers: an
``end`` is written only after everything accepted before it, and nothing after an ``open`` before
it. Metric chunks between barriers may be written by several writers at once (so one run can use
a server's parallelism); params, tags and dataset inputs of a run are written one call at a
time, in order; so are its files.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from raydeck.tracking.messages import (
    Batch,
    DeadLetter,
    LandedReport,
    OpenRun,
    Pending,
    Point,
)
from raydeck.tracking.metrics import ShardMetrics
from raydeck.tracking.spool import (
    KIND_END,
    KIND_FILE,
    KIND_INPUT,
    KIND_LOG,
    KIND_METRICS,
    KIND_OPEN,
    KIND_PARAMS,
    KIND_TAGS,
    Entity,
    NewEntity,
    RunRecord,
    Spool,
)
from raydeck.tracking.writer import (
    MlflowWriter,
    OpenedRun,
    PermanentWriteError,
    TransientWriteError,
)

logger = logging.getLogger(__name__)

MAX_METRICS_PER_CALL = 1000
MAX_PARAMS_TAGS_PER_CALL = 100
WINDOW_ENTITIES = 256
IDLE_WAKE_S = 1.0
BACKOFF_FIRST_S = 0.25
BACKOFF_MAX_S = 5.0
UNCLASSIFIED_MAX_ATTEMPTS = 8
# A file the artifact store answers 5xx to this many times, while it accepted other files
# since, is refused for good (MLflow's artifact proxy answers a bare 500 for both "this path
# can never exist" and "my S3 is down"; only the second lets other uploads through).
REFUSED_FILE_ATTEMPTS = 6
PARENT_WAIT_S = 3600.0
LOG_UPLOAD_INTERVAL_S = 30.0
LOG_PART_MIN_BYTES = 1024 * 1024
LOG_PART_MAX_BYTES = 8 * 1024 * 1024
MAX_OPEN_CROSS_RANK_STEPS = 10_000
DEAD_LETTERS_TAG = "raydeck.dead_letters"
DEAD_LETTERS_ARTIFACT = "raydeck/dead_letters.json"
CHUNK_MAX_BYTES = 8 * 1024 * 1024


class WriterState(enum.Enum):
    """What the shard's writers are doing; shown by ``raydeck tracking status``."""

    IDLE = "idle"
    WRITING = "writing"
    BACKING_OFF = "backing_off"
    STOPPED = "stopped"


@dataclass(frozen=True)
class ShardConfig:
    """What a shard needs to run; built by the router from raydeck's settings."""

    index: int
    tracking_uri: str
    spool_dir: str
    fsync: bool
    writers: int
    env: dict[str, str] = field(repr=False)


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


_BY_SIZE = (KIND_METRICS, KIND_PARAMS, KIND_TAGS, KIND_LOG)
_COUNTED = {KIND_METRICS: "points", KIND_PARAMS: "params", KIND_TAGS: "tags",
            KIND_FILE: "files", KIND_LOG: "log_bytes", KIND_OPEN: "other", KIND_END: "other",
            KIND_INPUT: "other"}


class _RunQueue:
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


@dataclass
class _Work:
    """One step a writer takes for one run: a kind of call and the entities it covers."""

    run: _RunQueue
    action: str
    ids: list[int]


class _CrossRank:
    """Per step, collects ``<key>/rank_<i>`` of every rank; emits mean/min/max/straggler_rank.

    ``straggler_rank`` is the rank whose value for that step arrived last (the latest
    timestamp): the slow rank. Steps stay open until every rank reported; at most
    :data:`MAX_OPEN_CROSS_RANK_STEPS` are kept (the oldest are dropped first).
    """

    def __init__(self) -> None:
        self._open: OrderedDict[tuple[str, str, int], dict[int, tuple[float, int]]] = (
            OrderedDict())
        self._lock = threading.Lock()

    def feed(self, run_key: str, points: list[Point], rank: int, world_size: int
             ) -> list[Point]:
        suffix = f"/rank_{rank}"
        done: list[Point] = []
        with self._lock:
            for key, value, timestamp, step in points:
                if not key.endswith(suffix) or key.startswith("system/"):
                    continue
                base = key[: -len(suffix)]
                slot = self._open.setdefault((run_key, base, step), {})
                slot[rank] = (value, timestamp)
                if len(slot) < world_size:
                    continue
                del self._open[(run_key, base, step)]
                values = [v for v, _ in slot.values()]
                latest = max(t for _, t in slot.values())
                slowest = max(slot, key=lambda r: (slot[r][1], r))
                done += [(f"{base}/mean", sum(values) / len(values), latest, step),
                         (f"{base}/min", min(values), latest, step),
                         (f"{base}/max", max(values), latest, step),
                         (f"{base}/straggler_rank", float(slowest), latest, step)]
            while len(self._open) > MAX_OPEN_CROSS_RANK_STEPS:
                self._open.popitem(last=False)
        return done


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


class ShardCore:
    """The shard's logic, independent of Ray's actor machinery."""

    def __init__(self, config: ShardConfig) -> None:
        os.environ.update(config.env)
        self.config = config
        self.spool = Spool(Path(config.spool_dir), fsync=config.fsync)
        self.writer = MlflowWriter(config.tracking_uri)
        self.metrics = ShardMetrics(config.index)
        self.received = 0
        self.written = 0
        self.transient_errors = 0
        self.last_error = ""
        self._cv = threading.Condition()
        self._runs: dict[str, _RunQueue] = {}
        self._order: list[str] = []
        self._cursor = 0
        self._busy_writers = 0
        self._latest: dict[str, dict[str, tuple[float, int]]] = {}
        self._dead_counts: dict[str, int] = self.spool.dead_letter_counts()
        self._cross_rank = _CrossRank()
        self._stopping = False
        self._recovered = 0
        self._last_upload_ok = 0.0
        self._load_backlog()
        self._threads = [
            threading.Thread(target=self._write_forever, name=f"raydeck-shard-{config.index}-w{i}",
                             daemon=True)
            for i in range(max(1, config.writers))
        ]
        for thread in self._threads:
            thread.start()

    def _load_backlog(self) -> None:
        now = time.monotonic()
        for run_key, kind, entities, n in self.spool.pending_counts():
            run = self._run(run_key)
            run.counts[_COUNTED[kind]] += n if kind in _BY_SIZE else entities
            run.entities += entities
            self._recovered += entities
            if kind == KIND_END:
                run.ends_pending += entities
            if kind == KIND_LOG:
                run.log_since = now
        for run in self._runs.values():
            run.record = self.spool.run_record(run.key)
        if self._recovered:
            logger.info("shard %d: %d entities of %d runs pending in the spool",
                        self.config.index, self._recovered, len(self._runs))

    def _run(self, key: str) -> _RunQueue:
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = _RunQueue(key)
            self._order.append(key)
        return run

    # --- accepting (many threads) -------------------------------------------------------------
    def ingest(self, batch: Batch) -> IngestResult:
        """Accept a batch: spooled before this returns. A re-delivery is acknowledged, dropped.

        Raises:
            TrackingSpoolFullError: no room on the spool's disk (the tracker keeps the batch).
        """
        missing = tuple(ref.upload_id for ref in batch.files
                        if self.spool.upload_size(ref.upload_id) != ref.size)
        if missing:
            return IngestResult(False, missing)
        entities = batch_entities(batch)
        if batch.rank_of is not None and batch.points:
            derived = self._cross_rank.feed(batch.run_key, batch.points, *batch.rank_of)
            if derived:
                entities.append(NewEntity(batch.run_key, KIND_METRICS, len(derived), derived))
        accepted = self.spool.accept(batch.client_id, batch.seq, entities)
        if accepted is None:
            return IngestResult(True)
        latest = self._latest.setdefault(batch.run_key, {})
        for key, value, _, step in batch.points:
            latest[key] = (value, step)
        self._enqueued(accepted)
        self.metrics.count_received(batch.size())
        return IngestResult(True)

    def control(self, run_key: str, kind: str, payload: Any) -> None:
        """Queue a run update from the router: ``open`` (an :class:`OpenRun`), ``tags``, ``end``.

        Durable when this returns, and written in order with the run's data.
        """
        n = len(payload) if kind == KIND_TAGS else 1
        accepted = self.spool.accept(None, None, [NewEntity(run_key, kind, n, payload)])
        assert accepted is not None
        self._enqueued(accepted)

    def put_chunk(self, upload_id: str, offset: int, data: bytes) -> int:
        """Store part of an artifact file; returns the bytes held so far (see Spool)."""
        return self.spool.append_chunk(upload_id, offset, data)

    def _enqueued(self, accepted: list[Entity]) -> None:
        now = time.monotonic()
        with self._cv:
            for entity in accepted:
                run = self._run(entity.run_key)
                run.counts[_COUNTED[entity.kind]] += entity.n if entity.kind in _BY_SIZE else 1
                run.entities += 1
                if entity.kind == KIND_END:
                    run.ends_pending += 1
                if entity.kind == KIND_LOG and run.log_since is None:
                    run.log_since = now
                if entity.kind in (KIND_METRICS, KIND_PARAMS, KIND_TAGS, KIND_FILE, KIND_INPUT):
                    self.received += entity.n
            self._cv.notify_all()

    # --- questions (the "wait" concurrency group) -----------------------------------------------
    def wait_landed(self, run_keys: list[str], timeout_s: float) -> LandedReport:
        """Block until every accepted entity of these runs is written (or set aside).

        Never blocks longer than ``timeout_s``; the report then says exactly what is pending.
        """
        deadline = time.monotonic() + timeout_s
        with self._cv:
            for key in run_keys:
                if key in self._runs:
                    self._runs[key].log_due = True
            self._cv.notify_all()
            while True:
                runs = [self._runs[k] for k in run_keys if k in self._runs]
                if all(run.empty for run in runs):
                    letters = tuple(d for k in run_keys for d in self.spool.dead_letters(k))
                    return LandedReport(True, Pending(), letters)
                left = deadline - time.monotonic()
                if left <= 0:
                    total = _sum_pending([run.pending() for run in runs])
                    letters = tuple(d for k in run_keys for d in self.spool.dead_letters(k))
                    return LandedReport(False, total, letters)
                self._cv.wait(min(left, 0.5))

    def resolve(self, run_key: str, timeout_s: float) -> Resolution | None:
        """The MLflow run of ``run_key`` once this shard created or found it (None: not yet)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                run = self._runs.get(run_key)
                record = run.record if run is not None else None
                if record is None and run is None:
                    record = self.spool.run_record(run_key)
                if record is not None:
                    return Resolution(record.run_id, record.experiment_id, record.mode,
                                      record.name, record.resumed, dict(record.params))
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(min(left, 0.5))

    def latest(self, run_key: str) -> dict[str, tuple[float, int]]:
        """Last value and step received per metric key of a run (for progress displays)."""
        return dict(self._latest.get(run_key, {}))

    def last_steps(self, run_key: str, keys: list[str], timeout_s: float) -> dict[str, int]:
        """The highest step of each metric key a run holds, written or pending (-1: none).

        Waits up to ``timeout_s`` for the run's pending values to land so that MLflow's
        history is complete, but only while MLflow answers: during an outage it answers at
        once from what is pending here and what this shard received (a restarted job must not
        wait for MLflow).
        """
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                run = self._runs.get(run_key)
                if run is None or run.empty or run.attempts > 0:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(min(left, 0.5))
            backing_off = run is not None and run.attempts > 0
        received = self._latest.get(run_key, {})
        highest = {key: received.get(key, (0.0, -1))[1] for key in keys}
        for key, step in self.spool.max_steps(run_key, keys).items():
            highest[key] = max(highest[key], step)
        resolution = None if backing_off else self.resolve(run_key, 0)
        if resolution is None:
            return highest
        try:
            for key in keys:
                for step in self.writer.history_steps(resolution.run_id, key):
                    highest[key] = max(highest[key], step)
        except (TransientWriteError, PermanentWriteError) as exc:
            logger.warning("shard %d: cannot read the metric history of run %s: %s",
                           self.config.index, run_key, exc)
        return highest

    def stats(self) -> dict[str, Any]:
        with self._cv:
            runs = [
                {"key": run.key, "run_id": run.record.run_id if run.record else "",
                 "pending": run.pending().describe() if not run.empty else "",
                 "entities": run.entities, "dead_letters": self._dead_counts.get(run.key, 0),
                 "last_error": run.last_error,
                 "state": ("backing_off" if run.backing_off(time.monotonic())
                           else "writing" if run.in_flight or run.meta_busy or run.file_busy
                           else "idle")}
                for run in self._runs.values()
                if not run.empty or self._dead_counts.get(run.key) or run.last_error
            ]
            run_ids = {run.key: run.record.run_id for run in self._runs.values() if run.record}
            queued_points = sum(run.counts["points"] for run in self._runs.values())
            queued = sum(run.entities for run in self._runs.values())
            backing_off = any(run.backing_off(time.monotonic()) and not run.empty
                              for run in self._runs.values())
            state = (WriterState.BACKING_OFF if backing_off
                     else WriterState.WRITING if self._busy_writers else WriterState.IDLE)
        return {
            "index": self.config.index,
            "pid": os.getpid(),
            "state": state.value,
            "points_received": self.received,
            "points_written": self.written,
            "queued_points": queued_points,
            "queued_entities": queued,
            "runs_pending": sorted(r["key"] for r in runs if r["entities"]),
            "runs": runs,
            "run_ids": run_ids,
            "spool_bytes": self.spool.size_bytes(),
            "replay_backlog": self._recovered,
            "dead_letters": sum(self._dead_counts.values()),
            "write_errors": self.transient_errors,
            "last_error": self.last_error,
        }

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        for thread in self._threads:
            thread.join(timeout_s)
        self.spool.close()

    # --- writers ------------------------------------------------------------------------------
    def _write_forever(self) -> None:
        while True:
            with self._cv:
                work = self._next_work()
                while work is None:
                    if self._stopping:
                        return
                    self._cv.wait(IDLE_WAKE_S)
                    work = self._next_work()
                self._busy_writers += 1
            try:
                self._do(work)
            except Exception:
                logger.exception("shard %d: writer step failed; retrying", self.config.index)
                self._failed(work, "internal error (see the shard's log)")
            finally:
                with self._cv:
                    self._busy_writers -= 1
                    self._cv.notify_all()
            self._report_levels()

    def _next_work(self) -> _Work | None:
        """The next step, taking runs in turn (fair draining). Caller holds ``_cv``."""
        now = time.monotonic()
        count = len(self._order)
        for offset in range(count):
            index = (self._cursor + offset) % count
            run = self._runs[self._order[index]]
            if run.empty or run.backoff_until > now:
                continue
            work = self._plan(run, now)
            if work is not None:
                self._cursor = (index + 1) % count
                return work
        self._forget_idle_runs()
        return None

    def _forget_idle_runs(self) -> None:
        """Drop queues of runs with nothing pending (their record stays in the spool)."""
        idle = [k for k, r in self._runs.items()
                if r.empty and not r.in_flight and not r.last_error and len(self._runs) > 256]
        for key in idle:
            del self._runs[key]
        if idle:
            self._order = [k for k in self._order if k in self._runs]
            self._cursor = 0

    def _plan(self, run: _RunQueue, now: float) -> _Work | None:
        if run.record is None and not run.failed_open:
            if run.open_busy:
                return None
            open_id = self.spool.first_id_of_kind(run.key, KIND_OPEN)
            run.open_busy = True
            return _Work(run, "open" if open_id is not None else "find",
                         [open_id] if open_id is not None else [])
        window = self.spool.window(run.key, WINDOW_ENTITIES)
        logs_due = run.log_due or run.ends_pending > 0 or (
            run.log_since is not None and (now - run.log_since > LOG_UPLOAD_INTERVAL_S
                                           or run.counts["log_bytes"] >= LOG_PART_MIN_BYTES))
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
                    return self._take(run, "fail" if run.failed_open else kind, [entity_id])
                break
            if run.failed_open:
                return self._take(run, "fail", [entity_id])
            if kind == KIND_METRICS:
                if points + n <= MAX_METRICS_PER_CALL or not metrics:
                    metrics.append(entity_id)
                    points += n
            elif kind in (KIND_PARAMS, KIND_TAGS, KIND_INPUT):
                if not run.meta_busy and (not meta or (meta_kind == kind != KIND_INPUT)):
                    meta.append(entity_id)
                    meta_kind = kind
            elif kind == KIND_FILE:
                if not run.file_busy and self._file_ready(run, entity_id, now, waiting_paths):
                    run.file_busy = True
                    return self._take(run, "file", [entity_id])
            elif kind == KIND_LOG and logs_due and not run.log_busy:
                run.log_busy = True
                return _Work(run, "logs", [])
            before_clear = False
        if meta and (not metrics or meta[0] < metrics[0]):
            run.meta_busy = True
            return self._take(run, "meta", meta)
        if metrics:
            return self._take(run, "metrics", metrics)
        if meta:
            run.meta_busy = True
            return self._take(run, "meta", meta)
        return None

    def _file_ready(self, run: _RunQueue, entity_id: int, now: float,
                    waiting_paths: set[tuple[str, str]]) -> bool:
        """Whether a file may upload now: not backing off, and no earlier file of the same
        path is (files of one run upload in any order, but one path keeps its order)."""
        retry = run.file_retry.get(entity_id)
        if retry is None and not waiting_paths:
            return True
        loaded = self.spool.load(run.key, [entity_id])
        if not loaded:
            return False
        entity = loaded[0]
        path = (entity.payload.artifact_dir, entity.payload.name)
        if retry is not None and retry[2] > now:
            waiting_paths.add(path)
            return False
        return path not in waiting_paths

    @staticmethod
    def _take(run: _RunQueue, action: str, ids: list[int]) -> _Work:
        run.in_flight.update(ids)
        return _Work(run, action, ids)

    def _do(self, work: _Work) -> None:
        run = work.run
        started = time.monotonic()
        try:
            if work.action == "open":
                done = self._open(run, work.ids[0])
                written = 0
            elif work.action == "find":
                done, written = self._find(run), 0
            elif work.action == "logs":
                done, written = self._upload_logs(run), 0
            else:
                entities = self.spool.load(run.key, work.ids)
                if work.action == "fail":
                    for entity in entities:
                        self._set_aside(entity, entity.kind,
                                        f"run could not be opened: {run.failed_open}")
                    written = 0
                else:
                    assert run.record is not None
                    written = {"metrics": self._write_values, "meta": self._write_values,
                               "file": self._write_file, "end": self._write_end}[work.action](
                        run, run.record, entities)
                done = [(e.kind, e.n) for e in entities]
        except TransientWriteError as exc:
            self._failed(work, str(exc), exc.answered)
            return
        except PermanentWriteError as exc:
            # A refusal outside the places that set aside exactly one value: set aside what
            # this step held, never retry it.
            entities = self.spool.load(run.key, work.ids)
            for entity in entities:
                self._set_aside(entity, entity.kind, str(exc))
            done, written = [(e.kind, e.n) for e in entities], 0
        self._finished(work, done, written)
        self.metrics.observe_write(time.monotonic() - started)

    # --- one step of each kind ------------------------------------------------------------------
    def _open(self, run: _RunQueue, entity_id: int) -> list[tuple[str, int]]:
        entities = self.spool.load(run.key, [entity_id])
        if not entities:
            return []
        entity = entities[0]
        spec: OpenRun = entity.payload
        parent_run_id = self._parent_run_id(run, spec.parent_key) if spec.parent_key else None
        try:
            opened = self.writer.open_run(spec.key, spec.name, spec.experiment,
                                          spec.artifact_location, spec.mode, spec.tags,
                                          parent_run_id)
        except PermanentWriteError as exc:
            with self._cv:
                run.failed_open = str(exc)
            self._set_aside(entity, KIND_OPEN, str(exc))
            return [(KIND_OPEN, 1)]
        self._record(run, opened)
        self.spool.remove([entity])
        return [(KIND_OPEN, 1)]

    def _parent_run_id(self, run: _RunQueue, parent_key: str) -> str | None:
        parent = self._runs.get(parent_key)
        record = parent.record if parent is not None else None
        record = record or self.spool.run_record(parent_key)
        if record is not None:
            return record.run_id
        try:
            found = self.writer.find_run(parent_key)
        except PermanentWriteError as exc:
            self._note_set_aside(run.key, "tag", "mlflow.parentRunId", str(exc))
            return None
        if found is not None:
            return str(found.info.run_id)
        now = time.monotonic()
        run.waiting_parent_since = run.waiting_parent_since or now
        if now - run.waiting_parent_since < PARENT_WAIT_S:
            raise TransientWriteError(f"parent run {parent_key!r} does not exist in MLflow yet")
        self._note_set_aside(run.key, "tag", "mlflow.parentRunId",
                             f"parent run {parent_key!r} never appeared in MLflow")
        return None

    def _find(self, run: _RunQueue) -> list[tuple[str, int]]:
        """A run with data but no ``open`` here: created by another shard or an older proxy."""
        try:
            found = self.writer.find_run(run.key)
        except PermanentWriteError as exc:
            with self._cv:
                run.failed_open = str(exc)
            return []
        if found is None:
            raise TransientWriteError(f"run {run.key!r} does not exist in MLflow yet")
        self._record(run, OpenedRun(found.info.run_id, found.info.experiment_id,
                                    found.data.tags.get("raydeck.mode", "rank_zero"),
                                    found.info.run_name or run.key, True,
                                    dict(found.data.params)))
        return []

    def _record(self, run: _RunQueue, opened: OpenedRun) -> None:
        record = RunRecord(run.key, opened.run_id, opened.experiment_id, opened.mode,
                           opened.name, opened.resumed, opened.params)
        self.spool.record_run(record)
        with self._cv:
            run.record = record
            run.waiting_parent_since = None
            self._cv.notify_all()

    def _write_values(self, run: _RunQueue, record: RunRecord, entities: list[Entity]) -> int:
        points: list[Point] = []
        tags: dict[str, str] = {}
        letters: list[DeadLetter] = []
        refused: list[tuple[str, str, str]] = []
        for entity in entities:
            if entity.kind == KIND_METRICS:
                points += entity.payload
            elif entity.kind == KIND_PARAMS:
                # One call per entity: merging two would hide a changed value, which MLflow
                # must refuse (params are immutable).
                refused += self.writer.log_batch(record.run_id, [], entity.payload, {})
            elif entity.kind == KIND_TAGS:
                tags.update(entity.payload)  # last value wins, as for MLflow's tags
            elif entity.kind == KIND_INPUT:
                try:
                    self.writer.log_input(record.run_id, entity.payload)
                except PermanentWriteError as exc:
                    letters.append(DeadLetter(run.key, KIND_INPUT, entity.payload.name,
                                              str(exc)))
        refused += self.writer.log_batch(record.run_id, points, {}, tags)
        letters += [DeadLetter(run.key, kind, key, reason) for kind, key, reason in refused]
        self.spool.remove(entities, letters)
        self._count_dead(run.key, letters)
        params = sum(e.n for e in entities if e.kind == KIND_PARAMS)
        return len(points) + params + len(tags) - len(letters)

    def _write_file(self, run: _RunQueue, record: RunRecord, entities: list[Entity]) -> int:
        entity = entities[0]
        ref = entity.payload
        try:
            path = self.spool.stage(entity.id, ref.upload_id, ref.name)
            self.writer.upload_file(record.run_id, path, ref.artifact_dir)
        except (PermanentWriteError, ValueError) as exc:
            self._set_aside(entity, KIND_FILE, str(exc))
            return 0
        self.spool.remove(entities)
        with self._cv:
            self._last_upload_ok = time.monotonic()
            run.file_retry.pop(entity.id, None)
        return 1

    def _write_end(self, run: _RunQueue, record: RunRecord, entities: list[Entity]) -> int:
        """Record the run's dead letters on it (tag + artifact), then end it."""
        if self.spool.dead_letters(run.key, unrecorded_only=True):
            letters = self.spool.dead_letters(run.key)
            with tempfile.TemporaryDirectory(prefix="raydeck-dead-") as tmp:
                path = Path(tmp) / Path(DEAD_LETTERS_ARTIFACT).name
                path.write_text(json.dumps(
                    [{"kind": d.kind, "key": d.key, "reason": d.reason, "kept_at": d.kept_at}
                     for d in letters], indent=2))
                try:
                    self.writer.upload_file(record.run_id, path,
                                            str(Path(DEAD_LETTERS_ARTIFACT).parent))
                except PermanentWriteError as exc:
                    # The artifact store refuses this run's files; the tag still says it, and
                    # `raydeck tracking status` lists them.
                    logger.error("shard %d: run %s: cannot upload %s: %s", self.config.index,
                                 run.key, DEAD_LETTERS_ARTIFACT, exc)
            self.writer.log_batch(record.run_id, [], {}, {DEAD_LETTERS_TAG: str(len(letters))})
            self.spool.mark_recorded(run.key)
        try:
            self.writer.end_run(record.run_id, entities[0].payload)
        except PermanentWriteError as exc:
            self._set_aside(entities[0], KIND_END, str(exc))
            return 0
        self.spool.remove(entities)
        return 0

    def _upload_logs(self, run: _RunQueue) -> list[tuple[str, int]]:
        """Upload the oldest console text of one log file as a part holding only new text.

        A part is named by its first entity's id, so uploading it again after a crash (before
        the entities were removed) overwrites the same file instead of repeating lines.
        """
        if run.record is None:
            return []
        ids = [entity_id for entity_id, kind, _ in self.spool.window(run.key, WINDOW_ENTITIES)
               if kind == KIND_LOG]
        entities = self.spool.load(run.key, ids) if ids else []
        if not entities:
            return []
        name = entities[0].payload[0]
        part: list[Entity] = []
        size = 0
        for entity in entities:
            if entity.payload[0] == name and (not part or size + entity.n <= LOG_PART_MAX_BYTES):
                part.append(entity)
                size += entity.n
        stem = Path(name).stem or "log"
        with tempfile.TemporaryDirectory(prefix="raydeck-log-") as tmp:
            path = Path(tmp) / f"part-{part[0].id:012d}.txt"
            with path.open("w", encoding="utf-8") as fh:
                for entity in part:
                    fh.write(entity.payload[1])
            try:
                self.writer.upload_file(run.record.run_id, path, f"logs/{stem}")
            except PermanentWriteError as exc:
                for entity in part:
                    self._set_aside(entity, KIND_LOG, str(exc))
                return [(KIND_LOG, e.n) for e in part]
        self.spool.remove(part)
        return [(KIND_LOG, e.n) for e in part]

    # --- bookkeeping ----------------------------------------------------------------------------
    def _set_aside(self, entity: Entity, kind: str, reason: str) -> None:
        key = (entity.payload.name if kind in (KIND_FILE, KIND_INPUT)
               else entity.payload[0] if kind == KIND_LOG
               else entity.payload.key if kind == KIND_OPEN
               else str(entity.payload) if kind == KIND_END else kind)
        letter = self.spool.dead_letter(entity, key, reason)
        self._count_dead(entity.run_key, [letter])
        logger.error("shard %d: %s %r of run %s refused for good, set aside: %s",
                     self.config.index, kind, key, entity.run_key, reason)

    def _note_set_aside(self, run_key: str, kind: str, key: str, reason: str) -> None:
        """A dead letter for a value that is part of an entity, not one of its own."""
        letter = DeadLetter(run_key, kind, key, reason)
        self.spool.add_dead_letters([letter])
        self._count_dead(run_key, [letter])

    def _count_dead(self, run_key: str, letters: list[DeadLetter]) -> None:
        if letters:
            with self._cv:
                self._dead_counts[run_key] = self._dead_counts.get(run_key, 0) + len(letters)
            self.metrics.count_error("rejected", len(letters))

    def _finished(self, work: _Work, done: list[tuple[str, int]], written: int) -> None:
        """Account a step's entities as done (written or set aside) and free the run."""
        run = work.run
        with self._cv:
            for kind, n in done:
                name = _COUNTED[kind]
                run.counts[name] = max(0, run.counts[name] - (n if kind in _BY_SIZE else 1))
                if kind == KIND_END:
                    run.ends_pending = max(0, run.ends_pending - 1)
            run.entities = max(0, run.entities - len(done))
            self._recovered = max(0, self._recovered - len(done))
            for entity_id in work.ids:
                run.unclassified.pop(entity_id, None)
            self.written += written
            run.attempts = 0
            run.last_error = ""
            run.warned = ""
            if work.action == "logs":
                run.log_since = time.monotonic() if run.counts["log_bytes"] else None
            if run.entities == 0:
                run.log_due = False
            self._release_locked(run, work)
            self._cv.notify_all()
        if written:
            self.metrics.count_written(written)

    @staticmethod
    def _release_locked(run: _RunQueue, work: _Work) -> None:
        """Free what ``work`` held of its run. Caller holds ``_cv``."""
        run.in_flight.difference_update(work.ids)
        if work.action in ("open", "find"):
            run.open_busy = False
        elif work.action == "meta":
            run.meta_busy = False
        elif work.action == "file":
            run.file_busy = False
        elif work.action == "logs":
            run.log_busy = False

    def _failed(self, work: _Work, reason: str, answered: bool = False) -> None:
        """A transient failure: the run backs off (others go on); its entities stay queued.

        A failing file backs off alone (the run's other data and files go on), and is set
        aside by the evidence rule of :data:`REFUSED_FILE_ATTEMPTS`.
        """
        run = work.run
        now = time.monotonic()
        give_up: dict[int, str] = {}
        if ": unclassified " in reason or reason.startswith("unclassified"):
            for entity_id in work.ids:
                run.unclassified[entity_id] = run.unclassified.get(entity_id, 0) + 1
                if run.unclassified[entity_id] >= UNCLASSIFIED_MAX_ATTEMPTS:
                    give_up[entity_id] = (f"failed {UNCLASSIFIED_MAX_ATTEMPTS} times with an "
                                          f"error raydeck cannot classify: {reason}")
        with self._cv:
            if work.action == "file":
                [entity_id] = work.ids
                attempts, first, _ = run.file_retry.get(entity_id, (0, now, 0.0))
                attempts += 1
                run.file_retry[entity_id] = (attempts, first, now + _backoff_s(attempts))
                if answered and attempts >= REFUSED_FILE_ATTEMPTS and self._last_upload_ok > first:
                    give_up[entity_id] = (
                        f"the artifact store answered an error {attempts} times for this file "
                        f"while it accepted other files: {reason}")
            else:
                run.attempts += 1
                run.backoff_until = now + _backoff_s(run.attempts)
            first_failure = not run.warned
            run.warned = reason
            run.last_error = reason
            self.last_error = reason
            self.transient_errors += 1
            self._release_locked(run, work)
            self._cv.notify_all()
        self.metrics.count_error("transient")
        if first_failure:
            logger.warning("shard %d: writing run %s failed, retrying with backoff: %s",
                           self.config.index, run.key, reason)
        if give_up:
            entities = self.spool.load(run.key, list(give_up))
            for entity in entities:
                self._set_aside(entity, entity.kind, give_up[entity.id])
                run.file_retry.pop(entity.id, None)
            self._finished(_Work(run, "fail", list(give_up)),
                           [(e.kind, e.n) for e in entities], 0)

    def _report_levels(self) -> None:
        with self._cv:
            depth = sum(run.entities for run in self._runs.values())
            recovered = self._recovered
        self.metrics.set_levels(depth, self.spool.size_bytes(), recovered)


def _backoff_s(attempts: int) -> float:
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * (2 ** min(attempts - 1, 8)))


def _sum_pending(items: list[Pending]) -> Pending:
    last_error = next((p.last_error for p in items if p.last_error), "")
    return Pending(points=sum(p.points for p in items), params=sum(p.params for p in items),
                   tags=sum(p.tags for p in items), files=sum(p.files for p in items),
                   log_bytes=sum(p.log_bytes for p in items), other=sum(p.other for p in items),
                   last_error=last_error)


class Shard:
    """The Ray actor wrapping :class:`ShardCore`.

    Two concurrency groups: ``io`` takes ``ingest``, uploads, control and stats, and never
    waits; ``wait`` takes the calls that block until data landed, so a tracker waiting in
    ``finish()`` never holds a thread that another tracker's ``ingest`` needs.
    """

    def __init__(self, config: ShardConfig) -> None:
        self.core = ShardCore(config)

    @ray.method(concurrency_group="io")
    def ingest(self, batch: Batch) -> IngestResult:
        return self.core.ingest(batch)

    @ray.method(concurrency_group="io")
    def put_chunk(self, upload_id: str, offset: int, data: bytes) -> int:
        return self.core.put_chunk(upload_id, offset, data)

    @ray.method(concurrency_group="io")
    def control(self, run_key: str, kind: str, payload: Any) -> None:
        self.core.control(run_key, kind, payload)

    @ray.method(concurrency_group="io")
    def latest(self, run_key: str) -> dict[str, tuple[float, int]]:
        return self.core.latest(run_key)

    @ray.method(concurrency_group="io")
    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    @ray.method(concurrency_group="io")
    def dead_letters(self, run_key: str | None = None) -> list[DeadLetter]:
        return self.core.spool.dead_letters(run_key)

    @ray.method(concurrency_group="wait")
    def wait_landed(self, run_keys: list[str], timeout_s: float) -> LandedReport:
        return self.core.wait_landed(run_keys, timeout_s)

    @ray.method(concurrency_group="wait")
    def resolve(self, run_key: str, timeout_s: float) -> Resolution | None:
        return self.core.resolve(run_key, timeout_s)

    @ray.method(concurrency_group="wait")
    def last_steps(self, run_key: str, keys: list[str], timeout_s: float) -> dict[str, int]:
        return self.core.last_steps(run_key, keys, timeout_s)

    @ray.method(concurrency_group="io")
    def ping(self) -> bool:
        return True
