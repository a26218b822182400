"""One attempt's values per step of a resumed metric: the shard's half of
``Tracker.skip_logged_steps``.

A job restarted from a checkpoint trains steps again that its run may already hold. The
restarted attempt asks its shard which steps the run holds and drops those itself, but a batch
of the attempt that died can still be on its way at that moment (sent just before the kill, not
yet ingested): the answer misses it, and both attempts' values would land. So the answer also
sets a *fence* on each key it names, and from then on the shard keeps, at each step of a fenced
key, the values of one attempt only, whichever arrives first: a point of another attempt at a
step the run already holds is dropped.

An attempt is one tracker (its client id). Within one attempt nothing is dropped: a user who
logs twice at one step keeps both values, as MLflow does. Keys no resumed attempt named are never
fenced (system metrics, a driver's own keys: several processes may log those at one step).

Per fenced key the shard keeps two numbers: the attempt whose values hold the key's highest step,
and that step. Steps count as a watermark, as the caller's skip does: another attempt's point at
or below it is a repeat. Memory: at most :data:`MAX_FENCED_RUNS` runs (the oldest forgotten),
each with the keys its resumed attempts named. Fences live in the shard's memory only: a restarted
shard has forgotten them, but then no batch of a dead process can reach it any more (Ray sends a
call again only for a living caller), and the next resumed attempt sets them again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from raydeck.tracking.messages import Point

MAX_FENCED_RUNS = 10_000
EARLIER_ATTEMPTS = ""  # the holder of a fence just set: whoever logged what the run holds


@dataclass
class _Fence:
    """A fenced key: the client whose values hold the run's steps up to ``through``."""

    holder: str
    through: int


class StepFences:
    """The fences of one shard's runs. Not thread-safe: the shard calls it under its lock."""

    def __init__(self, max_runs: int = MAX_FENCED_RUNS) -> None:
        if max_runs < 1:
            raise ValueError(f"max_runs={max_runs}: must be at least 1")
        self._max_runs = max_runs
        self._runs: OrderedDict[str, dict[str, _Fence]] = OrderedDict()
        self.dropped = 0

    def __contains__(self, run_key: str) -> bool:
        return run_key in self._runs

    def open(self, run_key: str, keys: list[str]) -> None:
        """Fence ``keys`` from now on (a resumed attempt asked which steps the run holds); a key
        fenced already keeps its fence. Until :meth:`close`, the first attempt to log a step
        above what the fence holds takes it over."""
        fences = self._runs.pop(run_key, None) or {}
        for key in keys:
            fences.setdefault(key, _Fence(EARLIER_ATTEMPTS, -1))
        self._runs[run_key] = fences
        while len(self._runs) > self._max_runs:
            self._runs.popitem(last=False)

    def close(self, run_key: str, held: dict[str, int]) -> None:
        """Raise the fences of :meth:`open` to the steps the run holds (``held``, -1: none), and
        ``held`` to what the fences took meanwhile: the resumed attempt's answer."""
        fences = self._runs.setdefault(run_key, {})
        for key, step in held.items():
            fence = fences.setdefault(key, _Fence(EARLIER_ATTEMPTS, -1))
            if fence.through < step:
                fence.holder = EARLIER_ATTEMPTS
                fence.through = step
            held[key] = fence.through

    def admit(self, run_key: str, client_id: str, points: list[Point]) -> list[Point] | None:
        """The points of ``client_id``'s batch to keep; None when all of them are kept.

        A point of a fenced key at or below the step its fence holds is dropped unless the
        same client holds it; a point above takes the fence over for its client.
        """
        fences = self._runs.get(run_key)
        if fences is None:
            return None
        kept: list[Point] = []
        dropped = 0
        for point in points:
            fence = fences.get(point[0])
            if fence is not None:
                step = point[3]
                if fence.holder != client_id:
                    if step <= fence.through:
                        dropped += 1
                        continue
                    fence.holder = client_id
                    fence.through = step
                elif step > fence.through:
                    fence.through = step
            kept.append(point)
        if not dropped:
            return None
        self.dropped += dropped
        return kept
