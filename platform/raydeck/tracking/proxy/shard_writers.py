"""The writer threads of a shard: each takes the next step of a run in turn, does it, and
accounts for it (part of :class:`~raydeck.tracking.proxy.shard.ShardCore`).

Owns: fair draining (runs taken in turn, so one run's backlog or trouble never delays another's
data), doing one step (open, find, a console-log part, metrics, params and tags, a file, an end;
:mod:`~raydeck.tracking.proxy.run_writes` makes the MLflow calls), and the accounting after it:
done (written or set aside) frees the run, a transient failure backs the run off (a failing file
alone), and the evidence rules that turn repeated failures into dead letters
(:data:`UNCLASSIFIED_MAX_ATTEMPTS`, :data:`REFUSED_FILE_ATTEMPTS`). Accepting, answering and the
threads' start and stop are the core's.
"""

from __future__ import annotations

import logging
import threading
import time

from raydeck.tracking.messages import ShardConfig
from raydeck.tracking.proxy.dead_letters import DeadLetters
from raydeck.tracking.proxy.log_upload import upload_log_part
from raydeck.tracking.proxy.metrics import ShardMetrics
from raydeck.tracking.proxy.run_queue import BY_SIZE, COUNTED, RunQueue, Work, backoff_s, plan_step
from raydeck.tracking.proxy.run_writes import RunWrites
from raydeck.tracking.proxy.spool import KIND_END, Spool
from raydeck.tracking.proxy.writer import MlflowWriter, PermanentWriteError, TransientWriteError

logger = logging.getLogger(__name__)

IDLE_WAKE_S = 1.0
UNCLASSIFIED_MAX_ATTEMPTS = 8
# A file the artifact store answers 5xx to this many times, while it accepted other files
# since, is refused for good (MLflow's artifact proxy answers a bare 500 for both "this path
# can never exist" and "my S3 is down"; only the second lets other uploads through).
REFUSED_FILE_ATTEMPTS = 6


class ShardWriters:
    """The writer loop and its accounting; :class:`~raydeck.tracking.proxy.shard.ShardCore`
    sets every attribute below before it starts the threads."""

    config: ShardConfig
    spool: Spool
    writer: MlflowWriter
    writes: RunWrites
    dead: DeadLetters
    metrics: ShardMetrics
    written: int
    transient_errors: int
    last_error: str
    _cv: threading.Condition
    _runs: dict[str, RunQueue]
    _order: list[str]
    _cursor: int
    _busy_writers: int
    _stopping: bool
    _recovered: int

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

    def _next_work(self) -> Work | None:
        """The next step, taking runs in turn (fair draining). Caller holds ``_cv``."""
        now = time.monotonic()
        count = len(self._order)
        for offset in range(count):
            index = (self._cursor + offset) % count
            run = self._runs[self._order[index]]
            if run.empty or run.backoff_until > now:
                continue
            work = plan_step(run, self.spool, now)
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

    def _do(self, work: Work) -> None:
        run = work.run
        started = time.monotonic()
        try:
            if work.action == "open":
                done = self.writes.open(run, work.ids[0])
                written = 0
            elif work.action == "find":
                done, written = self.writes.find(run), 0
            elif work.action == "logs":
                done, written = upload_log_part(run, self.spool, self.writer, self.dead), 0
            else:
                entities = self.spool.load(run.key, work.ids)
                if work.action == "fail":
                    for entity in entities:
                        self.dead.set_aside(entity, entity.kind,
                                        f"run could not be opened: {run.failed_open}")
                    written = 0
                else:
                    assert run.record is not None
                    writes = self.writes
                    step = {"metrics": writes.write_values, "meta": writes.write_values,
                            "file": writes.write_file, "end": writes.write_end}[work.action]
                    written = step(run, run.record, entities)
                done = [(e.kind, e.n) for e in entities]
        except TransientWriteError as exc:
            self._failed(work, str(exc), exc.answered)
            return
        except PermanentWriteError as exc:
            # A refusal outside the places that set aside exactly one value: set aside what
            # this step held, never retry it.
            entities = self.spool.load(run.key, work.ids)
            for entity in entities:
                self.dead.set_aside(entity, entity.kind, str(exc))
            done, written = [(e.kind, e.n) for e in entities], 0
        self._finished(work, done, written)
        self.metrics.observe_write(time.monotonic() - started)

    # --- bookkeeping ----------------------------------------------------------------------------
    def _finished(self, work: Work, done: list[tuple[str, int]], written: int) -> None:
        """Account a step's entities as done (written or set aside) and free the run."""
        run = work.run
        with self._cv:
            for kind, n in done:
                name = COUNTED[kind]
                run.counts[name] = max(0, run.counts[name] - (n if kind in BY_SIZE else 1))
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
            run.release(work)
            self._cv.notify_all()
        if written:
            self.metrics.count_written(written)

    def _failed(self, work: Work, reason: str, answered: bool = False) -> None:
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
                run.file_retry[entity_id] = (
                    attempts, first, now + backoff_s(attempts, self.config.retry_max_s))
                if (answered and attempts >= REFUSED_FILE_ATTEMPTS
                        and self.writes.last_upload_ok > first):
                    give_up[entity_id] = (
                        f"the artifact store answered an error {attempts} times for this file "
                        f"while it accepted other files: {reason}")
            else:
                run.attempts += 1
                run.backoff_until = now + backoff_s(run.attempts, self.config.retry_max_s)
            first_failure = not run.warned
            run.warned = reason
            run.last_error = reason
            self.last_error = reason
            self.transient_errors += 1
            run.release(work)
            self._cv.notify_all()
        self.metrics.count_error("transient")
        if first_failure:
            logger.warning("shard %d: writing run %s failed, retrying with backoff: %s",
                           self.config.index, run.key, reason)
        if give_up:
            entities = self.spool.load(run.key, list(give_up))
            for entity in entities:
                self.dead.set_aside(entity, entity.kind, give_up[entity.id])
                run.file_retry.pop(entity.id, None)
            self._finished(Work(run, "fail", list(give_up)),
                           [(e.kind, e.n) for e in entities], 0)

    def _report_levels(self) -> None:
        with self._cv:
            depth = sum(run.entities for run in self._runs.values())
            recovered = self._recovered
        self.metrics.set_levels(depth, self.spool.size_bytes(), recovered)


