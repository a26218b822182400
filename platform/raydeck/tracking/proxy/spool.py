"""A shard's durable queue: what it accepted and has not yet written, in SQLite (WAL mode).

Owns: recording accepted entities before a batch is acknowledged, idempotent re-delivery
(``(client_id, seq)`` seen once), artifact bytes streamed in chunks into ``uploads/``, the map of
run keys to MLflow run ids, the dead letters, and deleting what was written. Does not own: what
to write when (the shard) or how (the writer).

Why SQLite: transactions make "accepted" atomic (a batch is in, with its dedup mark, or not at
all), the per-run index lets the writer read a run's oldest entities without loading the
backlog, and progress is committed entity by entity, so a blip during a long catch-up costs one
chunk, never the cycle. Nothing is replayed on restart: the queue *is* the database, and only
counts are read back into memory. A full disk surfaces as :class:`TrackingSpoolFullError` at
``accept`` (the tracker keeps its batch and retries); nothing acknowledged is ever lost.

Durability: WAL with ``synchronous=NORMAL`` survives a killed process (every acknowledged batch
was committed); ``fsync=True`` (``RAYDECK_TRACKING_SPOOL_FSYNC``) uses ``synchronous=FULL`` and
fsyncs upload files and new directories too, so it survives a power cut.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pickle
import re
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raydeck.errors import TrackingSpoolFullError
from raydeck.tracking.messages import DeadLetter

logger = logging.getLogger(__name__)

SCHEMA_VERSION = "2"
DATABASE_FILE = "spool.db"
SEEN_KEEP_S = 7 * 24 * 3600.0
ABANDONED_UPLOAD_S = 24 * 3600.0
BUSY_TIMEOUT_S = 30.0

KIND_OPEN = "open"
KIND_METRICS = "metrics"
KIND_PARAMS = "params"
KIND_TAGS = "tags"
KIND_FILE = "file"
KIND_INPUT = "input"
KIND_LOG = "log"
KIND_END = "end"
KINDS = (KIND_OPEN, KIND_METRICS, KIND_PARAMS, KIND_TAGS, KIND_FILE, KIND_INPUT, KIND_LOG,
         KIND_END)

_UPLOAD_ID = re.compile(r"^[0-9a-f]{32}$")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entity (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_key TEXT NOT NULL,
    kind TEXT NOT NULL,
    n INTEGER NOT NULL,
    ref TEXT,
    payload BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS entity_run ON entity (run_key, id);
CREATE INDEX IF NOT EXISTS entity_ref ON entity (ref) WHERE ref IS NOT NULL;
CREATE TABLE IF NOT EXISTS seen (client_id TEXT PRIMARY KEY, seq INTEGER NOT NULL,
                                 at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS upload (id TEXT PRIMARY KEY, size INTEGER NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS run (key TEXT PRIMARY KEY, run_id TEXT NOT NULL,
                                experiment_id TEXT NOT NULL, mode TEXT NOT NULL,
                                name TEXT NOT NULL, resumed INTEGER NOT NULL,
                                params BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS dead_letter (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_key TEXT NOT NULL,
    kind TEXT NOT NULL,
    key TEXT NOT NULL,
    reason TEXT NOT NULL,
    kept_at TEXT NOT NULL,
    at REAL NOT NULL,
    recorded INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS dead_letter_run ON dead_letter (run_key, id);
"""


@dataclass(frozen=True)
class Entity:
    """One unit of pending work: written to MLflow in one call, or set aside as a whole.

    ``n`` is what it counts for: points, params or tags in it, bytes of console text, else 1.
    """

    id: int
    run_key: str
    kind: str
    n: int
    payload: Any


@dataclass(frozen=True)
class NewEntity:
    """An entity to accept; ``ref`` names the upload a file entity owns."""

    run_key: str
    kind: str
    n: int
    payload: Any
    ref: str | None = None


@dataclass(frozen=True)
class RunRecord:
    """A run key the shard has resolved to an MLflow run."""

    key: str
    run_id: str
    experiment_id: str
    mode: str
    name: str
    resumed: bool
    params: dict[str, str]


def _is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, sqlite3.OperationalError):
        return "full" in str(exc).lower()
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


