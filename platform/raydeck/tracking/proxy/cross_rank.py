"""The cross-rank views of ``all_ranks`` mode: per step, the mean, min, max and straggler rank
of a metric that every rank logs as ``<key>/rank_<i>``; the shard derives them as batches come.

The world size is the sending process's (:class:`~raydeck.tracking.messages.ProcessInfo`), so
after an elastic job's resize (a restart of every worker at a new size) a step aggregates the
ranks of the group that trained it. A step is collected per world size: a step the old group left
incomplete never mixes with the new group's ranks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from raydeck.tracking.messages import Point

MAX_OPEN_CROSS_RANK_STEPS = 10_000


class CrossRank:
    """Per step, collects ``<key>/rank_<i>`` of every rank; emits mean/min/max/straggler_rank.

    ``straggler_rank`` is the rank whose value for that step arrived last (the latest
    timestamp): the slow rank. Steps stay open until every rank reported; at most
    :data:`MAX_OPEN_CROSS_RANK_STEPS` are kept (the oldest are dropped first).
    """

    def __init__(self) -> None:
        self._open: OrderedDict[tuple[str, str, int, int], dict[int, tuple[float, int]]] = (
            OrderedDict())
        self._lock = threading.Lock()

    def feed(self, run_key: str, points: list[Point], rank: int, world_size: int
             ) -> list[Point]:
        suffix = f"/rank_{rank}"
        done: list[Point] = []
        with self._lock:
            for key, value, timestamp, step in points:
                if not key.endswith(suffix) or key.startswith("system/"):
                    continue
                base = key[: -len(suffix)]
                slot_key = (run_key, base, step, world_size)
                slot = self._open.setdefault(slot_key, {})
                slot[rank] = (value, timestamp)
                if len(slot) < world_size:
                    continue
                del self._open[slot_key]
                values = [v for v, _ in slot.values()]
                latest = max(t for _, t in slot.values())
                slowest = max(slot, key=lambda r: (slot[r][1], r))
                done += [(f"{base}/mean", sum(values) / len(values), latest, step),
                         (f"{base}/min", min(values), latest, step),
                         (f"{base}/max", max(values), latest, step),
                         (f"{base}/straggler_rank", float(slowest), latest, step)]
            while len(self._open) > MAX_OPEN_CROSS_RANK_STEPS:
                self._open.popitem(last=False)
        return done
