"""Run membership: what the router knows of each open run, kept on the head node's disk.

Owns: :class:`Run` and :class:`Participant` (a run's processes, its primary and how the primary
left) and :class:`MembershipStore`, which keeps every open run in an SQLite file beside the
shards' spools, so a router that Ray restarted (after a crash, ``ray.kill`` or SIGKILL) starts
with the membership of the one it replaces. Without it, a run whose primary had left while
other processes still took part (a driver that raised after its worker died) was forgotten by
the restarted router: its remaining processes were dead and never attached again, so nobody
ended it and it stayed RUNNING. With it, the reaper finds them gone and ends the run with the
primary's status. Living trackers attach again as before (their heartbeats are unknown to the
restarted router only if it could not read this file).

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

from raydeck.tracking.messages import ProcessInfo

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


class MembershipStore:
    """Open runs in one SQLite file (WAL), written through on every change of membership.

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
            self._db = db
        except (OSError, sqlite3.Error) as exc:
            logger.warning("cannot keep the router's run membership in %s (%s); a restarted "
                           "router rebuilds it from trackers that attach again", path, exc)

    def load(self) -> list[Run]:
        """The open runs a previous router kept; their participants count as seen now."""
        if self._db is None:
            return []
        now = time.monotonic()
        runs = []
        with self._lock:
            try:
                rows = self._db.execute("SELECT data FROM runs").fetchall()
            except sqlite3.Error as exc:
                logger.warning("cannot read the router's run membership (%s)", exc)
                return []
        for (text,) in rows:
            try:
                runs.append(_from_json(text, now))
            except (ValueError, TypeError, KeyError) as exc:
                logger.warning("ignoring a run membership the router cannot read (%s)", exc)
        return runs

    def save(self, runs: list[Run]) -> None:
        """Keep ``runs`` as they are now; an ended run is removed (MLflow has it from then)."""
        if self._db is None or not runs:
            return
        with self._lock:
            try:
                self._db.execute("BEGIN")
                for run in runs:
                    if run.terminated:
                        self._db.execute("DELETE FROM runs WHERE key = ?", (run.key,))
                    else:
                        self._db.execute("INSERT OR REPLACE INTO runs VALUES (?, ?)",
                                         (run.key, _to_json(run)))
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                logger.warning("cannot keep the router's run membership (%s)", exc)
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
