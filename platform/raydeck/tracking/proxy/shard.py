"""A writer shard: accepts trackers' batches, spools them, writes them to MLflow run by run.

This module is the shard's core (:class:`ShardCore`: accepting, answering, planning and
accounting for the writers' steps); beside it: :mod:`~raydeck.tracking.proxy.run_queue` (per-run
queues), :mod:`~raydeck.tracking.proxy.run_writes` (each step's MLflow calls),
:mod:`~raydeck.tracking.proxy.cross_rank`, :mod:`~raydeck.tracking.proxy.log_upload` (console logs),
:mod:`~raydeck.tracking.proxy.dead_letters`, :mod:`~raydeck.tracking.proxy.step_fences` (a
resumed attempt's repeats), :mod:`~raydeck.tracking.proxy.shard_writers` (the writer threads:
taking runs in turn, each step and its accounting) and
:mod:`~raydeck.tracking.proxy.shard_actor` (the Ray actor).

Owns: acknowledging a batch only once it is in the spool; per-run queues drained fairly by a
few writer threads (one run's trouble, a refused artifact or a huge backlog, never delays another
run's data); creating, reopening and ending runs in order with their data (so a tracker can
attach and log while MLflow is down); retrying transient failures with backoff, as long as it
takes; setting permanent refusals aside as dead letters, recorded on the run when it ends; each
run's console logs, uploaded in parts that hold only what is new; the cross-rank views of
``all_ranks`` mode; answering "has this run's data landed?" and "which steps does it hold?",
and keeping one attempt's values per step of the keys a resumed attempt named. Does not own:
run membership (the router) or validation (the tracker).

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
import itertools
import logging
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from raydeck.tracking.messages import (
    Batch,
    IngestResult,
    LandedReport,
    Pending,
    Resolution,
    ShardConfig,
)
from raydeck.tracking.proxy.cross_rank import CrossRank
from raydeck.tracking.proxy.dead_letters import DeadLetters
from raydeck.tracking.proxy.direct_store import describe_write_path
from raydeck.tracking.proxy.metrics import ShardMetrics
from raydeck.tracking.proxy.run_queue import (
    BY_SIZE,
    COUNTED,
    RunQueue,
    batch_entities,
    sum_pending,
)
from raydeck.tracking.proxy.run_writes import RunWrites
from raydeck.tracking.proxy.shard_writers import ShardWriters
from raydeck.tracking.proxy.spool import (
    KIND_END,
    KIND_FILE,
    KIND_INPUT,
    KIND_LOG,
    KIND_METRICS,
    KIND_PARAMS,
    KIND_TAGS,
    Entity,
    NewEntity,
    Spool,
)
from raydeck.tracking.proxy.step_fences import StepFences
from raydeck.tracking.proxy.writer import (
    MlflowWriter,
    PermanentWriteError,
    TransientWriteError,
)

logger = logging.getLogger(__name__)

CHUNK_MAX_BYTES = 8 * 1024 * 1024
# How long setting a run's fences waits for batches of the run already past their fence check
# to be spooled: a spool commit, milliseconds, at most the spool's busy timeout.
SETTLE_TIMEOUT_S = 30.0


class WriterState(enum.Enum):
    """What the shard's writers are doing; shown by ``raydeck tracking status``."""

    IDLE = "idle"
    WRITING = "writing"
    BACKING_OFF = "backing_off"
    STOPPED = "stopped"


