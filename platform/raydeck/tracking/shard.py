"""A writer shard: accepts batches from trackers, spools them, writes them to MLflow in bulk.

Owns: acknowledging a batch only once it is in the spool; the writer thread that coalesces
batches from many trackers into few ``log_batch`` calls and retries with backoff while MLflow is
down; each run's console log files; the cross-rank mean of ``all_ranks`` mode; answering "has
this run's data landed?". Does not own: run lifecycle (the router) or validation (the tracker).

Lifecycle of one batch: ``ingest`` -> spool (durable) -> queue -> writer cycle -> MLflow ->
commit mark in the spool. A shard killed at any point replays every uncommitted batch when Ray
restarts it.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raydeck.tracking.messages import Batch, LandedReport, Pending, Point
from raydeck.tracking.metrics import ShardMetrics
from raydeck.tracking.spool import Spool, SpooledBatch
from raydeck.tracking.writer import MlflowWriter, TransientWriteError

logger = logging.getLogger(__name__)

MAX_POINTS_PER_CYCLE = 20_000
IDLE_WAKE_S = 1.0
LOG_UPLOAD_INTERVAL_S = 30.0
BACKOFF_FIRST_S = 0.25
BACKOFF_MAX_S = 5.0
MAX_OPEN_MEAN_STEPS = 10_000


class WriterState(enum.Enum):
    """What the writer thread is doing; shown by ``raydeck tracking status``."""

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
    env: dict[str, str]


class _RunPending:
    """Per-run counts of accepted, unwritten data."""

    __slots__ = ("files", "log_bytes", "params", "points", "tags")

    def __init__(self) -> None:
        self.points = self.params = self.tags = self.files = self.log_bytes = 0

    def snapshot(self, last_error: str) -> Pending:
        return Pending(self.points, self.params, self.tags, self.files, self.log_bytes, last_error)


class _CrossRankMean:
    """Collects ``<key>/rank_<i>`` values per step and yields ``<key>/mean`` when all arrived."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, str, int], dict[int, tuple[float, int]]] = {}

    def feed(self, run_id: str, batch: Batch) -> list[Point]:
        assert batch.mean_of is not None
        rank, world_size = batch.mean_of
        suffix = f"/rank_{rank}"
        done: list[Point] = []
        for key, value, timestamp, step in batch.points:
            if not key.endswith(suffix) or key.startswith("system/"):
                continue
            base = key[: -len(suffix)]
            slot = self._open.setdefault((run_id, base, step), {})
            slot[rank] = (value, timestamp)
            if len(slot) == world_size:
                del self._open[(run_id, base, step)]
                mean = sum(v for v, _ in slot.values()) / world_size
                done.append((f"{base}/mean", mean, max(t for _, t in slot.values()), step))
        while len(self._open) > MAX_OPEN_MEAN_STEPS:
            del self._open[next(iter(self._open))]
        return done


