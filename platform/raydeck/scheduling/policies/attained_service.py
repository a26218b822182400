"""Attained-service policies (Tiresias, NSDI 2019): order jobs by the service they have had,
not by a predicted duration, so short jobs finish first without anyone estimating them.

Owns: :func:`service_rate`, :func:`gittins_index`, :class:`LeastAttainedService` (``las``:
discretized 2D-LAS) and :class:`Gittins` (``gittins``: 2D-Gittins), both registered in
:func:`raydeck.scheduling.policies.registry.make_policy`.

Attained service is two-dimensional, space x time: GPU-seconds (the gang's GPUs x the seconds
it held them, over all its attempts); a job without GPUs counts CPU-seconds instead (the
thresholds are then CPU-seconds: CPU-only jobs on a GPU cluster are few and small). A policy
learns it from :meth:`~raydeck.scheduling.policies.core.Policy.ended` (each piece a job ran) plus,
for a running job, the time since it started; a job is known by its id and submission time (a
victim keeps both, a resubmission is a new job).

Why: an estimate-free SJF. Under heavy-tailed durations a job that has run long is likely to
run much longer, so a job with less service goes first; a new job preempts one that has had
more (at its checkpoint, through :mod:`raydeck.scheduling.policies.preemption`: a resumed job is
stopped again only after :data:`~raydeck.scheduling.policies.preemption.MIN_RUN_BEFORE_PREEMPTION_S`
and a new checkpoint, and a victim waits for the job it was stopped for). Priorities come first
when preempting (a job never stops one of higher priority; a higher one may stop any lower),
quotas and gang placement are the base policy's (:class:`~raydeck.scheduling.policies.core.Policy`).

Starvation bound: a job that has waited ``aging_s`` since it last ran (or was submitted) goes
first (Tiresias promotes it to the top queue), so a long job that keeps being passed still
finishes.

Contract: within a level (LAS) or an index (Gittins) jobs go first come, first served; a
job's rank only gets worse as it runs (LAS) or follows its duration distribution (Gittins).
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
)

# Tiresias' two thresholds, in GPU-seconds: a GPU-hour, then ten (a 4-GPU job passes the first
# after 15 minutes). Jobs below the first are those a short-job-first policy would favour.
DEFAULT_THRESHOLDS = (3600.0, 36000.0)
# Finished jobs' services a Gittins policy keeps as the cluster's distribution (the newest).
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


class AttainedService(Policy):
    """What both policies share: attained service per job, the starvation bound, and
    preemption by rank (:meth:`rank`: lower goes first; :meth:`describe_rank`, what
    ``raydeck queue`` shows of it)."""

    def __init__(self, aging_s: float = DEFAULT_AGING_S,
                 quotas: Mapping[str, Resources] | None = None) -> None:
        super().__init__(aging_s, quotas)
        self._served: dict[tuple[str, float], float] = {}
        self._last_ran: dict[tuple[str, float], float] = {}

    @abc.abstractmethod
    def rank(self, job: QueuedJob, attained: float) -> tuple[float, ...]:
        """Where a job with ``attained`` service stands: lower goes first."""

    @abc.abstractmethod
    def describe_rank(self, job: QueuedJob, attained: float) -> str:
        """:meth:`rank` in words, for ``raydeck queue``."""

    def attained(self, job: QueuedJob, since_s: float | None = None,
                 now: float = 0.0) -> float:
        """Service ``job`` had before, plus since ``since_s`` (its running piece) to ``now``."""
        running = 0.0 if since_s is None else max(now - since_s, 0.0)
        return (self._served.get((job.id, job.submitted_s), 0.0)
                + service_rate(job.needs) * running)

    def key(self, job: QueuedJob, running: Sequence[RunningJob], now: float) -> tuple[float, ...]:
        return self.rank(job, self.attained(job))

    def waiting(self, job: QueuedJob, now: float) -> float:
        """Since it last ran (a victim's wait starts again when it stops)."""
        return now - self._last_ran.get((job.id, job.submitted_s), job.submitted_s)

    def ended(self, job: RunningJob, now: float) -> None:
        ident = (job.job.id, job.job.submitted_s)
        self._served[ident] = self.attained(job.job, job.started_s, now)
        self._last_ran[ident] = now

    def finished(self, job: RunningJob, now: float) -> None:
        ident = (job.job.id, job.job.submitted_s)
        self._last_ran.pop(ident, None)
        self._served.pop(ident, None)

    def outranks(self, job: QueuedJob, victim: RunningJob, now: float) -> bool:
        """A lower priority, or the same and a worse rank than ``job`` (ties never preempt)."""
        if victim.job.priority != job.priority:
            return victim.job.priority < job.priority
        return self._running_rank(victim, now) > self.key(job, (), now)

    def victim_key(self, victim: RunningJob, now: float) -> tuple[float | str, ...]:
        """Lowest priority first, then the worst rank, then the least work lost."""
        worst = tuple(-part for part in self._running_rank(victim, now))
        return (victim.job.priority, *worst, now - (victim.checkpoint_s or now), victim.job.id)

    def may_outrank(self, queue: Sequence[QueuedJob], piece: RunningJob) -> bool:
        """A running job's rank worsens as it runs: any job of its priority or above may."""
        return piece.job.priority <= max(job.priority for job in queue)

    def _running_rank(self, piece: RunningJob, now: float) -> tuple[float, ...]:
        return self.rank(piece.job, self.attained(piece.job, piece.started_s, now))


class LeastAttainedService(AttainedService):
    """Discretized 2D-LAS: queue ``i`` holds jobs whose service passed ``thresholds[:i]``;
    lower queues go first, first come, first served within one."""

    name = "las"

    def __init__(self, aging_s: float = DEFAULT_AGING_S,
                 quotas: Mapping[str, Resources] | None = None,
                 thresholds: Sequence[float] = DEFAULT_THRESHOLDS) -> None:
        super().__init__(aging_s, quotas)
        thresholds = tuple(thresholds)
        if not all(0 < t < math.inf for t in thresholds) or list(thresholds) != sorted(
                set(thresholds)):
            raise ConfigError(f"thresholds={thresholds}: must be increasing numbers > 0")
        self.thresholds = thresholds

    def level(self, attained: float) -> int:
        """The queue of a job with ``attained`` service (0: below the first threshold)."""
        return bisect.bisect_right(self.thresholds, attained)

    def rank(self, job: QueuedJob, attained: float) -> tuple[float, ...]:
        return (float(self.level(attained)),)

    def describe_rank(self, job: QueuedJob, attained: float) -> str:
        """``Q<queue> of <queues>`` (Q0 goes first)."""
        return f"Q{self.level(attained)} of {len(self.thresholds) + 1}"


class Gittins(AttainedService):
    """2D-Gittins: the highest Gittins index (:func:`gittins_index`) first, over the
    distribution of the job's own earlier runs when ``history`` has its key (durations in
    seconds, times its service rate), else the cluster's: ``services`` (GPU-seconds of
    finished jobs) and every job this policy saw finish. Ties go to the least served.

    In the queue, ``durations`` (MLflow's, read by the queue outside its lock) stand behind
    ``history``: the job key's runs, else the cluster's runs (seconds, times the job's own
    service rate: a run's GPUs are not in MLflow), else ``services`` as above."""

    name = "gittins"

    def __init__(self, aging_s: float = DEFAULT_AGING_S,
                 quotas: Mapping[str, Resources] | None = None,
                 history: Mapping[str, Sequence[float]] | None = None,
                 services: Sequence[float] = (), durations: Durations | None = None) -> None:
        super().__init__(aging_s, quotas)
        self.durations = durations
        for value in (*services, *(d for runs in (history or {}).values() for d in runs)):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"a duration or service of {value}: must be a number >= 0")
        self.history = {key: sorted(runs) for key, runs in (history or {}).items() if runs}
        self._cluster = list(services)[-CLUSTER_SAMPLES:]
        self._sorted = sorted(self._cluster)

    def distribution(self, job: QueuedJob) -> list[float]:
        """Total services (ascending) ``job``'s is drawn from."""
        runs: Sequence[float] | None = self.history.get(job.key) if job.key else None
        if not runs and self.durations is not None:
            runs = (self.durations.runs(job.key) if job.key else None) or self.durations.cluster()
        if runs:
            rate = service_rate(job.needs)
            return [rate * duration for duration in runs]
        return self._sorted

    def rank(self, job: QueuedJob, attained: float) -> tuple[float, ...]:
        return (-gittins_index(self.distribution(job), attained), attained)

    def describe_rank(self, job: QueuedJob, attained: float) -> str:
        """``index <Gittins index> per <GPU or CPU>-h`` (higher goes first)."""
        index = gittins_index(self.distribution(job), attained) * 3600
        return f"index {index:.3g} per {service_unit(job.needs)}-h"

    def finished(self, job: RunningJob, now: float) -> None:
        served = self._served.get((job.job.id, job.job.submitted_s))
        if served is not None:
            self._cluster.append(served)
            bisect.insort(self._sorted, served)
            if len(self._cluster) > CLUSTER_SAMPLES:
                self._sorted.remove(self._cluster.pop(0))
        super().finished(job, now)
