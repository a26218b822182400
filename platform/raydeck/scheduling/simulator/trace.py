"""The trace format of the scheduling simulator (:mod:`raydeck.scheduling.simulator.replay`): one
job per row of a CSV, and seeded synthetic traces.

Owns: :class:`TraceJob`, :func:`read_trace` / :func:`write_trace` and :func:`generate_trace`
(heavy-tailed durations, as in production clusters: a few long jobs hold most of the time).

Format: one row per job, a header with at least ``submit_s,duration_s,team`` and any of
``id,cpus,gpus,priority,estimate_s,checkpoint_s,workers,min_workers,scaling``. ``submit_s``
counts from the trace's start; ``duration_s`` is how long the job really ran (an elastic job: at
its maximum size); ``estimate_s`` is what the scheduler is told (default: the duration, a
perfect prediction); ``cpus``/``gpus`` are the whole gang's resources at its maximum (default 1
CPU, 0 GPUs); ``priority`` is an integer >= 0 (default 0); ``checkpoint_s`` is the work between
two of the job's checkpoints (empty: it never checkpoints, so it is never preempted). Export
your cluster's history in this form to replay it (``raydeck jobs`` or Ray's job API give
submit, start and end times).

Elastic jobs (issue 29): ``workers`` is the gang's worker count at its maximum (default 1),
``min_workers`` the fewest it runs with (default: ``workers``, a fixed gang; fewer needs
``checkpoint_s``, as a resize restarts the job from its latest checkpoint) and ``scaling`` its
scaling curve: at ``w`` workers it runs at ``(w / workers) ** scaling`` of its full speed
(default 1.0, linear; between 0 and 1; :mod:`raydeck.scheduling.policies.elastic`). Its ``w``
workers hold ``w / workers`` of ``cpus`` and ``gpus``.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from raydeck.errors import ConfigError
from raydeck.scheduling.policies import elastic as resizing
from raydeck.scheduling.policies.core import QueuedJob, Resources

COLUMNS = ("id", "submit_s", "duration_s", "cpus", "gpus", "team", "priority", "estimate_s",
           "checkpoint_s")
ELASTIC_COLUMNS = ("workers", "min_workers", "scaling")  # written when a job is elastic


@dataclass(frozen=True)
class TraceJob:
    """One job of a trace: when it came, how long it really ran, and what it asked for."""

    id: str
    submit_s: float
    duration_s: float
    needs: Resources
    team: str
    priority: int = 0
    estimate_s: float | None = None
    checkpoint_s: float | None = None
    workers: int = 1
    min_workers: int | None = None  # None: ``workers``, a fixed gang
    scaling: float = 1.0
    # Service it had before the replay (not a trace column): a job the queue preempted, whose
    # start the queue predicts by a replay (raydeck.scheduling.queue.listing.predicted_starts).
    attained_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("submit_s", "duration_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"job {self.id}: {name}={value} must be a number >= 0")
        if self.priority < 0:
            raise ConfigError(f"job {self.id}: priority={self.priority} must be >= 0")
        if not (math.isfinite(self.attained_s) and self.attained_s >= 0):
            raise ConfigError(f"job {self.id}: attained_s={self.attained_s} must be a number "
                              ">= 0")
        for name in ("estimate_s", "checkpoint_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"job {self.id}: {name}={value} must be > 0")
        try:
            elastic = self.elasticity.elastic
        except ConfigError as exc:
            raise ConfigError(f"job {self.id}: {exc}") from None
        if elastic and self.checkpoint_s is None:
            raise ConfigError(f"job {self.id}: min_workers={self.min_workers} < workers="
                              f"{self.workers} needs checkpoint_s (a resize restarts the job "
                              "from its latest checkpoint); or leave min_workers empty")

    @cached_property
    def elasticity(self) -> resizing.Elasticity:
        """Its size range and scaling curve (a fixed gang's when ``min_workers`` is None)."""
        return resizing.Elasticity(self.workers, self.workers if self.min_workers is None
                                   else self.min_workers, self.scaling)

    def queued(self, done_s: float = 0.0, workers: int | None = None,
               served_s: float = 0.0) -> QueuedJob:
        """As the queue sees it, ``done_s`` of its work already done (before a preemption), at
        ``workers`` (default: its minimum, as an elastic job is admitted): the needs and the
        time left at that size; ``served_s``: the service its pieces in the replay had."""
        size = self.elasticity.min_workers if workers is None else workers
        estimate = self.estimate_s if self.estimate_s is not None else self.duration_s
        return QueuedJob(self.id, self.team, self.priority,
                         self.elasticity.needs_at(self.needs, size), self.submit_s,
                         max(estimate - done_s, 1e-9) / self.elasticity.speed(size),
                         attained_s=self.attained_s + served_s)


def read_trace(path: Path) -> list[TraceJob]:
    """A trace CSV (format in the module docstring).

    Raises:
        ConfigError: a missing column or a bad value, naming the row and the field.
    """
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"submit_s", "duration_s", "team"} - set(reader.fieldnames or ())
        if missing:
            raise ConfigError(f"{path}: missing column(s) {', '.join(sorted(missing))}; a "
                              f"trace has {', '.join(COLUMNS)}")
        jobs = []
        for line, row in enumerate(reader, start=2):
            try:
                jobs.append(TraceJob(
                    id=row.get("id") or f"job-{line - 1}",
                    submit_s=float(row["submit_s"]), duration_s=float(row["duration_s"]),
                    needs=Resources(float(row.get("cpus") or 1), float(row.get("gpus") or 0)),
                    team=row["team"], priority=int(row.get("priority") or 0),
                    estimate_s=float(row["estimate_s"]) if row.get("estimate_s") else None,
                    checkpoint_s=(float(row["checkpoint_s"]) if row.get("checkpoint_s")
                                  else None),
                    workers=int(row.get("workers") or 1),
                    min_workers=int(row["min_workers"]) if row.get("min_workers") else None,
                    scaling=float(row.get("scaling") or 1.0),
                ))
            except (ValueError, ConfigError) as exc:
                raise ConfigError(f"{path}, line {line}: {exc}") from None
    return jobs


