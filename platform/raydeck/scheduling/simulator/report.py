"""What a trace replay returns, and the figures that compare policies on it.

Owns: :class:`Scheduled` (when one job ran in a replay: its pieces, the work lost, an elastic
job's sizes) and :class:`Report` (per policy: average and p95 job completion time, average
queueing delay, utilization, the longest wait, the top priority's average wait, preemptions,
resizes, and Jain's fairness index across teams). Does not own: the replay itself
(:func:`raydeck.scheduling.simulator.replay.simulate`, which returns the :class:`Scheduled` list) or
the trace (:mod:`raydeck.scheduling.simulator.trace`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from raydeck.scheduling.policies.core import Resources
from raydeck.scheduling.simulator.trace import TraceJob


@dataclass(frozen=True)
class Scheduled:
    """When one job ran in a replay: ``pieces`` of (start, end), more than one when it was
    preempted or resized; ``lost_s``: seconds of them that bought no progress (work redone after
    a preemption or a resize, restarts), 0 unless the replay charged a
    :class:`~raydeck.scheduling.simulator.replay.PreemptionCost`; for an elastic job, seconds of its
    whole gang (each weighted by the share of the gang held then). ``sizes``: an elastic job's
    workers in each piece (empty for a fixed gang: all of them); ``resizes``: how many of its
    piece boundaries were resizes, not preemptions."""

    job: TraceJob
    pieces: tuple[tuple[float, float], ...]
    lost_s: float = 0.0
    sizes: tuple[int, ...] = ()
    resizes: int = 0

    @property
    def start_s(self) -> float:
        return self.pieces[0][0]

    @property
    def end_s(self) -> float:
        return self.pieces[-1][1]

    @property
    def preemptions(self) -> int:
        return len(self.pieces) - 1 - self.resizes

    @property
    def gang_s(self) -> float:
        """Seconds of the whole gang its pieces held (an elastic job's at their sizes)."""
        if not self.sizes:
            return sum(end - start for start, end in self.pieces)
        return sum((end - start) * size / self.job.workers
                   for (start, end), size in zip(self.pieces, self.sizes, strict=True))

    @property
    def useful_s(self) -> float:
        """Seconds of the whole gang that bought progress: its duration for a fixed gang;
        less for an elastic job whose scaling curve is sublinear (it did the work on fewer
        workers)."""
        return self.job.duration_s if not self.sizes else self.gang_s - self.lost_s

    @property
    def completion_s(self) -> float:
        return self.end_s - self.job.submit_s

    @property
    def wait_s(self) -> float:
        """Time queued in all: before it started and after each preemption."""
        if self.sizes:
            return self.completion_s - sum(end - start for start, end in self.pieces)
        return self.completion_s - self.job.duration_s - self.lost_s


@dataclass(frozen=True)
class Report:
    """A replay's figures (all times in seconds)."""

    policy: str
    jobs: int
    avg_completion_s: float
    p95_completion_s: float
    avg_wait_s: float
    longest_wait_s: float
    utilization: float
    fairness: float
    top_priority_wait_s: float
    preemptions: int
    lost_gpu_hours: float = 0.0
    resizes: int = 0

    @classmethod
    def of(cls, policy: str, schedule: Sequence[Scheduled], capacity: Resources) -> Report:
        completions = np.asarray([s.completion_s for s in schedule])
        waits = np.asarray([s.wait_s for s in schedule])
        span = max(s.end_s for s in schedule) - min(s.job.submit_s for s in schedule)
        use_gpus = capacity.gpus > 0
        busy = sum((s.job.needs.gpus if use_gpus else s.job.needs.cpus) * s.useful_s
                   for s in schedule)
        size = capacity.gpus if use_gpus else capacity.cpus
        slowdowns: dict[str, list[float]] = {}
        for s in schedule:
            slowdowns.setdefault(s.job.team, []).append(
                s.completion_s / max(s.job.duration_s, 1.0))
        per_team = np.asarray([float(np.mean(v)) for v in slowdowns.values()])
        top = max(s.job.priority for s in schedule)
        return cls(policy, len(schedule), float(completions.mean()),
                   float(np.percentile(completions, 95)), float(waits.mean()),
                   float(waits.max()), busy / (size * span) if span > 0 else 0.0,
                   float(per_team.sum() ** 2 / (len(per_team) * (per_team ** 2).sum())),
                   float(np.mean([s.wait_s for s in schedule if s.job.priority == top])),
                   sum(s.preemptions for s in schedule),
                   sum(s.lost_s * s.job.needs.gpus for s in schedule) / 3600,
                   sum(s.resizes for s in schedule))
