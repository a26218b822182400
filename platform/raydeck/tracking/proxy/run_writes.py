"""One step of each kind a shard's writer takes for a run: open (create or reopen its MLflow
run, under its parent), find (a run opened elsewhere), write values (metrics, params, tags,
dataset inputs), upload a file, and end it (recording its dead letters first).

Owns: :class:`RunWrites`, what each step sends to MLflow and what it takes off the spool. The
shard (:mod:`raydeck.tracking.proxy.shard`) plans the steps, runs them on its writer threads and
accounts for them; a refusal for good goes to
:class:`~raydeck.tracking.proxy.dead_letters.DeadLetters`.
"""

from __future__ import annotations

import threading
import time

from raydeck.tracking.messages import DeadLetter, OpenRun, Point
from raydeck.tracking.proxy.dead_letters import DeadLetters
from raydeck.tracking.proxy.run_queue import RunQueue
from raydeck.tracking.proxy.spool import (
    KIND_END,
    KIND_FILE,
    KIND_INPUT,
    KIND_METRICS,
    KIND_OPEN,
    KIND_PARAMS,
    KIND_TAGS,
    Entity,
    RunRecord,
    Spool,
)
from raydeck.tracking.proxy.writer import (
    MlflowWriter,
    OpenedRun,
    PermanentWriteError,
    TransientWriteError,
)

PARENT_WAIT_S = 3600.0


class RunWrites:
    """The writes of one shard; ``cv`` is the shard's condition (guards the run queues)."""

    def __init__(self, index: int, spool: Spool, writer: MlflowWriter, dead: DeadLetters,
                 cv: threading.Condition, runs: dict[str, RunQueue]) -> None:
        self.index = index
        self.spool = spool
        self.writer = writer
        self.dead = dead
        self._cv = cv
        self._runs = runs
        # Monotonic time of the last file the artifact store accepted (the evidence that a
        # file it keeps refusing is refused for good, not an outage).
        self.last_upload_ok = 0.0

    def open(self, run: RunQueue, entity_id: int) -> list[tuple[str, int]]:
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
            self.dead.set_aside(entity, KIND_OPEN, str(exc))
            return [(KIND_OPEN, 1)]
        self._record(run, opened)
        self.spool.remove([entity])
        return [(KIND_OPEN, 1)]

    def _parent_run_id(self, run: RunQueue, parent_key: str) -> str | None:
        parent = self._runs.get(parent_key)
        record = parent.record if parent is not None else None
        record = record or self.spool.run_record(parent_key)
        if record is not None:
            return record.run_id
        try:
            found = self.writer.find_run(parent_key)
        except PermanentWriteError as exc:
            self.dead.note(run.key, "tag", "mlflow.parentRunId", str(exc))
            return None
        if found is not None:
            return str(found.info.run_id)
        now = time.monotonic()
        run.waiting_parent_since = run.waiting_parent_since or now
        if now - run.waiting_parent_since < PARENT_WAIT_S:
            raise TransientWriteError(f"parent run {parent_key!r} does not exist in MLflow yet")
        self.dead.note(run.key, "tag", "mlflow.parentRunId",
                             f"parent run {parent_key!r} never appeared in MLflow")
        return None

    def find(self, run: RunQueue) -> list[tuple[str, int]]:
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

    def _record(self, run: RunQueue, opened: OpenedRun) -> None:
        record = RunRecord(run.key, opened.run_id, opened.experiment_id, opened.mode,
                           opened.name, opened.resumed, opened.params)
        self.spool.record_run(record)
        with self._cv:
            run.record = record
            run.waiting_parent_since = None
            self._cv.notify_all()

    def write_values(self, run: RunQueue, record: RunRecord, entities: list[Entity]) -> int:
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
        self.dead.count(run.key, letters)
        params = sum(e.n for e in entities if e.kind == KIND_PARAMS)
        return len(points) + params + len(tags) - len(letters)

    def write_file(self, run: RunQueue, record: RunRecord, entities: list[Entity]) -> int:
        entity = entities[0]
        ref = entity.payload
        try:
            path = self.spool.stage(entity.id, ref.upload_id, ref.name)
            self.writer.upload_file(record.run_id, path, ref.artifact_dir)
        except (PermanentWriteError, ValueError) as exc:
            self.dead.set_aside(entity, KIND_FILE, str(exc))
            return 0
        self.spool.remove(entities)
        with self._cv:
            self.last_upload_ok = time.monotonic()
            run.file_retry.pop(entity.id, None)
        return 1

    def write_end(self, run: RunQueue, record: RunRecord, entities: list[Entity]) -> int:
        """Record the run's dead letters on it (tag + artifact), then end it."""
        self.dead.record_on_run(run.key, record.run_id, self.writer)
        try:
            self.writer.end_run(record.run_id, entities[0].payload)
        except PermanentWriteError as exc:
            self.dead.set_aside(entities[0], KIND_END, str(exc))
            return 0
        self.spool.remove(entities)
        return 0