def write_trace(jobs: Iterable[TraceJob], path: Path) -> None:
    """``jobs`` as a trace CSV; the elastic columns only when a job has a size range or more
    than one worker (so a trace of fixed gangs keeps the older, shorter form)."""
    jobs = list(jobs)
    sized = any(job.workers != 1 or job.min_workers is not None or job.scaling != 1.0
                for job in jobs)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS + ELASTIC_COLUMNS if sized else COLUMNS)
        for job in jobs:
            row = [job.id, f"{job.submit_s:.3f}", f"{job.duration_s:.3f}", job.needs.cpus,
                   job.needs.gpus, job.team, job.priority,
                   "" if job.estimate_s is None else f"{job.estimate_s:.3f}",
                   "" if job.checkpoint_s is None else f"{job.checkpoint_s:.3f}"]
            if sized:
                row += [job.workers, "" if job.min_workers is None else job.min_workers,
                        job.scaling]
            writer.writerow(row)


def generate_trace(jobs: int = 400, *, seed: int = 0, gpus: float = 16, load: float = 0.9,
                   teams: Sequence[str] = ("vision", "nlp", "speech"),
                   estimate_error: float = 0.3,
                   checkpoint_s: float | None = None) -> list[TraceJob]:
    """A seeded heavy-tailed trace for a ``gpus``-GPU cluster at ``load`` offered load.

    Durations are log-normal (median 10 min, sigma 1.5: most jobs are short, a few run for
    days), gangs of 1-8 GPUs (most 1), arrivals Poisson at the rate that offers ``load`` of the
    cluster's GPU-time, and estimates off by a log-normal factor (``estimate_error``), as a
    prediction from history is. Every job checkpoints each ``checkpoint_s`` of work (None:
    none does, so nothing is preempted).
    """
    rng = random.Random(seed)
    sizes, size_weights = (1, 2, 4, 8), (0.6, 0.2, 0.15, 0.05)
    durations = [600 * math.exp(rng.gauss(0, 1.5)) for _ in range(jobs)]
    gangs = rng.choices(sizes, size_weights, k=jobs)
    mean_work = sum(d * g for d, g in zip(durations, gangs, strict=True)) / jobs
    rate = load * gpus / mean_work
    now, trace = 0.0, []
    for index, (duration, gang) in enumerate(zip(durations, gangs, strict=True)):
        now += rng.expovariate(rate)
        trace.append(TraceJob(
            id=f"j{index:04d}", submit_s=now, duration_s=duration,
            needs=Resources(cpus=2.0 * gang, gpus=float(min(gang, gpus))),
            team=rng.choice(list(teams)), priority=rng.choices((0, 1, 2), (0.7, 0.2, 0.1))[0],
            estimate_s=duration * math.exp(rng.gauss(0, estimate_error)),
            checkpoint_s=checkpoint_s,
        ))
    return trace
