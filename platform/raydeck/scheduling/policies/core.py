"""Scheduling policies for a shared cluster, as small objects with one interface.

Owns: :class:`Capacity` (free resources, per node when known, and where a
:class:`~raydeck.scheduling.policies.resources.Gang` fits on them), :class:`Policy` (given the
queue, the running jobs, the free and total resources and the time, say which queued jobs start now,
and which running jobs to preempt for the first one that cannot) and the policies:
:class:`Fifo`, :class:`PriorityAging`, :class:`ShortestJobFirst`, :class:`FairShare`
(decayed usage, weights, per-team quotas), :class:`Backfill` (EASY backfill over any of
them); ``las`` and ``gittins`` are in :mod:`raydeck.scheduling.policies.attained_service`. The
same objects drive the simulator.

Every policy holds per-team quotas (``quotas``): a job that would take its team over its quota
waits without blocking other teams' jobs.

Placement-aware admission: a job with a :class:`Gang` starts only when all its workers can be
placed at once on the nodes' free resources under its preset's placement strategy
(:func:`raydeck.train.feasibility.place`), never on cluster totals alone: a strict-pack gang that
fits the free total but no single node waits, so no job is ever submitted to wait half-placed in
Ray. Fractional GPU shares count as packed onto partly used GPUs first (as Ray assigns them).

Contract: a policy never starts a job that does not fit the free resources, and it never
starts jobs past the first one it orders but cannot start, except where the policy says so
(backfill, a team over its quota, ``las`` and ``gittins`` until that job has aged): so a large
job at the head is not starved by a stream of small ones. Aging bounds every wait: a job queued
longer than ``aging_s`` goes ahead of every job that has waited less.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from raydeck.errors import ConfigError
from raydeck.scheduling.policies.resources import Gang, Resources
from raydeck.train.feasibility import place

DEFAULT_AGING_S = 3600.0


@dataclass(frozen=True)
class QueuedJob:
    """A job waiting to start; ``gang`` says how its ``needs`` must be placed (None: anywhere,
    as in the simulator's traces); ``key``: the job's digest (same job file, preset and
    arguments), under which its earlier runs' durations are known ("": none);
    ``attained_s``: the service (GPU-seconds; CPU-seconds without GPUs) its earlier attempts
    had, which the attained-service policies rank by
    (:mod:`raydeck.scheduling.policies.attained_service`)."""

    id: str
    team: str
    priority: int
    needs: Resources
    submitted_s: float
    estimate_s: float
    gang: Gang | None = None
    key: str = ""
    attained_s: float = 0.0

    def waited(self, now: float) -> float:
        return now - self.submitted_s


@dataclass(frozen=True)
class Capacity:
    """Free resources: ``pool`` in total and, when known, what each node has free (``nodes``;
    empty: one pool, placement not checked)."""

    pool: Resources
    nodes: tuple[Resources, ...] = ()

    @classmethod
    def of_nodes(cls, nodes: tuple[Resources, ...]) -> Capacity:
        """Per-node resources, pooled in total."""
        return cls(Resources.total(nodes), nodes)

    def after(self, job: QueuedJob) -> Capacity | None:
        """What is left once ``job`` starts (its gang on the nodes it is placed on), or None
        when it cannot start now: over the pool or, for a gang, not placed whole."""
        if not self.pool.fits(job.needs):
            return None
        nodes = list(self.nodes)
        if nodes and job.gang is not None:
            chosen = self._place(job.gang)
            if chosen is None:
                return None
            for index in chosen:
                nodes[index] = nodes[index] - job.gang.per_worker
        return Capacity(self.pool - job.needs, tuple(nodes))

    def fits(self, job: QueuedJob) -> bool:
        return self.after(job) is not None

    def places(self, gang: Gang) -> bool:
        """Whether every worker of ``gang`` finds a node at once
        (:func:`raydeck.train.feasibility.place`)."""
        return self._place(gang) is not None

    def describe_nodes(self) -> str:
        """``node 0: 1 GPU, 3 CPU; node 1: 0 GPU, 4 CPU``."""
        return "; ".join(f"node {i}: {node.gpus:g} GPU, {node.cpus:g} CPU"
                         for i, node in enumerate(self.nodes))

    def _place(self, gang: Gang) -> list[int] | None:
        return place(gang.bundle(), gang.workers, gang.strategy,
                     [node.as_node() for node in self.nodes])


@dataclass(frozen=True)
class RunningJob:
    """A job that holds resources until it ends (expected: start + estimate).

    ``checkpoint_s`` is when it last committed a checkpoint in this attempt the queue knows of
    (None: none yet, so it cannot be preempted: it would have nothing new to resume from);
    ``resumed``: it was preempted before (:mod:`raydeck.scheduling.policies.preemption`).
    """

    job: QueuedJob
    started_s: float
    checkpoint_s: float | None = None
    resumed: bool = False

    @property
    def expected_end_s(self) -> float:
        return self.started_s + self.job.estimate_s


def work_lost_s(victim: RunningJob, now: float) -> float:
    """The work ``victim`` loses if stopped at ``now``: the time since its last checkpoint (0
    without one: such a job is never a victim). A checkpoint at clock 0.0 is a checkpoint."""
    return 0.0 if victim.checkpoint_s is None else now - victim.checkpoint_s


def team_usage(team: str, running: Sequence[RunningJob]) -> Resources:
    """What ``team``'s running jobs hold."""
    used = Resources()
    for other in running:
        if other.job.team == team:
            used = used + other.job.needs
    return used


class Policy(abc.ABC):
    """Decides which queued jobs start now. Subclasses give the order (and may override
    :meth:`decide`)."""

    name: str = ""

    def __init__(self, aging_s: float = DEFAULT_AGING_S,
                 quotas: Mapping[str, Resources] | None = None) -> None:
        if not aging_s > 0:
            raise ConfigError(f"aging_s={aging_s}: must be > 0")
        self.aging_s = aging_s
        self.quotas = dict(quotas or {})

    @abc.abstractmethod
    def key(self, job: QueuedJob, running: Sequence[RunningJob], now: float) -> tuple[float, ...]:
        """Sort key of a queued job: lower starts first (before aging)."""

    def order(self, queue: Sequence[QueuedJob], running: Sequence[RunningJob],
              now: float) -> list[QueuedJob]:
        """The queue in start order: aged jobs first (oldest first), then by :meth:`key`."""
        aged = sorted((j for j in queue if self.waiting(j, now) >= self.aging_s),
                      key=lambda j: (j.submitted_s, j.id))
        rest = sorted((j for j in queue if self.waiting(j, now) < self.aging_s),
                      key=lambda j: (*self.key(j, running, now), j.submitted_s, j.id))
        return aged + rest

    def waiting(self, job: QueuedJob, now: float) -> float:
        """How long ``job`` has waited, as aging counts it: since its submission."""
        return job.waited(now)

    def allowed(self, job: QueuedJob, running: Sequence[RunningJob]) -> bool:
        """Whether the job's team stays within its quota (if it has one) with ``job``."""
        quota = self.quotas.get(job.team)
        return quota is None or quota.fits(team_usage(job.team, running) + job.needs)

    def ended(self, job: RunningJob, now: float) -> None:
        """A job released its resources at ``now`` (fair share charges its team)."""
        return None

    def finished(self, job: RunningJob, now: float) -> None:
        """``job`` (after :meth:`ended`) ran to its end: it will not come back."""
        return None

    def outranks(self, job: QueuedJob, victim: RunningJob, now: float) -> bool:
        """Whether ``job`` may have ``victim`` stopped for it: by default, a lower priority."""
        return victim.job.priority < job.priority

    def victim_key(self, victim: RunningJob, now: float) -> tuple[float | str, ...]:
        """Victims' order: lowest priority first, then the least work lost."""
        return (victim.job.priority, work_lost_s(victim, now), victim.job.id)

    def may_outrank(self, queue: Sequence[QueuedJob], piece: RunningJob) -> bool:
        """Whether a job in ``queue`` may come to outrank ``piece`` while it runs."""
        return piece.job.priority < max(job.priority for job in queue)

    def decide(self, queue: Sequence[QueuedJob], running: Sequence[RunningJob],
               free: Capacity, total: Resources, now: float) -> list[QueuedJob]:
        """Jobs to start now, in order: as many of the ordered queue as fit (placed whole), up
        to the first that does not and that :meth:`passable` says holds the rest back (jobs a
        quota holds back are skipped, not blocking)."""
        started: list[QueuedJob] = []
        running = list(running)
        for job in self.order(queue, running, now):
            if not self.allowed(job, running):
                continue
            left = free.after(job)
            if left is None:
                if self.passable(job, now):
                    continue
                break
            started.append(job)
            running.append(RunningJob(job, now))
            free = left
        return started

    def passable(self, job: QueuedJob, now: float) -> bool:
        """Whether jobs behind ``job``, which does not fit now, may start before it: by default
        not (strict order: its room is kept)."""
        return False

    def preempt(self, queue: Sequence[QueuedJob], running: Sequence[RunningJob],
                free: Resources, now: float,
                can_stop: Callable[[RunningJob], bool] | None = None) -> Preemption | None:
        """Running jobs to stop at their next checkpoint so that the first queued job (in this
        policy's order, within its quota) can start: jobs it :meth:`outranks` (by default, of
        lower priority) in :meth:`victim_key` order. None unless stopping them makes it fit.

        ``can_stop`` says which running jobs may be victims (default: those with a
        checkpoint); the queue and the simulator pass :func:`~raydeck.scheduling.
        preemption_rules.preemptible`, which also keeps a just restarted job from stopping.

        ``running`` and ``free`` leave out (and count as free) jobs already stopping. Counted
        in totals: which nodes a victim frees is not known, so a gang that would still not be
        placed after its victims stop waits for more to end (it never starts half-placed).
        """
        head = next((job for job in self.order(queue, running, now)
                     if self.allowed(job, running)), None)
        if head is None or free.fits(head.needs):
            return None
        candidates = sorted(
            (r for r in running if self.outranks(head, r, now)
             and (r.checkpoint_s is not None if can_stop is None else can_stop(r))),
            key=lambda r: self.victim_key(r, now))
        victims: list[RunningJob] = []
        for candidate in candidates:
            if free.fits(head.needs):
                break
            victims.append(candidate)
            free = free + candidate.job.needs
        return Preemption(head, tuple(victims)) if free.fits(head.needs) else None


@dataclass(frozen=True)
class Preemption:
    """What :meth:`Policy.preempt` decided: stop ``victims`` so that ``job`` can start."""

    job: QueuedJob
    victims: tuple[RunningJob, ...]


class Fifo(Policy):
    """First come, first served, with head-of-line blocking (what Ray's job server does)."""

    name = "fifo"

    def key(self, job: QueuedJob, running: Sequence[RunningJob], now: float) -> tuple[float, ...]:
        return (job.submitted_s,)


class PriorityAging(Policy):
    """Higher priority first; a job's priority grows by one per ``aging_s / 4`` waited, and a
    job waiting ``aging_s`` goes first, so nothing starves."""

    name = "priority"

    def key(self, job: QueuedJob, running: Sequence[RunningJob], now: float) -> tuple[float, ...]:
        return (-(job.priority + 4 * job.waited(now) / self.aging_s),)


class ShortestJobFirst(Policy):
    """Shortest predicted duration first (the PAI study's SJF on predicted durations)."""

    name = "sjf"

    def key(self, job: QueuedJob, running: Sequence[RunningJob], now: float) -> tuple[float, ...]:
        return (job.estimate_s,)


@dataclass
class _Usage:
    value: float = 0.0
    at_s: float = 0.0


def _decay(age_s: float, half_life_s: float) -> float:
    """What is left after ``age_s`` of usage with half-life ``half_life_s``: in (0, 1], and 1
    for a negative age (a clock read out of order), so ``0.5 ** x`` is never asked to grow
    (it overflows past ~1,024 half-lives; it only underflows to 0.0 the other way)."""
    return 0.5 ** (max(age_s, 0.0) / half_life_s)


class FairShare(Policy):
    """The team with the least decayed usage per weight goes first.

    Usage is resource-seconds (:meth:`Resources.weight`), decayed with ``half_life_s``, plus
    what the team's running jobs have used so far; :meth:`ended` charges a job that ends.
    """

    name = "fairshare"

    def __init__(self, weights: Mapping[str, float] | None = None,
                 quotas: Mapping[str, Resources] | None = None, half_life_s: float = 3600.0,
                 aging_s: float = DEFAULT_AGING_S) -> None:
        super().__init__(aging_s, quotas)
        for team, weight in (weights or {}).items():
            if not weight > 0:
                raise ConfigError(f"weight of team {team!r} = {weight}: must be > 0")
        if not half_life_s > 0:
            raise ConfigError(f"half_life_s={half_life_s}: must be > 0")
        self.weights = dict(weights or {})
        self.half_life_s = half_life_s
        self._usage: dict[str, _Usage] = {}

    def usage(self, team: str, now: float) -> float:
        entry = self._usage.setdefault(team, _Usage(0.0, now))
        return entry.value * _decay(now - entry.at_s, self.half_life_s)

    def ended(self, job: RunningJob, now: float) -> None:
        """Charge the job's resource-seconds to its team. A job that ended before the team's
        last charge (history replayed out of order) is decayed to that charge's time, never
        the other way: usage never grows with age, so no gap overflows it."""
        team = job.job.team
        amount = job.job.needs.weight() * (now - job.started_s)
        entry = self._usage.get(team)
        if entry is not None and now < entry.at_s:
            self._usage[team] = _Usage(entry.value + amount * _decay(entry.at_s - now,
                                                                     self.half_life_s),
                                       entry.at_s)
        else:
            self._usage[team] = _Usage(self.usage(team, now) + amount, now)

    def key(self, job: QueuedJob, running: Sequence[RunningJob], now: float) -> tuple[float, ...]:
        held = sum(r.job.needs.weight() * (now - r.started_s) for r in running
                   if r.job.team == job.team)
        return ((self.usage(job.team, now) + held) / self.weights.get(job.team, 1.0),)


class Backfill(Policy):
    """EASY backfill over ``base``: start in ``base``'s order; when the head does not fit,
    reserve the earliest time it will (from running jobs' expected ends) and start later jobs
    only if they end before that reservation or fit beside it."""

    def __init__(self, base: Policy | None = None) -> None:
        self.base = base or Fifo()
        super().__init__(self.base.aging_s)
        self.name = f"backfill-{self.base.name}"

    def key(self, job: QueuedJob, running: Sequence[RunningJob], now: float) -> tuple[float, ...]:
        return self.base.key(job, running, now)

    def allowed(self, job: QueuedJob, running: Sequence[RunningJob]) -> bool:
        return self.base.allowed(job, running)

    def ended(self, job: RunningJob, now: float) -> None:
        self.base.ended(job, now)

    def decide(self, queue: Sequence[QueuedJob], running: Sequence[RunningJob],
               free: Capacity, total: Resources, now: float) -> list[QueuedJob]:
        ordered = self.base.order(queue, running, now)
        started = self.base.decide(ordered, running, free, total, now)
        now_running = [*running, *(RunningJob(j, now) for j in started)]
        for job in started:
            left = free.after(job)
            assert left is not None, "the base policy placed it on this same capacity"
            free = left
        waiting = [j for j in ordered if j not in started and self.allowed(j, now_running)]
        if not waiting:
            return started
        head = waiting[0]
        shadow_s, spare = _reservation(head, now_running, free.pool, now)
        for job in waiting[1:]:
            left = free.after(job) if self.allowed(job, now_running) else None
            if left is None:
                continue
            ends_before = now + job.estimate_s <= shadow_s
            if ends_before or spare.fits(job.needs):
                started.append(job)
                now_running.append(RunningJob(job, now))
                free = left
                if not ends_before:
                    spare = spare - job.needs
        return started


def _reservation(head: QueuedJob, running: Sequence[RunningJob], free: Resources,
                 now: float) -> tuple[float, Resources]:
    """When ``head`` can start (running jobs ending as expected) and what is spare then."""
    available = free
    for job in sorted(running, key=lambda r: r.expected_end_s):
        if available.fits(head.needs):
            break
        available = available + job.job.needs
        now = max(now, job.expected_end_s)
    return now, available - head.needs
