"""The router's way to its shards: run updates sent in order, kept while a shard is away.

Owns: :class:`Control` (one run update for one shard: ``open``, ``tags`` or ``end``) and
:class:`Outbox`, which sends updates as the router decides them and keeps those a shard could
not take, in order per run, until a retry gets them through. Does not own: deciding the updates
(:mod:`raydeck.tracking.proxy.router`), the call itself (the ``send`` the proxy injects) or
keeping them on disk across a router's restart (:mod:`raydeck.tracking.proxy.membership`; this
reports each one a shard took, ``on_sent``, and takes back a predecessor's, ``resume``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Control:
    """A run update for a shard: ``open`` (an :class:`OpenRun`), ``tags`` or ``end``;
    ``journal_id``: its row in the router's store, once kept there."""

    shard_index: int
    run_key: str
    kind: str
    payload: Any
    journal_id: int | None = None


Sender = Callable[[Control], None]


class Outbox:
    """Sends run updates; what cannot be sent now waits here. Thread-safe.

    Updates of one run keep their order: while any wait, later ones queue behind them. Never
    called under the router's lock (a slow shard must not stall attaches or heartbeats).
    """

    def __init__(self, send: Sender, on_sent: Callable[[Control], None]) -> None:
        self._send = send
        self._on_sent = on_sent
        self._lock = threading.Lock()
        self._waiting: list[Control] = []

    def resume(self, controls: list[Control]) -> None:
        """Take the updates a previous router left unsent: they wait, first, for ``retry``."""
        with self._lock:
            self._waiting = list(controls) + self._waiting

    def deliver(self, controls: list[Control]) -> None:
        with self._lock:
            self._send_in_order(controls, {c.run_key for c in self._waiting}, warn=True)

    def retry(self) -> None:
        """Send what waits, in order; a run whose update fails again keeps the rest waiting."""
        with self._lock:
            pending, self._waiting = self._waiting, []
            self._send_in_order(pending, set(), warn=False)

    def _send_in_order(self, controls: list[Control], blocked: set[str], warn: bool) -> None:
        """Send each control unless its run is ``blocked`` (an earlier update of it waits); one
        that fails waits, and blocks its run's later ones. Called under the lock."""
        for control in controls:
            if control.run_key in blocked:
                self._waiting.append(control)
                continue
            try:
                self._send(control)
            except Exception as exc:
                if warn:
                    logger.warning("shard %d unreachable (%s); run %s's %s waits in the outbox",
                                   control.shard_index, type(exc).__name__, control.run_key,
                                   control.kind)
                self._waiting.append(control)
                blocked.add(control.run_key)
                continue
            self._on_sent(control)

    def size(self) -> int:
        with self._lock:
            return len(self._waiting)
