"""A shard's durable, append-only log of accepted batches: the reason nothing is lost.

A shard appends every batch here *before* acknowledging it, and appends a commit mark once the
batch is in MLflow. After a crash the shard reopens the spool and replays every batch without a
commit mark. Re-delivered batches are recognised by ``(client_id, seq)`` and dropped, and a batch
replayed after it partly reached MLflow writes identical points, which MLflow's SQL store keeps
once (its metric primary key is ``(run, key, timestamp, step, value)``), so nothing lands twice.

Layout under ``<dir>/``: ``seg-<n>.log`` segments of framed records (length, crc32, pickle) and
``blobs/<record id>/`` holding artifact files of pending batches. A torn record at the tail (the
process died mid-write) fails its crc and is cut off. At open, pending batches are rewritten into
a fresh segment and older segments deleted, so the spool stays as small as the backlog.

The write survives the shard process dying (the OS has the bytes); with ``fsync=True`` it also
survives the machine losing power, at the cost of one fsync per batch.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import struct
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from raydeck.tracking.messages import Batch

logger = logging.getLogger(__name__)

SEGMENT_MAX_BYTES = 64 * 1024 * 1024
COMPACT_AFTER_BYTES = 16 * 1024 * 1024
COMPACT_MAX_PENDING = 256
_HEADER = struct.Struct("<II")  # payload length, crc32 of payload


@dataclass
class SpooledBatch:
    """A batch accepted by the shard, under its shard-local record id."""

    record_id: int
    batch: Batch


class Spool:
    """Append-only record of accepted batches and their commit marks. Thread-safe."""

    def __init__(self, directory: Path, fsync: bool = False) -> None:
        self.directory = directory
        self.blob_dir = directory / "blobs"
        self.fsync = fsync
        self._lock = threading.Lock()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.blob_dir.mkdir(exist_ok=True)
        self._next_record_id = 1
        self._last_seq: dict[str, int] = {}
        pending = self._load()
        self._pending: dict[int, SpooledBatch] = {item.record_id: item for item in pending}
        self._segment_index = self._last_segment_index() + 1
        self._file = self._open_segment()
        old_segments = [p for p in self._segments() if p.name != self._segment_name()]
        for item in pending:
            self._append(("B", item.record_id, item.batch))
        self._append(("S", dict(self._last_seq)))
        self._flush()
        for path in old_segments:
            path.unlink()
        self._drop_orphan_blobs({item.record_id for item in pending})
        self.replayed = pending

    # --- recovery -------------------------------------------------------------------------
    def _segments(self) -> list[Path]:
        return sorted(self.directory.glob("seg-*.log"), key=lambda p: int(p.stem.split("-")[1]))

    def _last_segment_index(self) -> int:
        segments = self._segments()
        return int(segments[-1].stem.split("-")[1]) if segments else 0

    def _segment_name(self) -> str:
        return f"seg-{self._segment_index:08d}.log"

    def _load(self) -> list[SpooledBatch]:
        batches: dict[int, Batch] = {}
        for path in self._segments():
            for record in _read_records(path):
                kind = record[0]
                if kind == "B":
                    _, record_id, batch = record
                    batches[record_id] = batch
                    self._next_record_id = max(self._next_record_id, record_id + 1)
                    seen = self._last_seq.get(batch.client_id, -1)
                    self._last_seq[batch.client_id] = max(seen, batch.seq)
                elif kind == "C":
                    for record_id in record[1]:
                        batches.pop(record_id, None)
                elif kind == "S":
                    for client_id, seq in record[1].items():
                        self._last_seq[client_id] = max(self._last_seq.get(client_id, -1), seq)
        pending = [SpooledBatch(rid, batch) for rid, batch in sorted(batches.items())]
        if pending:
            logger.info("spool %s: replaying %d pending batches", self.directory, len(pending))
        return pending

    def _drop_orphan_blobs(self, keep: set[int]) -> None:
        for path in self.blob_dir.iterdir():
            if not path.name.isdigit() or int(path.name) not in keep:
                shutil.rmtree(path, ignore_errors=True)

    # --- writing --------------------------------------------------------------------------
    def _open_segment(self) -> BinaryIO:
        return open(self.directory / self._segment_name(), "ab")

    def _append(self, record: tuple) -> None:
        payload = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
        self._file.write(_HEADER.pack(len(payload), zlib.crc32(payload)))
        self._file.write(payload)

    def _flush(self) -> None:
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def is_duplicate(self, batch: Batch) -> bool:
        """True if this ``(client_id, seq)`` was accepted before (a re-delivery)."""
        return batch.seq <= self._last_seq.get(batch.client_id, -1)

    def accept(self, batch: Batch) -> SpooledBatch | None:
        """Durably record ``batch``; None if it is a re-delivery of an accepted one.

        Artifact bytes go to ``blobs/<record id>/`` and leave the batch, so the log stays small.
        """
        with self._lock:
            if self.is_duplicate(batch):
                return None
            record_id = self._next_record_id
            self._next_record_id += 1
            if batch.files:
                self._store_blobs(record_id, batch)
            self._append(("B", record_id, batch))
            self._flush()
            self._last_seq[batch.client_id] = batch.seq
            self._rotate_if_full()
            item = SpooledBatch(record_id, batch)
            self._pending[record_id] = item
            return item

    def _store_blobs(self, record_id: int, batch: Batch) -> None:
        root = self.blob_dir / str(record_id)
        stored = []
        for path, data in batch.files:
            target = root / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            stored.append((path, b""))
        batch.files = stored

    def blob_root(self, record_id: int) -> Path:
        return self.blob_dir / str(record_id)

    def commit(self, record_ids: list[int]) -> None:
        """Mark records as written to MLflow; their blobs are deleted.

        When the segment has grown past ``COMPACT_AFTER_BYTES`` and little is pending, the
        pending records move to a fresh segment and the old ones are deleted, so the spool
        stays as small as the backlog during long runs.
        """
        if not record_ids:
            return
        with self._lock:
            self._append(("C", record_ids))
            self._flush()
            for record_id in record_ids:
                self._pending.pop(record_id, None)
            if (
                self._file.tell() > COMPACT_AFTER_BYTES
                and len(self._pending) <= COMPACT_MAX_PENDING
            ):
                self._compact()
        for record_id in record_ids:
            shutil.rmtree(self.blob_root(record_id), ignore_errors=True)

    def _rotate_if_full(self) -> None:
        if self._file.tell() < SEGMENT_MAX_BYTES:
            return
        self._file.close()
        self._segment_index += 1
        self._file = self._open_segment()
        self._append(("S", dict(self._last_seq)))
        self._flush()

    def size_bytes(self) -> int:
        total = 0
        for root, _dirs, files in os.walk(self.directory):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        return total

    def _compact(self) -> None:
        old = self._segments()
        self._file.close()
        self._segment_index += 1
        self._file = self._open_segment()
        for item in self._pending.values():
            self._append(("B", item.record_id, item.batch))
        self._append(("S", dict(self._last_seq)))
        self._flush()
        for path in old:
            if path.name != self._segment_name():
                path.unlink(missing_ok=True)

    @property
    def pending_records(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        with self._lock:
            self._flush()
            self._file.close()


def _read_records(path: Path) -> Iterator[tuple]:
    """Yield every intact record of a segment; cut a torn tail."""
    good_end = 0
    with open(path, "rb") as fh:
        while True:
            header = fh.read(_HEADER.size)
            if len(header) < _HEADER.size:
                break
            length, crc = _HEADER.unpack(header)
            payload = fh.read(length)
            if len(payload) < length or zlib.crc32(payload) != crc:
                logger.warning("spool %s: torn record at byte %d cut off", path, good_end)
                break
            good_end = fh.tell()
            yield pickle.loads(payload)
    if good_end < path.stat().st_size:
        with open(path, "r+b") as fh:
            fh.truncate(good_end)
