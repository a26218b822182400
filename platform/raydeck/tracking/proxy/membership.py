"""Run membership: what the router knows of each open run, kept on the head node's disk.

Owns: :class:`Run` and :class:`Participant` (a run's processes, its primary and how the primary
left) and :class:`MembershipStore`, which keeps every open run, and every run update the router
decided but no shard has taken yet, in an SQLite file beside the shards' spools, so a router
that Ray restarted (after a crash, ``ray.kill`` or SIGKILL) starts with the membership and the
undelivered updates of the one it replaces. Without it, a run whose primary had left while
other processes still took part (a driver that raised after its worker died) was forgotten by
the restarted router: its remaining processes were dead and never attached again, so nobody
ended it and it stayed RUNNING. With it, the reaper finds them gone and ends the run with the
primary's status. Living trackers attach again as before (their heartbeats are unknown to the
restarted router only if it could not read this file).

Run updates (:class:`~raydeck.tracking.proxy.outbox.Control`) are written in the same
transaction as the membership change that decided them, and removed once a shard took them
(``sent``). Without that, a run's end decided while its shard was unreachable lived only in the
router's memory, and the run's membership was already gone from the file: a router dying then
lost the end for good and the run stayed RUNNING. A restarted router sends them again, first and
in order; each is idempotent at the shard (an update sent just before the router died may be
sent twice, never lost).

Does not own: deciding anything (:mod:`raydeck.tracking.proxy.router`). Heartbeat times are not
kept (a reloaded participant counts as seen at load; Ray is asked about it after missed beats).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raydeck.tracking.messages import OpenRun, ProcessInfo
from raydeck.tracking.proxy.outbox import Control

logger = logging.getLogger(__name__)


@dataclass
class Participant:
    client_id: str
    process: ProcessInfo
    last_seen: float


@dataclass
class Run:
    key: str
    name: str
    experiment: str
    mode: str
    created_by_role: str
    job_id: str | None
    run_id: str = ""
    existed: bool = False
    params: dict[str, str] = field(default_factory=dict)
    parent_key: str | None = None
    needs_open: bool = True
    primary: str | None = None
    primary_status: str | None = None
    # The client whose attach brought the run to this router; every later attach resumes it.
    first_client: str | None = None
    participants: dict[str, Participant] = field(default_factory=dict)
    children: dict[int, bool] = field(default_factory=dict)  # rank -> open in MLflow
    samplers: dict[str, str] = field(default_factory=dict)
    terminated: bool = False
    # How a plain Tune trial ended, as Tune said (``set_trial_outcome``): the run's status when
    # it ends after that (the trial's exit says FINISHED even when its function raised).
    outcome: str | None = None


def _to_json(run: Run) -> str:
    data = dataclasses.asdict(run)
    for participant in data["participants"].values():
        participant.pop("last_seen")
    return json.dumps(data)


def _from_json(text: str, now: float) -> Run:
    data: dict[str, Any] = json.loads(text)
    data["participants"] = {
        client_id: Participant(client_id, ProcessInfo(**p["process"]), now)
        for client_id, p in data["participants"].items()}
    data["children"] = {int(rank): open_ for rank, open_ in data["children"].items()}
    return Run(**data)


def _control_to_json(control: Control) -> str:
    payload = control.payload
    if isinstance(payload, OpenRun):
        payload = dataclasses.asdict(payload)
    return json.dumps({"shard_index": control.shard_index, "run_key": control.run_key,
                       "kind": control.kind, "payload": payload})


def _control_from_json(journal_id: int, text: str) -> Control:
    data: dict[str, Any] = json.loads(text)
    if data["kind"] == "open":
        data["payload"] = OpenRun(**data["payload"])
    return Control(journal_id=journal_id, **data)


class MembershipStore:
    """Open runs and undelivered run updates in one SQLite file (WAL), written through on every
    change of membership.

    A failure to read or write is logged and never raised: the router then works from memory
    only, as before this store (trackers re-attach to a restarted router on their heartbeat).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("CREATE TABLE IF NOT EXISTS runs (key TEXT PRIMARY KEY, data TEXT)")
            db.execute("CREATE TABLE IF NOT EXISTS outbox "
                       "(id INTEGER PRIMARY KEY AUTOINCREMENT, data TEXT)")
            self._db = db
        except (OSError, sqlite3.Error) as exc:
            logger.warning("cannot keep the router's run membership in %s (%s); a restarted "
                           "router rebuilds it from trackers that attach again", path, exc)

    def _read(self, query: str, what: str) -> list[Any]:
        """The rows of ``query``; none without a database or when it cannot be read (the
        router then starts without what a predecessor kept, as a first router does)."""
        if self._db is None:
            return []
        with self._lock:
            try:
                return self._db.execute(query).fetchall()
            except sqlite3.Error as exc:
                logger.warning("cannot read the router's %s (%s)", what, exc)
                return []

    def load(self) -> list[Run]:
        """The open runs a previous router kept; their participants count as seen now."""
        now = time.monotonic()
        runs = []
        for (text,) in self._read("SELECT data FROM runs", "run membership"):
            try:
                runs.append(_from_json(text, now))
            except (ValueError, TypeError, KeyError) as exc:
                logger.warning("ignoring a run membership the router cannot read (%s)", exc)
        return runs

    def load_controls(self) -> list[Control]:
        """The run updates a previous router decided and no shard took, in decision order."""
        controls = []
        for journal_id, text in self._read("SELECT id, data FROM outbox ORDER BY id",
                                           "undelivered run updates"):
            try:
                controls.append(_control_from_json(journal_id, text))
            except (ValueError, TypeError, KeyError) as exc:
                logger.warning("ignoring a run update the router cannot read (%s)", exc)
        return controls

    def save(self, runs: list[Run], controls: list[Control]) -> list[Control]:
        """Keep ``runs`` as they are now (an ended run is removed: MLflow has it from then) and
        ``controls``, the updates that change decided, in one transaction. Returns ``controls``
        with their ``journal_id`` (unchanged if they could not be kept)."""
        if self._db is None or not (runs or controls):
            return controls
        with self._lock:
            try:
                self._db.execute("BEGIN")
                for run in runs:
                    if run.terminated:
                        self._db.execute("DELETE FROM runs WHERE key = ?", (run.key,))
                    else:
                        self._db.execute("INSERT OR REPLACE INTO runs VALUES (?, ?)",
                                         (run.key, _to_json(run)))
                kept = [dataclasses.replace(control, journal_id=self._db.execute(
                    "INSERT INTO outbox (data) VALUES (?)",
                    (_control_to_json(control),)).lastrowid) for control in controls]
                self._db.execute("COMMIT")
                return kept
            except sqlite3.Error as exc:
                logger.warning("cannot keep the router's run membership (%s)", exc)
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                return controls

    def sent(self, control: Control) -> None:
        """A shard took ``control``: the router need not send it again."""
        if self._db is None or control.journal_id is None:
            return
        with self._lock:
            try:
                self._db.execute("DELETE FROM outbox WHERE id = ?", (control.journal_id,))
            except sqlite3.Error as exc:
                logger.warning("cannot mark a run update delivered (%s)", exc)
