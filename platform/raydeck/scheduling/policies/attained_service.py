"""Attained-service policies (Tiresias, NSDI 2019): order jobs by the service they have had,
not by a predicted duration, so short jobs finish first without anyone estimating them.

Owns: :func:`service_rate`, :func:`attained`, :func:`gittins_index`, :func:`adaptive_thresholds`,
:class:`LeastAttainedService` (``las``: discretized 2D-LAS) and :class:`Gittins` (``gittins``:
2D-Gittins), both registered in :func:`raydeck.scheduling.policies.registry.make_policy`.

Attained service is two-dimensional, space x time: GPU-seconds (the gang's GPUs x the seconds
it held them, over all its attempts); a job without GPUs counts CPU-seconds instead (the
thresholds are then CPU-seconds: CPU-only jobs on a GPU cluster are few and small). The policy
keeps none of it: a job's earlier attempts' service is its own
(:attr:`~raydeck.scheduling.policies.core.QueuedJob.attained_s`, which the queue keeps in its
store and the simulator in its replay), plus, for a running job, its service rate times the time
since it started. So a new policy (the queue configured, or its actor restarted) ranks a
preempted job where the old one did.

Levels adapt to the cluster (:func:`adaptive_thresholds`): by default ``las``' thresholds are
quantiles of the service that ended jobs attained (the cluster's own history, then each job this
policy sees finish), as Tiresias sets its thresholds to its trace's job distribution; fixed
thresholds (``raydeck queue --thresholds``) win over them. ``gittins`` ranks over the same
history when it knows nothing closer to the job.

Why: an estimate-free SJF. Under heavy-tailed durations a job that has run long is likely to
run much longer, so a job with less service goes first; a new job preempts one that has had
more (at its checkpoint, through :mod:`raydeck.scheduling.policies.preemption`: a resumed job is
stopped again only after :data:`~raydeck.scheduling.policies.preemption.MIN_RUN_BEFORE_PREEMPTION_S`
and a new checkpoint, and a victim waits for the job it was stopped for). Priorities come first
when preempting (a job never stops one of higher priority; a higher one may stop any lower),
quotas and gang placement are the base policy's (:class:`~raydeck.scheduling.policies.core.Policy`).

Work-conserving, as Tiresias places jobs: a job that does not fit does not hold back the jobs
after it (they start in the room it cannot use; the room for it is made by preempting jobs it
outranks). Without it, a job queued behind a large one waits whatever its rank: on Tiresias'
60-job trace no thresholds brought ``las`` below 0.94 of FIFO's average completion time.

Starvation bound: a job that has waited ``aging_s`` since it last ran (or was submitted) goes
first (Tiresias promotes it to the top queue), and from then on nothing starts past it, so a
long or large job that keeps being passed still finishes. When it last ran is the policy's own
(:meth:`AttainedService.ended`): a new policy counts a victim's wait from its submission, so it
is promoted sooner, never later.

Contract: within a level (LAS) or an index (Gittins) jobs go first come, first served; a
job's rank only gets worse as it runs (LAS; adaptive levels move only as jobs finish) or follows
its duration distribution (Gittins); a job's attained service never decreases.
"""

from __future__ import annotations

import abc
import bisect
import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from raydeck.errors import ConfigError
from raydeck.scheduling.policies.core import (
    DEFAULT_AGING_S,
    Policy,
    QueuedJob,
    Resources,
    RunningJob,
    work_lost_s,
)

# Tiresias' two thresholds, in GPU-seconds: a GPU-hour, then ten (a 4-GPU job passes the first
# after 15 minutes). The levels until the cluster's history has ``MIN_HISTORY`` ended jobs.
DEFAULT_THRESHOLDS = (3600.0, 36000.0)
# The quantiles of ended jobs' services that adaptive thresholds sit at: the first lets 90 % of
# jobs finish in the top level, the second parts the longest 1 % from the rest. Lower ones
# preempted more and did worse in the benchmark's replays (docs/scheduling-measurements.md).
ADAPTIVE_QUANTILES = (0.9, 0.99)
# Ended jobs' services before the levels adapt: fewer say little about the distribution.
MIN_HISTORY = 20
# Ended jobs' services a policy keeps as the cluster's history (the newest).
CLUSTER_SAMPLES = 2000


class Durations(Protocol):
    """Where a :class:`Gittins` in the queue reads finished runs' durations (seconds,
    ascending) without waiting on anything:
    :class:`raydeck.scheduling.queue.history.CachedHistory`."""

    def runs(self, key: str) -> Sequence[float]:
        """The job ``key``'s earlier runs."""

    def cluster(self) -> Sequence[float]:
        """Any job's earlier runs."""


def service_rate(needs: Resources) -> float:
    """Service per second of holding ``needs``: its GPUs, or its CPUs when it has none."""
    return needs.gpus if needs.gpus > 0 else needs.cpus


