"""Elastic jobs on a shared cluster: how fast a gang runs at each size, and which elastic jobs
shrink or grow, by how many workers, when room is needed or comes back.

Owns: :class:`Elasticity` (a gang's size range and its scaling curve), :func:`shrink` and
:func:`grow` (the decisions, over the same :class:`~raydeck.scheduling.policies.core.Policy` objects
as preemption). The simulator (:mod:`raydeck.scheduling.simulator.replay`) carries them out; how a
resize happens (a restart from the latest checkpoint) is its business, not this module's.

The scaling curve: at ``w`` of its ``workers`` workers a job makes progress at
``(w / workers) ** scaling`` of its full-size speed. ``scaling`` 1.0 is linear (half the
workers, half the speed); below 1, a smaller gang is less than proportionally slower (the
communication a larger one pays shrinks with it); 0 would be a job that does not speed up at
all. Above 1 (superlinear) is refused: a data-parallel job's throughput does not grow faster than
its workers.

The rules, as in issue 29: an elastic job is admitted when its minimum fits (the policy sees it
at its minimum); when the policy's first waiting job does not fit, elastic jobs above their
minimum are shrunk, in the policy's victim order and only by the workers it needs, before any job
is preempted (:func:`shrink`); they grow back into free room only while no waiting job could use
it, that is while the first waiting job would not fit even with every elastic job at its minimum
(:func:`grow`): so a growth never takes room a shrink would at once have to give back.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from raydeck.errors import ConfigError
from raydeck.scheduling.policies.core import Policy, QueuedJob, Resources, RunningJob


@dataclass(frozen=True)
class Elasticity:
    """A gang of at most ``workers`` workers that may run with as few as ``min_workers``
    (equal: a fixed gang), at the speed of its scaling curve (module docstring)."""

    workers: int = 1
    min_workers: int = 1
    scaling: float = 1.0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"workers={self.workers}: must be >= 1 (the gang's size at its "
                              "maximum)")
        if not 1 <= self.min_workers <= self.workers:
            raise ConfigError(f"min_workers={self.min_workers}: must be between 1 and "
                              f"workers={self.workers} (equal, or left empty: a fixed gang)")
        if not (math.isfinite(self.scaling) and 0 <= self.scaling <= 1):
            raise ConfigError(f"scaling={self.scaling}: must be between 0 and 1 (1: linear; "
                              "throughput never grows faster than the workers)")

    @property
    def elastic(self) -> bool:
        return self.min_workers < self.workers

    def speed(self, workers: int) -> float:
        """Progress per second at ``workers``, as a fraction of the full gang's (exactly 1.0 at
        full size, so a fixed gang's arithmetic is untouched)."""
        return 1.0 if workers == self.workers else (workers / self.workers) ** self.scaling

    def needs_at(self, full: Resources, workers: int) -> Resources:
        """What ``workers`` workers hold, ``full`` being the whole gang's needs."""
        if workers == self.workers:
            return full
        share = workers / self.workers
        return Resources(full.cpus * share, full.gpus * share)


@dataclass(frozen=True)
class Resizable:
    """A running elastic job as :func:`shrink` and :func:`grow` see it: ``running`` (its needs at
    its current size, its last checkpoint), its size now, its range and its whole gang's
    needs."""

    running: RunningJob
    workers: int
    elasticity: Elasticity
    full: Resources

    @property
    def surplus(self) -> Resources:
        """What it holds above its minimum."""
        return self.running.job.needs - self.needs_at(self.elasticity.min_workers)

    def needs_at(self, workers: int) -> Resources:
        return self.elasticity.needs_at(self.full, workers)


def _head(policy: Policy, queue: Sequence[QueuedJob], running: Sequence[RunningJob],
         now: float) -> QueuedJob | None:
    """The policy's first waiting job within its quota: the one room is made for (as
    :meth:`Policy.preempt` picks it)."""
    return next((job for job in policy.order(queue, running, now)
                 if policy.allowed(job, running)), None)


def shrink(policy: Policy, queue: Sequence[QueuedJob], running: Sequence[RunningJob],
           elastic: Sequence[Resizable], free: Resources, now: float,
           can_resize: Callable[[Resizable], bool]
           ) -> tuple[QueuedJob | None, list[tuple[str, int]]]:
    """The elastic jobs to shrink so that the first waiting job fits: ``(head, [(id, new
    size)])``, in :meth:`Policy.victim_key` order and each only by the workers still missing;
    no resize when it already fits, or when shrinking every job ``can_resize`` allows to its
    minimum would not make it fit (then it is preemption's turn).

    ``running`` and ``free`` leave out (and count as free) what is already being given back.
    """
    first = _head(policy, queue, running, now)
    if first is None or free.fits(first.needs):
        return first, []
    candidates = sorted((r for r in elastic if r.workers > r.elasticity.min_workers
                         and can_resize(r)), key=lambda r: policy.victim_key(r.running, now))
    if not (free + Resources.total(r.surplus for r in candidates)).fits(first.needs):
        return first, []
    resizes = []
    for candidate in candidates:
        if free.fits(first.needs):
            break
        size = candidate.workers
        held = candidate.running.job.needs
        while size > candidate.elasticity.min_workers and not (
                free + held - candidate.needs_at(size)).fits(first.needs):
            size -= 1
        free = free + held - candidate.needs_at(size)
        resizes.append((candidate.running.job.id, size))
    return first, resizes


def grow(policy: Policy, queue: Sequence[QueuedJob], running: Sequence[RunningJob],
         elastic: Sequence[Resizable], free: Resources, now: float,
         can_resize: Callable[[Resizable], bool]) -> list[tuple[str, int]]:
    """The elastic jobs to grow into ``free``: ``[(id, new size)]``, the job the policy would
    shrink last first, each to the largest size that fits, within its team's quota
    (:meth:`Policy.allowed`). Nothing while the first waiting job would fit with every elastic
    job at its minimum (that room is its, through :func:`shrink`).
    """
    first = _head(policy, queue, running, now)
    surplus = Resources.total(r.surplus for r in elastic)
    if first is not None and (free + surplus).fits(first.needs):
        return []
    resizes = []
    for candidate in sorted(elastic, key=lambda r: policy.victim_key(r.running, now),
                            reverse=True):
        if candidate.workers >= candidate.elasticity.workers or not can_resize(candidate):
            continue
        held = candidate.running.job.needs
        others = [r for r in running if r.job.id != candidate.running.job.id]
        size = candidate.workers
        while size < candidate.elasticity.workers and (free + held).fits(
                candidate.needs_at(size + 1)) and policy.allowed(
                dataclasses.replace(candidate.running.job, needs=candidate.needs_at(size + 1)),
                others):
            size += 1
        if size > candidate.workers:
            free = free + held - candidate.needs_at(size)
            resizes.append((candidate.running.job.id, size))
    return resizes