class ShardCore(ShardWriters):
    """The shard's logic, independent of Ray's actor machinery."""

    def __init__(self, config: ShardConfig) -> None:
        os.environ.update(config.env)
        self.config = config
        self.spool = Spool(Path(config.spool_dir), fsync=config.fsync)
        self.writer = MlflowWriter(config.tracking_uri, request_timeout_s=config.mlflow_timeout_s,
                                   write_uri=config.write_uri, writers=config.writers)
        self.metrics = ShardMetrics(config.index)
        self.received = 0
        self.written = 0
        self.transient_errors = 0
        self.last_error = ""
        self._cv = threading.Condition()
        self._runs: dict[str, RunQueue] = {}
        self._order: list[str] = []
        self._cursor = 0
        self._busy_writers = 0
        self._latest: dict[str, dict[str, tuple[float, int]]] = {}
        # Per run and metric key, the highest step received: what a restarted job must not log
        # again. Not ``_latest``: a resumed job re-logs its checkpoint's older steps first.
        self._highest_steps: dict[str, dict[str, int]] = {}
        # Resumed keys: one attempt's values per step (step_fences). ``_admitted``: per ticket,
        # the run of a batch past its fence check whose steps are not in _highest_steps yet.
        self._fences = StepFences()
        self._admitted: dict[int, str] = {}
        self._tickets = itertools.count()
        self._cross_rank = CrossRank()
        self._stopping = False
        self._recovered = 0
        self.dead = DeadLetters(config.index, self.spool, self.metrics, self._cv)
        self.writes = RunWrites(config.index, self.spool, self.writer, self.dead, self._cv,
                                self._runs)
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
            run.counts[COUNTED[kind]] += n if kind in BY_SIZE else entities
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

    def _run(self, key: str) -> RunQueue:
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = RunQueue(key)
            self._order.append(key)
        return run

    # --- accepting (many threads) -------------------------------------------------------------
    def ingest(self, batch: Batch) -> IngestResult:
        """Accept a batch: spooled before this returns. A re-delivery is acknowledged, dropped;
        so are the points its run's fences hold from another attempt (:meth:`_admit`).

        Raises:
            TrackingSpoolFullError: no room on the spool's disk (the tracker keeps the batch).
        """
        missing = tuple(ref.upload_id for ref in batch.files
                        if self.spool.upload_size(ref.upload_id) != ref.size)
        if missing:
            return IngestResult(False, missing)
        ticket = None
        if batch.points:
            batch, ticket = self._admit(batch)
        accepted = None
        try:
            entities = batch_entities(batch)
            if batch.rank_of is not None and batch.points:
                derived = self._cross_rank.feed(batch.run_key, batch.points, *batch.rank_of)
                if derived:
                    entities.append(NewEntity(batch.run_key, KIND_METRICS, len(derived),
                                              derived))
            accepted = self._accept(batch.client_id, batch.seq, entities)
        finally:
            if ticket is not None and accepted is None:  # a re-delivery, or refused
                with self._cv:
                    del self._admitted[ticket]
                    self._cv.notify_all()
        if accepted is None:
            return IngestResult(True)
        latest = self._latest.setdefault(batch.run_key, {})
        batch_highest: dict[str, int] = {}
        for key, value, _, step in batch.points:
            latest[key] = (value, step)
            if step > batch_highest.get(key, -1):
                batch_highest[key] = step
        self._enqueued(accepted, ticket, batch_highest)
        self.metrics.count_received(batch.size())
        return IngestResult(True)

    def _admit(self, batch: Batch) -> tuple[Batch, int]:
        """The batch without the points its run's fences drop (step_fences), and its ticket:
        it counts as on its way until its steps are in ``_highest_steps``, so that a fence being
        set waits for it (:meth:`_set_fences`)."""
        run_key = batch.run_key
        with self._cv:
            kept = (self._fences.admit(run_key, batch.client_id, batch.points)
                    if run_key in self._fences else None)
            ticket = next(self._tickets)
            self._admitted[ticket] = run_key
        if kept is None:
            return batch, ticket
        dropped = len(batch.points) - len(kept)
        logger.info("shard %d: run %s: dropped %d value(s) of client %s at steps an earlier "
                    "attempt logged (a resumed job's repeats)", self.config.index, run_key,
                    dropped, batch.client_id[:8])
        return replace(batch, points=kept), ticket

    def control(self, run_key: str, kind: str, payload: Any) -> None:
        """Queue a run update from the router: ``open`` (an :class:`OpenRun`), ``tags``, ``end``.

        Durable when this returns, and written in order with the run's data.
        """
        n = len(payload) if kind == KIND_TAGS else 1
        accepted = self._accept(None, None, [NewEntity(run_key, kind, n, payload)])
        assert accepted is not None
        self._enqueued(accepted)

    def put_chunk(self, upload_id: str, offset: int, data: bytes) -> int:
        """Store part of an artifact file; returns the bytes held so far (see Spool)."""
        return self.spool.append_chunk(upload_id, offset, data)

    def _accept(self, client_id: str | None, seq: int | None, entities: list[NewEntity]
                ) -> list[Entity] | None:
        """The spool's :meth:`~raydeck.tracking.proxy.spool.Spool.accept`, with ``entities``
        counted in their runs' queues first (and uncounted if the spool keeps none of them).

        Why first: batches of one run arrive on several threads at once, and a writer plans
        from the spool, so it could write (and uncount, never below zero) an entity this thread
        had spooled but not yet counted; counted afterwards, it stayed pending for good, its
        run never landed (1,024 ranks on the bulk direct path: ``wait_runs_landed`` waited on
        "2 metric points" of a spool that held none). Counted first, a run is never short of
        what a writer can find in the spool; until the spool has it, it is in flight anyway.
        """
        self._count(entities, 1)
        accepted = None
        try:
            accepted = self.spool.accept(client_id, seq, entities)
        finally:
            if accepted is None:  # a re-delivery, or the spool refused
                self._count(entities, -1)
        return accepted

    def _count(self, entities: list[NewEntity], sign: int) -> None:
        """Add (``sign`` 1) or take back (-1) ``entities`` in their runs' pending counts."""
        now = time.monotonic()
        with self._cv:  # batches of one run may arrive on several threads at once
            for entity in entities:
                run = self._run(entity.run_key)
                run.counts[COUNTED[entity.kind]] += sign * (
                    entity.n if entity.kind in BY_SIZE else 1)
                run.entities += sign
                if entity.kind == KIND_END:
                    run.ends_pending += sign
                if entity.kind == KIND_LOG and run.log_since is None and sign > 0:
                    run.log_since = now
                if entity.kind in (KIND_METRICS, KIND_PARAMS, KIND_TAGS, KIND_FILE, KIND_INPUT):
                    self.received += sign * entity.n
            self._cv.notify_all()

    def _enqueued(self, accepted: list[Entity], ticket: int | None = None,
                  batch_highest: dict[str, int] | None = None) -> None:
        """Wake the writers for accepted (already counted) entities; ``ticket``: an admitted
        batch's, whose highest steps per key (``batch_highest``) count as received from now
        on."""
        with self._cv:
            if ticket is not None:
                run_key = self._admitted.pop(ticket)
                if batch_highest:
                    highest = self._highest_steps.setdefault(run_key, {})
                    for key, step in batch_highest.items():
                        highest[key] = max(step, highest.get(key, -1))
            if accepted:
                self._cv.notify_all()

    # --- questions (the "wait" concurrency group) -----------------------------------------------
    def wait_landed(self, run_keys: list[str], timeout_s: float) -> LandedReport:
        """Block until every accepted entity of these runs is written (or set aside).

        Never blocks longer than ``timeout_s``; the report then says exactly what is pending.
        Console text of these runs is uploaded at once while this waits, also text that
        arrives after the wait began (a process's last output can follow its run's end), not
        after :data:`LOG_UPLOAD_INTERVAL_S`.
        """
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                runs = [self._runs[k] for k in run_keys if k in self._runs]
                waiting = [run for run in runs if not run.empty]
                if any(not run.log_due for run in waiting):
                    for run in waiting:
                        run.log_due = True
                    self._cv.notify_all()
                if not waiting:
                    letters = tuple(d for k in run_keys for d in self.spool.dead_letters(k))
                    return LandedReport(True, Pending(), letters)
                left = deadline - time.monotonic()
                if left <= 0:
                    total = sum_pending([run.pending() for run in waiting])
                    letters = tuple(d for k in run_keys for d in self.spool.dead_letters(k))
                    stuck = tuple(f"run {run.key}: {run.pending().describe()}" for run in waiting)
                    return LandedReport(False, total, letters, stuck)
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

    def last_steps(self, run_key: str, keys: list[str], timeout_s: float,
                   resumed_by: str | None = None) -> dict[str, int]:
        """The highest step of each metric key a run holds, written or pending (-1: none).

        Waits up to ``timeout_s`` for the run's pending metric points to land so that MLflow's
        history is complete, but only while MLflow answers: during an outage it answers at
        once from what is pending here and the highest steps this shard received (a restarted
        job must not wait for MLflow; it re-logs its checkpoint's older steps before it asks).
        Only points are waited for: console text is uploaded every ``LOG_UPLOAD_INTERVAL_S``
        (30 s), and a restarted worker that waited for it sat in ``restore`` that long.

        ``resumed_by``: the client id of an attempt that drops these steps because it resumes
        the run; the answer then also fences ``keys`` (:mod:`~raydeck.tracking.proxy.step_fences`),
        so that a batch of an earlier attempt still on its way cannot log a step twice.
        """
        deadline = time.monotonic() + timeout_s
        earlier: list[int] = []
        with self._cv:
            while True:
                run = self._runs.get(run_key)
                if run is None or run.counts["points"] == 0 or run.attempts > 0:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(min(left, 0.5))
            backing_off = run is not None and run.attempts > 0
            received = self._highest_steps.get(run_key, {})
            highest = {key: received.get(key, -1) for key in keys}
            if resumed_by is not None:
                # From here on every batch of the run meets the fences; those admitted before
                # are waited for at the end.
                self._fences.open(run_key, keys)
                earlier = [t for t, key in self._admitted.items() if key == run_key]
        for key, step in self.spool.max_steps(run_key, keys).items():
            highest[key] = max(highest[key], step)
        resolution = None if backing_off else self.resolve(run_key, 0)
        if resolution is not None:
            try:
                for key in keys:
                    for step in self.writer.history_steps(resolution.run_id, key):
                        highest[key] = max(highest[key], step)
            except (TransientWriteError, PermanentWriteError) as exc:
                logger.warning("shard %d: cannot read the metric history of run %s: %s",
                               self.config.index, run_key, exc)
        if resumed_by is not None:
            self._set_fences(run_key, highest, earlier)
        return highest

    def _set_fences(self, run_key: str, highest: dict[str, int], earlier: list[int]) -> None:
        """Fence ``highest``'s keys at the steps the run holds, raised to what this shard
        received meanwhile, once the batches admitted before the fences opened (``earlier``
        tickets) count in it: each point either counts in the answer or meets the fences."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        with self._cv:
            while any(t in self._admitted for t in earlier):
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.warning("shard %d: run %s: a batch was still being spooled after "
                                   "%.0f s; its steps may repeat in the resumed attempt",
                                   self.config.index, run_key, SETTLE_TIMEOUT_S)
                    break
                self._cv.wait(min(0.5, left))
            received = self._highest_steps.get(run_key, {})
            for key, step in highest.items():
                highest[key] = max(step, received.get(key, -1))
            self._fences.close(run_key, highest)

    def stats(self) -> dict[str, Any]:
        with self._cv:
            runs = [
                {"key": run.key, "run_id": run.record.run_id if run.record else "",
                 "pending": run.pending().describe() if not run.empty else "",
                 "entities": run.entities, "dead_letters": self.dead.counts.get(run.key, 0),
                 "last_error": run.last_error,
                 "state": ("backing_off" if run.backing_off(time.monotonic())
                           else "writing" if run.in_flight or run.meta_busy or run.file_busy
                           else "idle")}
                for run in self._runs.values()
                if not run.empty or self.dead.counts.get(run.key) or run.last_error
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
            "dead_letters": sum(self.dead.counts.values()),
            "repeats_dropped": self._fences.dropped,
            "write_errors": self.transient_errors,
            "last_error": self.last_error,
            "write_path": describe_write_path(self.config.tracking_uri, self.config.write_uri),
        }

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        for thread in self._threads:
            thread.join(timeout_s)
        self.spool.close()