class Spool:
    """The durable queue of one shard. Thread-safe: one connection, one short lock."""

    def __init__(self, directory: Path, fsync: bool = False) -> None:
        self.directory = directory
        self.uploads = directory / "uploads"
        self.staging = directory / "staging"
        self.dead = directory / "dead"
        self.fsync = fsync
        for path in (self.directory, self.uploads, self.staging, self.dead):
            path.mkdir(parents=True, exist_ok=True)
        self._warn_old_format()
        self._lock = threading.Lock()
        self._db = sqlite3.connect(directory / DATABASE_FILE, timeout=BUSY_TIMEOUT_S,
                                   isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
        self._db.executescript(_SCHEMA)
        self._db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)",
                         (SCHEMA_VERSION,))
        if fsync:
            _fsync_dir(self.directory)
        self._clean_at_start()

    # --- start-up ---------------------------------------------------------------------------
    def _warn_old_format(self) -> None:
        old = list(self.directory.glob("seg-*.log"))
        if old:
            logger.warning(
                "spool %s holds %d segment(s) of raydeck's old spool format; this version does "
                "not read them (drain them with the raydeck version that wrote them)",
                self.directory, len(old))

    def _clean_at_start(self) -> None:
        """Forget old dedup marks, abandoned uploads and half-done staging copies."""
        now = time.time()
        with self._lock:
            self._db.execute("DELETE FROM seen WHERE at < ?", (now - SEEN_KEEP_S,))
            known = {row[0] for row in self._db.execute("SELECT id FROM upload")}
            referenced = {row[0] for row in self._db.execute(
                "SELECT ref FROM entity WHERE ref IS NOT NULL")}
            for upload_id, at in list(self._db.execute("SELECT id, at FROM upload")):
                if upload_id not in referenced and now - at > ABANDONED_UPLOAD_S:
                    self._db.execute("DELETE FROM upload WHERE id = ?", (upload_id,))
                    known.discard(upload_id)
        for path in self.uploads.iterdir():
            if path.name not in known and path.name not in referenced:
                path.unlink(missing_ok=True)
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(exist_ok=True)

    # --- accepting --------------------------------------------------------------------------
    def accept(self, client_id: str | None, seq: int | None, entities: list[NewEntity]
               ) -> list[Entity] | None:
        """Durably record ``entities``; None if ``(client_id, seq)`` was accepted before.

        Raises:
            TrackingSpoolFullError: the spool's disk (or database) is full; nothing was kept.
        """
        rows = [(e.run_key, e.kind, e.n, e.ref,
                 pickle.dumps(e.payload, protocol=pickle.HIGHEST_PROTOCOL)) for e in entities]
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                if client_id is not None and seq is not None:
                    row = self._db.execute("SELECT seq FROM seen WHERE client_id = ?",
                                           (client_id,)).fetchone()
                    if row is not None and seq <= row[0]:
                        self._db.execute("ROLLBACK")
                        return None
                    self._db.execute("INSERT OR REPLACE INTO seen VALUES (?, ?, ?)",
                                     (client_id, seq, time.time()))
                accepted = []
                for (run_key, kind, n, ref, blob), entity in zip(rows, entities, strict=True):
                    cursor = self._db.execute(
                        "INSERT INTO entity (run_key, kind, n, ref, payload) "
                        "VALUES (?, ?, ?, ?, ?)", (run_key, kind, n, ref, blob))
                    assert cursor.lastrowid is not None
                    accepted.append(Entity(cursor.lastrowid, run_key, kind, n, entity.payload))
                self._db.execute("COMMIT")
                return accepted
            except sqlite3.Error as exc:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                if _is_disk_full(exc):
                    raise TrackingSpoolFullError(self._full_message()) from None
                raise

    def _full_message(self) -> str:
        free = shutil.disk_usage(self.directory).free
        return (f"the tracking spool at {self.directory} is full ({free // 1024**2} MiB free on "
                "its disk); the data stays in the logging process until there is room: free "
                "disk space on the head node")

    # --- artifact bytes ---------------------------------------------------------------------
    def upload_path(self, upload_id: str) -> Path:
        """The file holding an upload's bytes; ids are 32 hex digits, so never outside."""
        if not _UPLOAD_ID.match(upload_id):
            raise ValueError(f"upload id {upload_id!r} must be 32 hex digits")
        return self.uploads / upload_id

    def append_chunk(self, upload_id: str, offset: int, data: bytes) -> int:
        """Append ``data`` at ``offset`` of an upload; returns the upload's size afterwards.

        A chunk whose offset is not the current size (a retry after a lost answer, or a shard
        restart that lost a torn tail) writes nothing: the caller continues from the size
        returned. Durable once this returns.

        Raises:
            TrackingSpoolFullError: no room on the spool's disk.
        """
        path = self.upload_path(upload_id)
        with self._lock:
            size = path.stat().st_size if path.exists() else 0
            if offset != size:
                return size
            try:
                with path.open("ab") as fh:
                    fh.write(data)
                    fh.flush()
                    if self.fsync:
                        os.fsync(fh.fileno())
                self._db.execute("INSERT OR REPLACE INTO upload VALUES (?, ?, ?)",
                                 (upload_id, size + len(data), time.time()))
            except (OSError, sqlite3.Error) as exc:
                with contextlib.suppress(OSError):
                    os.truncate(path, size)
                if _is_disk_full(exc):
                    raise TrackingSpoolFullError(self._full_message()) from None
                raise
            if self.fsync and size == 0:
                _fsync_dir(self.uploads)
            return size + len(data)

    def upload_size(self, upload_id: str) -> int:
        path = self.upload_path(upload_id)
        return path.stat().st_size if path.exists() else 0

    def stage(self, entity_id: int, upload_id: str, name: str) -> Path:
        """A path named ``name`` holding an upload's bytes (a hard link), for MLflow's upload.

        ``name`` must be one plain path component; anything else raises ValueError, so no
        artifact name can place a file outside the spool.
        """
        if not name or name in (".", "..") or "/" in name or "\0" in name or len(name) > 255:
            raise ValueError(f"artifact file name {name!r} is not a plain file name")
        folder = self.staging / str(entity_id)
        folder.mkdir(exist_ok=True)
        target = folder / name
        if target.resolve().parent != folder.resolve():
            raise ValueError(f"artifact file name {name!r} is not a plain file name")
        target.unlink(missing_ok=True)
        os.link(self.upload_path(upload_id), target)
        return target

    def unstage(self, entity_id: int) -> None:
        shutil.rmtree(self.staging / str(entity_id), ignore_errors=True)

    # --- reading ----------------------------------------------------------------------------
    def pending_counts(self) -> Iterator[tuple[str, str, int, int]]:
        """``(run_key, kind, entities, n)`` for everything pending (read at start-up)."""
        with self._lock:
            rows = list(self._db.execute(
                "SELECT run_key, kind, COUNT(*), SUM(n) FROM entity GROUP BY run_key, kind"))
        yield from rows

    def window(self, run_key: str, limit: int) -> list[tuple[int, str, int]]:
        """``(id, kind, n)`` of a run's oldest ``limit`` pending entities, oldest first.

        Payloads stay on disk: :meth:`load` reads only what a writer takes.
        """
        with self._lock:
            return list(self._db.execute(
                "SELECT id, kind, n FROM entity WHERE run_key = ? ORDER BY id LIMIT ?",
                (run_key, limit)))

    def load(self, run_key: str, ids: list[int]) -> list[Entity]:
        """The entities with these ids, in id order (ids no longer pending are skipped)."""
        marks = ",".join("?" * len(ids))
        with self._lock:
            rows = list(self._db.execute(
                f"SELECT id, kind, n, payload FROM entity WHERE id IN ({marks}) ORDER BY id",
                ids))
        return [Entity(row[0], run_key, row[1], row[2], pickle.loads(row[3])) for row in rows]

    def max_steps(self, run_key: str, keys: list[str]) -> dict[str, int]:
        """The highest pending step of each metric key of a run (streamed, chunk by chunk)."""
        wanted = set(keys)
        highest: dict[str, int] = {}
        last_id = 0
        while True:
            with self._lock:
                rows = list(self._db.execute(
                    "SELECT id, payload FROM entity WHERE run_key = ? AND kind = ? AND id > ? "
                    "ORDER BY id LIMIT 64", (run_key, KIND_METRICS, last_id)))
            if not rows:
                return highest
            for entity_id, blob in rows:
                last_id = entity_id
                for key, _value, _stamp, step in pickle.loads(blob):
                    if key in wanted and step > highest.get(key, -1):
                        highest[key] = step

    def first_id_of_kind(self, run_key: str, kind: str) -> int | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id FROM entity WHERE run_key = ? AND kind = ? ORDER BY id LIMIT 1",
                (run_key, kind)).fetchone()
        return None if row is None else int(row[0])

    # --- progress ---------------------------------------------------------------------------
    def remove(self, entities: list[Entity], refused: list[DeadLetter] | None = None) -> None:
        """Forget written entities (and the bytes of written files), in one transaction.

        ``refused`` are single values MLflow refused inside them, recorded as dead letters in
        the same transaction, so a crash can neither lose nor repeat them.
        """
        if not entities:
            return
        uploads = [e.payload.upload_id for e in entities if e.kind == KIND_FILE]
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany("DELETE FROM entity WHERE id = ?",
                                     [(e.id,) for e in entities])
                self._db.executemany("DELETE FROM upload WHERE id = ?",
                                     [(u,) for u in uploads])
                self._db.executemany(
                    "INSERT INTO dead_letter (run_key, kind, key, reason, kept_at, at) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    [(d.run_key, d.kind, d.key, d.reason, d.kept_at, now)
                     for d in refused or []])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        for upload_id in uploads:
            self.upload_path(upload_id).unlink(missing_ok=True)
        for entity in entities:
            if entity.kind == KIND_FILE:
                self.unstage(entity.id)

    def dead_letter(self, entity: Entity, key: str, reason: str) -> DeadLetter:
        """Set ``entity`` aside for good: it leaves the queue, a dead letter records why.

        A refused file's bytes move to ``dead/`` (kept for the user, never retried).
        """
        kept_at = ""
        if entity.kind == KIND_FILE:
            source = self.upload_path(entity.payload.upload_id)
            if source.exists():
                folder = self.dead / _safe_name(entity.run_key)
                folder.mkdir(exist_ok=True)
                target = folder / f"{entity.id}-{_safe_name(entity.payload.name)}"
                os.replace(source, target)
                kept_at = str(target)
        letter = DeadLetter(entity.run_key, entity.kind, key, reason, kept_at)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM entity WHERE id = ?", (entity.id,))
                if entity.kind == KIND_FILE:
                    self._db.execute("DELETE FROM upload WHERE id = ?",
                                     (entity.payload.upload_id,))
                self._db.execute(
                    "INSERT INTO dead_letter (run_key, kind, key, reason, kept_at, at) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (letter.run_key, letter.kind, letter.key, letter.reason, kept_at,
                     time.time()))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        self.unstage(entity.id)
        return letter

    def add_dead_letters(self, letters: list[DeadLetter]) -> None:
        """Record values refused for good that were part of an entity still being written."""
        with self._lock:
            self._db.executemany(
                "INSERT INTO dead_letter (run_key, kind, key, reason, kept_at, at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                [(d.run_key, d.kind, d.key, d.reason, d.kept_at, time.time()) for d in letters])

    def dead_letters(self, run_key: str | None = None, unrecorded_only: bool = False
                     ) -> list[DeadLetter]:
        query = "SELECT run_key, kind, key, reason, kept_at FROM dead_letter"
        clauses, args = [], []
        if run_key is not None:
            clauses.append("run_key = ?")
            args.append(run_key)
        if unrecorded_only:
            clauses.append("recorded = 0")
        if clauses:
            query += " WHERE " + " AND ".join(clauses)
        with self._lock:
            rows = list(self._db.execute(query + " ORDER BY id", args))
        return [DeadLetter(*row) for row in rows]

    def dead_letter_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._db.execute(
                "SELECT run_key, COUNT(*) FROM dead_letter GROUP BY run_key"))

    def mark_recorded(self, run_key: str) -> None:
        with self._lock:
            self._db.execute("UPDATE dead_letter SET recorded = 1 WHERE run_key = ?", (run_key,))

    # --- runs -------------------------------------------------------------------------------
    def record_run(self, record: RunRecord) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO run VALUES (?, ?, ?, ?, ?, ?, ?)",
                (record.key, record.run_id, record.experiment_id, record.mode, record.name,
                 int(record.resumed), pickle.dumps(record.params)))

    def run_record(self, key: str) -> RunRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM run WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        return RunRecord(row[0], row[1], row[2], row[3], row[4], bool(row[5]),
                         pickle.loads(row[6]))

    # --- size -------------------------------------------------------------------------------
    def size_bytes(self) -> int:
        """Bytes on disk: the database, its WAL, upload bytes and files set aside."""
        total = 0
        for root, _dirs, files in os.walk(self.directory):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.path.getsize(os.path.join(root, name))
        return total

    def close(self) -> None:
        with self._lock:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._db.close()


def _safe_name(text: str) -> str:
    return re.sub(r"[^\w.\-]", "_", text)[:200] or "_"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
