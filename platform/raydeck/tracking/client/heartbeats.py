"""One heartbeat thread per process: the router hears "this process lives" for all of its
trackers in one call per router and interval.

Why per process: a heartbeat says a process lives, and the router keeps every participant of a
process alive on that. One thread and one call per tracker cost the router a Ray call per
tracker every ``RAYDECK_TRACKING_HEARTBEAT_INTERVAL_S`` (about 1 ms of its CPU each on a loaded
head), and the process a thread per tracker; a Tune trial, a notebook or a process that logs
for several runs has several trackers. ``RouterCore.heartbeat`` takes a list of client ids.

Contract: a member (a tracker's delivery) is heard while it is bound to a run and has not
begun to leave it (:meth:`HeartbeatMember.heartbeat_router`). A call is not sent to a router
whose last call has not been answered, so calls never pile up behind a busy router. An answer
naming a member as unknown (a restarted router that lost its membership), or a failed call,
makes that member :meth:`~HeartbeatMember.reconnect`, which does nothing once it left its run.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

import ray

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 5.0


class HeartbeatMember(Protocol):
    """What the heartbeat thread needs of a tracker's delivery."""

    @property
    def client_id(self) -> str: ...

    @property
    def heartbeat_interval_s(self) -> float: ...

    def heartbeat_router(self) -> Any | None:
        """The router to tell, or None while unbound or leaving (nothing to keep alive)."""

    def reconnect(self) -> None:
        """The router did not know it, or could not be reached: attach again."""


def answered(reply: Any, members: list[HeartbeatMember]) -> None:
    """Read a router's answer to a heartbeat of ``members`` (a ready ``ObjectRef``)."""
    try:
        unknown = set(ray.get(reply))
    except ray.exceptions.RayError:
        unknown = {member.client_id for member in members}
    for member in members:
        if member.client_id in unknown:
            logger.info("router did not know tracker %s (restarted?); re-attaching",
                        member.client_id[:8])
            member.reconnect()


class ProcessHeartbeat:
    """The process's heartbeat thread and its members (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._members: dict[str, HeartbeatMember] = {}
        # router actor id -> (the unanswered call, the members it named); the thread's own
        self._pending: dict[str, tuple[Any, list[HeartbeatMember]]] = {}
        self._thread: threading.Thread | None = None
        self._joined = threading.Event()

    def join(self, member: HeartbeatMember) -> None:
        with self._lock:
            self._members[member.client_id] = member
            if self._thread is None:
                self._thread = threading.Thread(target=self._forever, daemon=True,
                                                name="raydeck-heartbeat")
                self._thread.start()
        self._joined.set()  # a new member may want a shorter interval than the thread sleeps

    def leave(self, member: HeartbeatMember) -> None:
        with self._lock:
            self._members.pop(member.client_id, None)

    def _forever(self) -> None:
        """Lives as long as the process (a daemon); idle while no tracker is a member. Beats
        every member's shortest interval, counted from the last beat; a member joining wakes it
        to count again (one that wants 1 s must not wait out another's 3,600)."""
        last = time.monotonic()
        while True:
            with self._lock:
                interval = min((m.heartbeat_interval_s for m in self._members.values()),
                               default=DEFAULT_INTERVAL_S)
            if self._joined.wait(max(0.0, last + interval - time.monotonic())):
                self._joined.clear()
                continue
            last = time.monotonic()
            try:
                self.beat()
            except Exception as exc:
                logger.debug("heartbeat failed: %s", exc)

    def beat(self) -> None:
        """One round: read the answers that came, send one call per router that has none
        outstanding. Nothing while Ray is shut down in this process (a call would start a
        new one)."""
        if not ray.is_initialized():
            return
        with self._lock:
            members = list(self._members.values())
        groups: dict[str, tuple[Any, list[HeartbeatMember]]] = {}
        for member in members:
            router = member.heartbeat_router()
            if router is not None:
                groups.setdefault(router._actor_id.hex(), (router, []))[1].append(member)
        for gone in set(self._pending) - set(groups):  # nobody there to tell any more
            del self._pending[gone]
        for key, (router, group) in groups.items():
            previous = self._pending.pop(key, None)
            if previous is not None:
                ready, _ = ray.wait([previous[0]], timeout=0)
                if not ready:
                    self._pending[key] = previous  # not answered yet: no second call
                    continue
                answered(previous[0], previous[1])
            self._pending[key] = (router.heartbeat.remote([m.client_id for m in group]), group)


PROCESS_HEARTBEAT = ProcessHeartbeat()
