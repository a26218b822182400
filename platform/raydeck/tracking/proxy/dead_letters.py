"""A shard's dead letters: values MLflow refused for good, set aside in the spool and recorded
on their run when it ends (the ``raydeck.dead_letters`` tag and a JSON artifact).

Owns: :class:`DeadLetters` (setting an entity or one value of it aside, counting them per run
for ``raydeck tracking status`` and the shard's metrics, and recording them on the run).
"""

from __future__ import annotations

import json
import logging
import tempfile
import threading
from pathlib import Path

from raydeck.tracking.messages import DeadLetter
from raydeck.tracking.proxy.metrics import ShardMetrics
from raydeck.tracking.proxy.spool import (
    KIND_END,
    KIND_FILE,
    KIND_INPUT,
    KIND_LOG,
    KIND_OPEN,
    Entity,
    Spool,
)
from raydeck.tracking.proxy.writer import MlflowWriter, PermanentWriteError

logger = logging.getLogger(__name__)

DEAD_LETTERS_TAG = "raydeck.dead_letters"
DEAD_LETTERS_ARTIFACT = "raydeck/dead_letters.json"


class DeadLetters:
    """The dead letters of one shard; ``lock`` is the shard's condition (guards the counts)."""

    def __init__(self, index: int, spool: Spool, metrics: ShardMetrics,
                 lock: threading.Condition) -> None:
        self.index = index
        self.spool = spool
        self.metrics = metrics
        self._lock = lock
        # Per run key: how many were set aside (read under the shard's lock).
        self.counts: dict[str, int] = spool.dead_letter_counts()

    def set_aside(self, entity: Entity, kind: str, reason: str) -> None:
        """Set a whole entity aside for good."""
        key = (entity.payload.name if kind in (KIND_FILE, KIND_INPUT)
               else entity.payload[0] if kind == KIND_LOG
               else entity.payload.key if kind == KIND_OPEN
               else str(entity.payload) if kind == KIND_END else kind)
        letter = self.spool.dead_letter(entity, key, reason)
        self.count(entity.run_key, [letter])
        logger.error("shard %d: %s %r of run %s refused for good, set aside: %s",
                     self.index, kind, key, entity.run_key, reason)

    def note(self, run_key: str, kind: str, key: str, reason: str) -> None:
        """A dead letter for a value that is part of an entity, not one of its own."""
        letter = DeadLetter(run_key, kind, key, reason)
        self.spool.add_dead_letters([letter])
        self.count(run_key, [letter])

    def count(self, run_key: str, letters: list[DeadLetter]) -> None:
        if letters:
            with self._lock:
                self.counts[run_key] = self.counts.get(run_key, 0) + len(letters)
            self.metrics.count_error("rejected", len(letters))

    def record_on_run(self, run_key: str, run_id: str, writer: MlflowWriter) -> None:
        """Before a run ends: its dead letters as a tag and an artifact (once each)."""
        if not self.spool.dead_letters(run_key, unrecorded_only=True):
            return
        letters = self.spool.dead_letters(run_key)
        with tempfile.TemporaryDirectory(prefix="raydeck-dead-") as tmp:
            path = Path(tmp) / Path(DEAD_LETTERS_ARTIFACT).name
            path.write_text(json.dumps(
                [{"kind": d.kind, "key": d.key, "reason": d.reason, "kept_at": d.kept_at}
                 for d in letters], indent=2))
            try:
                writer.upload_file(run_id, path, str(Path(DEAD_LETTERS_ARTIFACT).parent))
            except PermanentWriteError as exc:
                # The artifact store refuses this run's files; the tag still says it, and
                # `raydeck tracking status` lists them.
                logger.error("shard %d: run %s: cannot upload %s: %s", self.index,
                             run_key, DEAD_LETTERS_ARTIFACT, exc)
        writer.log_batch(run_id, [], {}, {DEAD_LETTERS_TAG: str(len(letters))})
        self.spool.mark_recorded(run_key)