def service_unit(needs: Resources) -> str:
    """What :func:`service_rate` counts: ``GPU`` or ``CPU``."""
    return "GPU" if needs.gpus > 0 else "CPU"


def attained(job: QueuedJob, since_s: float | None, now: float) -> float:
    """Service ``job`` had in its earlier attempts, plus since ``since_s`` (its running
    piece; None: it is not running) to ``now``."""
    running = 0.0 if since_s is None else max(now - since_s, 0.0)
    return job.attained_s + service_rate(job.needs) * running


def gittins_index(services: Sequence[float], attained: float) -> float:
    """The Gittins index of a job that has had ``attained`` service, its total service drawn
    from ``services`` (ascending): the best, over quanta D, of P(it ends within D more) /
    E[service it uses of those D]. Higher goes first; 0 when no sample exceeds ``attained``
    (it has outrun its distribution) or there are none.
    """
    left = np.asarray(services[bisect.bisect_right(services, attained):], dtype=float) - attained
    if not len(left):
        return 0.0
    # Quantum D = left[i]: jobs ending by then have used their remainder, the others D.
    used = np.cumsum(left) + left * (len(left) - 1 - np.arange(len(left)))
    return float(np.max(np.arange(1, len(left) + 1) / np.maximum(used, 1e-9)))


def adaptive_thresholds(services: Sequence[float]) -> tuple[float, ...]:
    """Levels fitted to ``services`` (ended jobs' total services, ascending): their
    ``ADAPTIVE_QUANTILES`` (a repeated or zero one dropped), or ``DEFAULT_THRESHOLDS`` while
    there are fewer than ``MIN_HISTORY`` or none of them is above zero."""
    if len(services) < MIN_HISTORY:
        return DEFAULT_THRESHOLDS
    picked = sorted({services[min(int(q * len(services)), len(services) - 1)]
                     for q in ADAPTIVE_QUANTILES} - {0.0})
    return tuple(picked) or DEFAULT_THRESHOLDS


def _checked(values: Sequence[float]) -> list[float]:
    for value in values:
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"a duration or service of {value}: must be a number >= 0")
    return list(values)


class AttainedService(Policy):
    """What both policies share: attained service (a job's own, see the module docs), the
    cluster's history of ended jobs' services (``services``, oldest first, then each job this
    policy sees finish), the starvation bound, work-conserving starts and preemption by rank
    (:meth:`rank`: lower goes first; :meth:`describe_rank`, what ``raydeck queue`` shows of it).

    Raises:
        ConfigError: a service that is not a number >= 0.
    """

    def __init__(self, aging_s: float = DEFAULT_AGING_S,
                 quotas: Mapping[str, Resources] | None = None,
                 services: Sequence[float] = ()) -> None:
        super().__init__(aging_s, quotas)
        self._cluster = _checked(services)[-CLUSTER_SAMPLES:]
        self._sorted = sorted(self._cluster)
        self._last_ran: dict[tuple[str, float], float] = {}

    @abc.abstractmethod
    def rank(self, job: QueuedJob, attained: float) -> tuple[float, ...]:
        """Where a job with ``attained`` service stands: lower goes first."""

    @abc.abstractmethod
    def describe_rank(self, job: QueuedJob, attained: float) -> str:
        """:meth:`rank` in words, for ``raydeck queue``."""

    @property
    def ended_services(self) -> list[float]:
        """The ended jobs' services this policy knows, ascending."""
        return self._sorted

    def attained(self, job: QueuedJob, since_s: float | None = None,
                 now: float = 0.0) -> float:
        """:func:`attained`."""
        return attained(job, since_s, now)

    def key(self, job: QueuedJob, running: Sequence[RunningJob], now: float) -> tuple[float, ...]:
        return self.rank(job, self.attained(job))

    def waiting(self, job: QueuedJob, now: float) -> float:
        """Since it last ran (a victim's wait starts again when it stops)."""
        return now - self._last_ran.get((job.id, job.submitted_s), job.submitted_s)

    def passable(self, job: QueuedJob, now: float) -> bool:
        """Every job that fits starts past one that does not, as Tiresias places jobs, until
        that one has waited the starvation bound (then its room is kept: nothing starts after
        it)."""
        return self.waiting(job, now) < self.aging_s

    def ended(self, job: RunningJob, now: float) -> None:
        self._last_ran[(job.job.id, job.job.submitted_s)] = now

    def finished(self, job: RunningJob, now: float) -> None:
        """``job``'s total service joins the cluster's history (the oldest dropped past
        ``CLUSTER_SAMPLES``)."""
        self._last_ran.pop((job.job.id, job.job.submitted_s), None)
        served = self.attained(job.job, job.started_s, now)
        self._cluster.append(served)
        bisect.insort(self._sorted, served)
        if len(self._cluster) > CLUSTER_SAMPLES:
            self._sorted.remove(self._cluster.pop(0))

    def outranks(self, job: QueuedJob, victim: RunningJob, now: float) -> bool:
        """A lower priority, or the same and a worse rank than ``job`` (ties never preempt)."""
        if victim.job.priority != job.priority:
            return victim.job.priority < job.priority
        return self._running_rank(victim, now) > self.key(job, (), now)

    def victim_key(self, victim: RunningJob, now: float) -> tuple[float | str, ...]:
        """Lowest priority first, then the worst rank, then the least work lost."""
        worst = tuple(-part for part in self._running_rank(victim, now))
        return (victim.job.priority, *worst, work_lost_s(victim, now), victim.job.id)

    def may_outrank(self, queue: Sequence[QueuedJob], piece: RunningJob) -> bool:
        """A running job's rank worsens as it runs: any job of its priority or above may."""
        return piece.job.priority <= max(job.priority for job in queue)

    def _running_rank(self, piece: RunningJob, now: float) -> tuple[float, ...]:
        return self.rank(piece.job, self.attained(piece.job, piece.started_s, now))


