"""The router's shards: one named detached actor each, created again when one is dead for good.

Owns: the router's handle to each shard and replacing a shard Ray reports dead for good (killed
with ``no_restart``, or its restarts exhausted). Ray restarts a crashed shard by itself, but a
dead one stays dead, and the router kept sending that shard's run updates, and trackers their
batches, to it: its runs' data waited for ever. Now the reaper asks each shard every round
(:meth:`ShardPool.check`, never blocking: one question in flight per shard), a send that
finds a shard dead reports it (:meth:`ShardPool.revive`), and an attach makes sure its run's
shard exists before the router answers (:meth:`ShardPool.ensure`); the shard is created again
under its name (Ray's ``get_if_exists``), on the head node, with the same spool: what the dead one
accepted and had not written is written by the new one, and trackers find it by name when they
attach again. Does not own: creating one actor (the ``create`` the router injects) or what is
sent (:mod:`raydeck.tracking.proxy.outbox`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import ray

logger = logging.getLogger(__name__)


class ShardPool:
    """Handles to shards ``0 .. count-1``; thread-safe. After :meth:`close` nothing is created
    again (the proxy is stopping and kills them)."""

    def __init__(self, count: int, create: Callable[[int], Any]) -> None:
        self._create = create
        self._lock = threading.Lock()
        self._closed = False
        self._handles = [create(index) for index in range(count)]
        # The reaper's question in flight to each shard, and the handle it was asked through.
        self._probes: dict[int, tuple[Any, Any]] = {}

    def __getitem__(self, index: int) -> Any:
        with self._lock:
            return self._handles[index]

    def all(self) -> list[Any]:
        with self._lock:
            return list(self._handles)

    def revive(self, index: int, dead: Any) -> None:
        """Create shard ``index`` again if ``dead``, a handle Ray said is dead for good, is still
        its handle (a revival already done by another thread is not done twice)."""
        with self._lock:
            if self._closed or self._handles[index] is not dead:
                return
            logger.warning("tracking shard %d is dead for good; creating it again (its spool "
                           "keeps what it had not written)", index)
            try:
                self._handles[index] = self._create(index)
            except Exception as exc:  # Ray refused now: the next check finds it dead again
                logger.warning("cannot create tracking shard %d again yet (%s)", index, exc)

    def ensure(self, index: int) -> None:
        """Shard ``index`` exists under its name when this returns (created again now if it was
        dead for good), so a tracker that the router just answered finds it by name: one that
        attached in the moment between a shard's death and the next :meth:`check` found none
        (the chaos soak's plain job, seed 5300033: its actor's ``get_tracker`` raised)."""
        with self._lock:
            if self._closed:
                return
            try:  # Ray's get_if_exists: the living shard's handle, or a new shard
                self._handles[index] = self._create(index)
            except Exception as exc:  # Ray refused now: the tracker's lookup waits for check
                logger.warning("cannot create tracking shard %d again yet (%s)", index, exc)

    def check(self) -> None:
        """Revive every shard whose last answer was that it is dead for good; ask again the
        ones that answered. Never waits (the reaper's round must stay short)."""
        for index, handle in enumerate(self.all()):
            probe = self._probes.get(index)
            if probe is not None and probe[0] is handle:
                ready, _ = ray.wait([probe[1]], timeout=0)
                if not ready:
                    continue  # restarting, busy or paused: Ray answers when it can
                try:
                    ray.get(ready[0])
                except ray.exceptions.ActorDiedError:
                    self.revive(index, handle)
                    handle = self[index]
                except ray.exceptions.RayError:
                    pass  # not dead for good: asked again below
            self._probes[index] = (handle, handle.ping.remote())

    def close(self) -> list[Any]:
        """Stop creating shards again; returns the handles, for the caller to kill."""
        with self._lock:
            self._closed = True
            return list(self._handles)