class ShardCore:
    """The shard's logic, independent of Ray so it can be driven directly in tests."""

    def __init__(self, config: ShardConfig) -> None:
        os.environ.update(config.env)
        self.config = config
        self.spool = Spool(Path(config.spool_dir), fsync=config.fsync)
        self.log_dir = Path(config.spool_dir) / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = MlflowWriter(config.tracking_uri)
        self.metrics = ShardMetrics(config.index)
        self.state = WriterState.IDLE
        self.last_error = ""
        self.points_received = 0
        self.points_written = 0
        self.write_errors = 0
        self._cv = threading.Condition()
        self._queue: list[SpooledBatch] = list(self.spool.replayed)
        self._replay_ids = {item.record_id for item in self.spool.replayed}
        self._pending: dict[str, _RunPending] = defaultdict(_RunPending)
        self._rejected: dict[str, list[str]] = defaultdict(list)
        self._latest: dict[str, dict[str, tuple[float, int]]] = defaultdict(dict)
        self._dirty_logs: set[tuple[str, str]] = set()
        self._logs_due: set[str] = set()
        self._mean = _CrossRankMean()
        self._stopping = False
        for item in self._queue:
            self._account(item.batch, +1)
        self._thread = threading.Thread(
            target=self._run_writer, name=f"raydeck-shard-{config.index}-writer", daemon=True
        )
        self._thread.start()

    # --- ingest side (many threads) --------------------------------------------------------
    def ingest(self, batch: Batch) -> bool:
        """Accept a batch: spooled before this returns. Re-deliveries are acknowledged, dropped."""
        item = self.spool.accept(batch)
        if item is None:
            return True
        latest = self._latest[batch.run_id]
        for key, value, _, step in batch.points:
            latest[key] = (value, step)
        with self._cv:
            self._queue.append(item)
            self._account(batch, +1)
            self.points_received += batch.size()
            self._cv.notify_all()
        self.metrics.count_received(batch.size())
        return True

    def _account(self, batch: Batch, sign: int) -> None:
        """Count a batch in (+1) or out (-1) of its runs' pending totals. Caller holds _cv."""
        own = self._pending[batch.run_id]
        own.points += sign * len(batch.points)
        own.tags += sign * len(batch.tags)
        own.files += sign * len(batch.files)
        owner = self._pending[batch.params_run_id]
        owner.params += sign * len(batch.params)
        owner.log_bytes += sign * sum(len(text) for _, text in batch.logs)

    def wait_landed(self, run_ids: list[str], timeout_s: float) -> LandedReport:
        """Block until every accepted value of these runs is in MLflow (console logs included).

        Never blocks longer than ``timeout_s``; the report then says exactly what is pending.
        """
        deadline = time.monotonic() + timeout_s
        with self._cv:
            self._logs_due.update(run_ids)
            self._cv.notify_all()
            while True:
                pending = [self._pending[r] for r in run_ids if r in self._pending]
                logs_waiting = any(run in self._logs_due for run in run_ids)
                if not logs_waiting and all(p.snapshot("").empty for p in pending):
                    rejected = tuple(msg for r in run_ids for msg in self._rejected.pop(r, []))
                    return LandedReport(True, Pending(), rejected)
                left = deadline - time.monotonic()
                if left <= 0:
                    total = _RunPending()
                    for p in pending:
                        for name in _RunPending.__slots__:
                            setattr(total, name, getattr(total, name) + getattr(p, name))
                    rejected = tuple(msg for r in run_ids for msg in self._rejected.get(r, []))
                    return LandedReport(False, total.snapshot(self.last_error), rejected)
                self._cv.wait(min(left, 0.5))

    def latest(self, run_id: str) -> dict[str, tuple[float, int]]:
        """Last value and step received per metric key of a run (for progress displays)."""
        return dict(self._latest.get(run_id, {}))

    def last_steps(self, run_id: str, keys: list[str], timeout_s: float) -> dict[str, int]:
        """The highest step of each metric key that a run holds, written or pending (-1: none).

        Waits up to ``timeout_s`` for the run's pending values to land, so that MLflow's
        history is complete (values replayed from the spool after a restart included). If
        MLflow stays unreachable, answers from what this shard has received.
        """
        deadline = time.monotonic() + timeout_s
        with self._cv:
            pending = self._pending.get(run_id)
            while (pending is not None and not pending.snapshot("").empty
                   and time.monotonic() < deadline):
                self._cv.wait(min(deadline - time.monotonic(), 0.5))
        received = self._latest.get(run_id, {})
        highest = {key: received.get(key, (0.0, -1))[1] for key in keys}
        try:
            for key in keys:
                for _, step in self.writer.history(run_id, key):
                    highest[key] = max(highest[key], step)
        except TransientWriteError as exc:
            logger.warning("shard %d: cannot read metric history of run %s from MLflow: %s",
                           self.config.index, run_id, exc)
        return highest

    def stats(self) -> dict[str, Any]:
        with self._cv:
            queued_points = sum(p.points for p in self._pending.values())
            runs_pending = sorted(r for r, p in self._pending.items() if not p.snapshot("").empty)
        return {
            "index": self.config.index,
            "state": self.state.value,
            "points_received": self.points_received,
            "points_written": self.points_written,
            "queued_points": queued_points,
            "queued_batches": len(self._queue),
            "runs_pending": runs_pending,
            "spool_bytes": self.spool.size_bytes(),
            "replay_backlog": len(self._replay_ids),
            "write_errors": self.write_errors,
            "last_error": self.last_error,
        }

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
        self.spool.close()
        self.state = WriterState.STOPPED

    # --- writer side (one thread) ------------------------------------------------------------
    def _run_writer(self) -> None:
        last_log_upload = time.monotonic()
        while True:
            with self._cv:
                if not self._queue and not self._logs_due and not self._stopping:
                    self._cv.wait(IDLE_WAKE_S)
                if self._stopping and not self._queue:
                    return
                items = self._take_cycle()
            if items:
                self._write(items)
            due = time.monotonic() - last_log_upload > LOG_UPLOAD_INTERVAL_S
            if due or self._logs_due:
                self._upload_logs(all_dirty=due)
                if due:
                    last_log_upload = time.monotonic()
            self._report_levels()

    def _take_cycle(self) -> list[SpooledBatch]:
        taken, points = 0, 0
        while taken < len(self._queue) and points < MAX_POINTS_PER_CYCLE:
            points += len(self._queue[taken].batch.points) + 1
            taken += 1
        items, self._queue = self._queue[:taken], self._queue[taken:]
        return items

    def _write(self, items: list[SpooledBatch]) -> None:
        points: dict[str, list[Point]] = defaultdict(list)
        params: dict[str, dict[str, str]] = defaultdict(dict)
        tags: dict[str, dict[str, str]] = defaultdict(dict)
        for item in items:
            batch = item.batch
            points[batch.run_id].extend(batch.points)
            if batch.mean_of is not None:
                points[batch.run_id].extend(self._mean.feed(batch.run_id, batch))
            params[batch.params_run_id].update(batch.params)
            tags[batch.run_id].update(batch.tags)
        runs = set(points) | set(params) | set(tags)
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                self.state = WriterState.WRITING
                rejected: dict[str, list[str]] = {}
                for run_id in runs:
                    rejected[run_id] = self.writer.write(
                        run_id, points.get(run_id, []), params.get(run_id, {}),
                        tags.get(run_id, {}),
                    )
                for item in items:
                    if item.batch.files:
                        self.writer.upload(item.batch.run_id, self.spool.blob_root(item.record_id))
                break
            except TransientWriteError as exc:
                self.state = WriterState.BACKING_OFF
                self.last_error = str(exc)
                self.write_errors += 1
                self.metrics.count_error("transient")
                self._report_levels()
                if attempt == 0:
                    logger.warning("shard %d: MLflow write failed, retrying: %s",
                                   self.config.index, exc)
                delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * (2 ** min(attempt, 8)))
                attempt += 1
                with self._cv:
                    self._cv.wait(delay)
        self._append_logs(items)
        self.spool.commit([item.record_id for item in items])
        written = sum(item.batch.size() for item in items)
        with self._cv:
            for item in items:
                self._account(item.batch, -1)
                self._replay_ids.discard(item.record_id)
            for run_id, messages in rejected.items():
                if messages:
                    self._rejected[run_id].extend(messages)
                    self.metrics.count_error("rejected", len(messages))
                    logger.error("shard %d: MLflow refused %d value(s): %s",
                                 self.config.index, len(messages), "; ".join(messages[:5]))
            self.points_written += written
            self.last_error = ""
            self.state = WriterState.IDLE
            self._cv.notify_all()
        self.metrics.count_written(written, time.monotonic() - started)

    # --- console logs ----------------------------------------------------------------------
    def _log_path(self, run_id: str, name: str) -> Path:
        return self.log_dir / run_id / name

    def _append_logs(self, items: list[SpooledBatch]) -> None:
        for item in items:
            for name, text in item.batch.logs:
                path = self._log_path(item.batch.params_run_id, name)
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a", encoding="utf-8") as fh:
                    fh.write(text)
                self._dirty_logs.add((item.batch.params_run_id, name))

    def _upload_logs(self, all_dirty: bool) -> None:
        with self._cv:
            due = set(self._logs_due)
        uploaded_runs: set[str] = set()
        for run_id, name in sorted(self._dirty_logs):
            if not all_dirty and run_id not in due:
                continue
            try:
                self.writer.upload_file(run_id, self._log_path(run_id, name), "logs")
            except TransientWriteError as exc:
                self.last_error = str(exc)
                return
            self._dirty_logs.discard((run_id, name))
            uploaded_runs.add(run_id)
        with self._cv:
            pending_logs = {run for run, _ in self._dirty_logs}
            queued = {item.batch.params_run_id for item in self._queue}
            self._logs_due -= {r for r in due if r not in pending_logs and r not in queued}
            self._cv.notify_all()

    def _report_levels(self) -> None:
        with self._cv:
            depth = sum(p.points + p.params + p.tags + p.files for p in self._pending.values())
            backlog = len(self._replay_ids)
        self.metrics.set_levels(depth, self.spool.size_bytes(), backlog)


class Shard:
    """The Ray actor wrapping :class:`ShardCore`. Threaded: ingest calls run concurrently."""

    def __init__(self, config: ShardConfig) -> None:
        self.core = ShardCore(config)

    def ingest(self, batch: Batch) -> bool:
        return self.core.ingest(batch)

    def wait_landed(self, run_ids: list[str], timeout_s: float) -> LandedReport:
        return self.core.wait_landed(run_ids, timeout_s)

    def latest(self, run_id: str) -> dict[str, tuple[float, int]]:
        return self.core.latest(run_id)

    def last_steps(self, run_id: str, keys: list[str], timeout_s: float) -> dict[str, int]:
        return self.core.last_steps(run_id, keys, timeout_s)

    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def ping(self) -> bool:
        return True
