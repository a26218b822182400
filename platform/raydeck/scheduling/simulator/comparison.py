"""The attained-service policies against the estimate-driven ones on one trace: the second table
of ``benchmarks/scheduling.py``, here so that a test replays the same comparison.

Owns: :func:`noisy_estimates` (a trace whose estimates are off by a seeded log-normal factor, as
a prediction from history is), :func:`compare` and :class:`Compared` (one row). Does not own the
replay (:mod:`raydeck.scheduling.simulator.replay`) or the figures (:class:`Report`).

Each policy replays the trace as is, then with noisy estimates; every preemption costs what it
costs a real job (:class:`~raydeck.scheduling.simulator.replay.PreemptionCost`). ``las`` and
``gittins`` read no estimates: they start from ``services`` (the cluster's history of ended jobs'
services; empty: none, they learn from the jobs that finish), with ``las``' levels adaptive
(:func:`~raydeck.scheduling.policies.attained_service.adaptive_thresholds`), and ``las 1h,10h``
is ``las`` with Tiresias' fixed levels for comparison.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from raydeck.errors import ConfigError
from raydeck.scheduling.policies.attained_service import (
    DEFAULT_THRESHOLDS,
    Gittins,
    LeastAttainedService,
)
from raydeck.scheduling.policies.core import Policy, Resources
from raydeck.scheduling.policies.registry import make_policy
from raydeck.scheduling.simulator.replay import PreemptionCost, simulate
from raydeck.scheduling.simulator.report import Report
from raydeck.scheduling.simulator.trace import TraceJob

COMPARED = ("fifo", "sjf", "backfill-sjf", "las", "las 1h,10h", "gittins")
# Policies that read no estimate: their rows are the same on both traces, replayed once.
ESTIMATE_FREE = ("fifo", "las", "las 1h,10h", "gittins")


@dataclass(frozen=True)
class Compared:
    """One row: ``policy`` replayed on the trace with ``estimates`` (``as is`` or
    ``x LN(<sigma>)``)."""

    estimates: str
    policy: str
    report: Report


def noisy_estimates(trace: Sequence[TraceJob], sigma: float, seed: int) -> list[TraceJob]:
    """``trace`` with each estimate its duration times e^N(0, ``sigma``), drawn with ``seed``.

    Raises:
        ConfigError: ``sigma`` is not a number >= 0.
    """
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ConfigError(f"sigma={sigma}: the estimate error must be a number >= 0")
    rng = random.Random(seed)
    return [dataclasses.replace(job, estimate_s=job.duration_s * math.exp(rng.gauss(0, sigma)))
            for job in trace]


def policy(name: str, aging_s: float, services: Sequence[float] = ()) -> Policy:
    """The policy a row of :data:`COMPARED` names; ``las`` and ``gittins`` start from
    ``services``."""
    if name == "las":
        return LeastAttainedService(aging_s, services=services)
    if name == "las 1h,10h":
        return LeastAttainedService(aging_s, thresholds=DEFAULT_THRESHOLDS, services=services)
    if name == "gittins":
        return Gittins(aging_s, services=services)
    return make_policy(name, aging_s=aging_s)


def compare(trace: Sequence[TraceJob], capacity: Resources, aging_s: float, sigma: float,
            seed: int, services: Sequence[float] = (),
            cost: PreemptionCost | None = PreemptionCost()) -> list[Compared]:
    """Each of :data:`COMPARED` on ``trace`` as is, then the estimate-driven ones on
    :func:`noisy_estimates` (``sigma``, ``seed``), each preemption charged ``cost``."""
    noisy = noisy_estimates(trace, sigma, seed)
    rows = []
    for label, jobs, names in (("as is", trace, COMPARED),
                               (f"x LN({sigma:g})", noisy,
                                [n for n in COMPARED if n not in ESTIMATE_FREE])):
        for name in names:
            schedule = simulate(jobs, policy(name, aging_s, services), capacity, cost=cost)
            rows.append(Compared(label, name, Report.of(name, schedule, capacity)))
    return rows


def ideal(trace: Sequence[TraceJob], capacity: Resources, aging_s: float,
          cost: PreemptionCost | None = PreemptionCost()) -> Report:
    """``backfill-sjf`` told every job's duration: what the others are measured against."""
    perfect = [dataclasses.replace(job, estimate_s=job.duration_s) for job in trace]
    return Report.of("backfill-sjf", simulate(perfect, make_policy("backfill-sjf",
                                                                   aging_s=aging_s),
                                              capacity, cost=cost), capacity)