class LeastAttainedService(AttainedService):
    """Discretized 2D-LAS: queue ``i`` holds jobs whose service passed ``thresholds[:i]``;
    lower queues go first, first come, first served within one. ``thresholds``: fixed levels
    (None: :func:`adaptive_thresholds` of the cluster's history, refitted as jobs finish).

    Raises:
        ConfigError: thresholds that are not increasing numbers > 0.
    """

    name = "las"

    def __init__(self, aging_s: float = DEFAULT_AGING_S,
                 quotas: Mapping[str, Resources] | None = None,
                 thresholds: Sequence[float] | None = None,
                 services: Sequence[float] = ()) -> None:
        super().__init__(aging_s, quotas, services)
        if thresholds is not None:
            thresholds = tuple(thresholds)
            if not thresholds or not all(0 < t < math.inf for t in thresholds) \
                    or list(thresholds) != sorted(set(thresholds)):
                raise ConfigError(f"thresholds={thresholds}: must be increasing numbers > 0")
        self.pinned = thresholds
        self._fitted = adaptive_thresholds(self.ended_services)

    @property
    def thresholds(self) -> tuple[float, ...]:
        """The levels in force: the fixed ones, else those fitted to the history."""
        return self.pinned if self.pinned is not None else self._fitted

    def level(self, attained: float) -> int:
        """The queue of a job with ``attained`` service (0: below the first threshold)."""
        return bisect.bisect_right(self.thresholds, attained)

    def rank(self, job: QueuedJob, attained: float) -> tuple[float, ...]:
        return (float(self.level(attained)),)

    def describe_rank(self, job: QueuedJob, attained: float) -> str:
        """``Q<queue> of <queues>`` (Q0 goes first)."""
        return f"Q{self.level(attained)} of {len(self.thresholds) + 1}"

    def finished(self, job: RunningJob, now: float) -> None:
        super().finished(job, now)
        self._fitted = adaptive_thresholds(self.ended_services)


class Gittins(AttainedService):
    """2D-Gittins: the highest Gittins index (:func:`gittins_index`) first, over the
    distribution of the job's own earlier runs when ``history`` has its key (durations in
    seconds, times its service rate), else the cluster's: ``services`` (GPU-seconds of
    ended jobs) and every job this policy saw finish. Ties go to the least served.

    In the queue, ``durations`` (MLflow's, read by the queue outside its lock) stand behind
    ``history``: the job key's runs, else the cluster's runs (seconds, times the job's own
    service rate: a run's GPUs are not in MLflow), else ``services`` as above.

    Raises:
        ConfigError: a duration or service that is not a number >= 0.
    """

    name = "gittins"

    def __init__(self, aging_s: float = DEFAULT_AGING_S,
                 quotas: Mapping[str, Resources] | None = None,
                 history: Mapping[str, Sequence[float]] | None = None,
                 services: Sequence[float] = (), durations: Durations | None = None) -> None:
        super().__init__(aging_s, quotas, services)
        self.durations = durations
        self.history = {key: sorted(_checked(runs)) for key, runs in (history or {}).items()
                        if runs}

    def distribution(self, job: QueuedJob) -> list[float]:
        """Total services (ascending) ``job``'s is drawn from."""
        runs: Sequence[float] | None = self.history.get(job.key) if job.key else None
        if not runs and self.durations is not None:
            runs = (self.durations.runs(job.key) if job.key else None) or self.durations.cluster()
        if runs:
            rate = service_rate(job.needs)
            return [rate * duration for duration in runs]
        return self.ended_services

    def rank(self, job: QueuedJob, attained: float) -> tuple[float, ...]:
        return (-gittins_index(self.distribution(job), attained), attained)

    def describe_rank(self, job: QueuedJob, attained: float) -> str:
        """``index <Gittins index> per <GPU or CPU>-h`` (higher goes first)."""
        index = gittins_index(self.distribution(job), attained) * 3600
        return f"index {index:.3g} per {service_unit(job.needs)}-h"
