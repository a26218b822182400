"""Console-log uploads: a run's captured console text, uploaded to ``logs/<name>/`` in parts
that each hold only what is new.

Owns: uploading one part (:func:`upload_log_part`); when a run's logs are due is its queue's
question (:meth:`~raydeck.tracking.proxy.run_queue.RunQueue.logs_due`). A part is named by its first
entity's id, so uploading it again after a crash (before the entities were removed) overwrites
the same file instead of repeating lines.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from raydeck.tracking.proxy.dead_letters import DeadLetters
from raydeck.tracking.proxy.run_queue import WINDOW_ENTITIES, RunQueue
from raydeck.tracking.proxy.spool import KIND_LOG, Entity, Spool
from raydeck.tracking.proxy.writer import MlflowWriter, PermanentWriteError

LOG_PART_MAX_BYTES = 8 * 1024 * 1024


def upload_log_part(run: RunQueue, spool: Spool, writer: MlflowWriter,
                    dead: DeadLetters) -> list[tuple[str, int]]:
    """Upload the oldest console text of one log file as a part holding only new text; the
    ``(kind, n)`` of each entity done (uploaded or set aside)."""
    if run.record is None:
        return []
    ids = [entity_id for entity_id, kind, _ in spool.window(run.key, WINDOW_ENTITIES)
           if kind == KIND_LOG]
    entities = spool.load(run.key, ids) if ids else []
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
            writer.upload_file(run.record.run_id, path, f"logs/{stem}")
        except PermanentWriteError as exc:
            for entity in part:
                dead.set_aside(entity, KIND_LOG, str(exc))
            return [(KIND_LOG, e.n) for e in part]
    spool.remove(part)
    return [(KIND_LOG, e.n) for e in part]
