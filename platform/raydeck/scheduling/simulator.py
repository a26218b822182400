"""Replaying a cluster's job trace through a policy, without Ray; and seeded synthetic traces.

Owns: the trace format (CSV, :func:`read_trace` / :func:`write_trace`), :func:`generate_trace`
(heavy-tailed durations, as in production clusters: a few long jobs hold most of the time),
:func:`simulate` (an event-driven replay through the same :class:`Policy` objects the queue
uses) and :class:`Report` (per policy: average and p95 job completion time, average queueing
delay, utilization, the longest wait, and Jain's fairness index across teams).

Trace format: one row per job, a header with at least ``submit_s,duration_s,team`` and any of
``id,cpus,gpus,priority,estimate_s``. ``submit_s`` counts from the trace's start; ``duration_s``
is how long the job really ran; ``estimate_s`` is what the scheduler is told (default: the
duration, a perfect prediction); ``cpus``/``gpus`` are the whole gang's resources (default 1
CPU, 0 GPUs); ``priority`` is an integer >= 0 (default 0). Export your cluster's history in this
form to replay it (``raydeck jobs`` or Ray's job API give submit, start and end times).
"""

from __future__ import annotations

import csv
import heapq
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raydeck.errors import ConfigError
from raydeck.scheduling.policies import Capacity, Policy, QueuedJob, Resources, RunningJob

COLUMNS = ("id", "submit_s", "duration_s", "cpus", "gpus", "team", "priority", "estimate_s")


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

    def __post_init__(self) -> None:
        for name in ("submit_s", "duration_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"job {self.id}: {name}={value} must be a number >= 0")
        if self.priority < 0:
            raise ConfigError(f"job {self.id}: priority={self.priority} must be >= 0")
        if self.estimate_s is not None and not self.estimate_s > 0:
            raise ConfigError(f"job {self.id}: estimate_s={self.estimate_s} must be > 0")

    def queued(self) -> QueuedJob:
        estimate = self.estimate_s if self.estimate_s is not None else self.duration_s
        return QueuedJob(self.id, self.team, self.priority, self.needs, self.submit_s,
                         max(estimate, 1e-9))


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
                ))
            except (ValueError, ConfigError) as exc:
                raise ConfigError(f"{path}, line {line}: {exc}") from None
    return jobs


def write_trace(jobs: Iterable[TraceJob], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        for job in jobs:
            writer.writerow([job.id, f"{job.submit_s:.3f}", f"{job.duration_s:.3f}",
                             job.needs.cpus, job.needs.gpus, job.team, job.priority,
                             "" if job.estimate_s is None else f"{job.estimate_s:.3f}"])


def generate_trace(jobs: int = 400, *, seed: int = 0, gpus: float = 16, load: float = 0.9,
                   teams: Sequence[str] = ("vision", "nlp", "speech"),
                   estimate_error: float = 0.3) -> list[TraceJob]:
    """A seeded heavy-tailed trace for a ``gpus``-GPU cluster at ``load`` offered load.

    Durations are log-normal (median 10 min, sigma 1.5: most jobs are short, a few run for
    days), gangs of 1-8 GPUs (most 1), arrivals Poisson at the rate that offers ``load`` of the
    cluster's GPU-time, and estimates off by a log-normal factor (``estimate_error``), as a
    prediction from history is.
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
        ))
    return trace


@dataclass(frozen=True)
class Scheduled:
    """When one job started and ended in a replay."""

    job: TraceJob
    start_s: float
    end_s: float

    @property
    def completion_s(self) -> float:
        return self.end_s - self.job.submit_s

    @property
    def wait_s(self) -> float:
        return self.start_s - self.job.submit_s


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

    @classmethod
    def of(cls, policy: str, schedule: Sequence[Scheduled], capacity: Resources) -> Report:
        completions = np.asarray([s.completion_s for s in schedule])
        waits = np.asarray([s.wait_s for s in schedule])
        span = max(s.end_s for s in schedule) - min(s.job.submit_s for s in schedule)
        use_gpus = capacity.gpus > 0
        busy = sum((s.job.needs.gpus if use_gpus else s.job.needs.cpus) * s.job.duration_s
                   for s in schedule)
        size = capacity.gpus if use_gpus else capacity.cpus
        slowdowns: dict[str, list[float]] = {}
        for s in schedule:
            slowdowns.setdefault(s.job.team, []).append(
                s.completion_s / max(s.job.duration_s, 1.0))
        per_team = np.asarray([float(np.mean(v)) for v in slowdowns.values()])
        return cls(policy, len(schedule), float(completions.mean()),
                   float(np.percentile(completions, 95)), float(waits.mean()),
                   float(waits.max()), busy / (size * span) if span > 0 else 0.0,
                   float(per_team.sum() ** 2 / (len(per_team) * (per_team ** 2).sum())))


def simulate(trace: Sequence[TraceJob], policy: Policy, capacity: Resources,
             pinned: Sequence[str] = ()) -> list[Scheduled]:
    """Replay ``trace`` on a cluster of ``capacity`` under ``policy``; every job runs once.

    Jobs whose ids are in ``pinned`` start when they arrive, whatever the policy says (the
    queue uses this for jobs already running when it predicts start times).

    Raises:
        ConfigError: a job larger than the cluster (it could never start).
    """
    for job in trace:
        if not capacity.fits(job.needs):
            raise ConfigError(f"job {job.id} needs {job.needs.cpus:g} CPU, {job.needs.gpus:g} "
                              f"GPU; the cluster has {capacity.cpus:g} CPU, "
                              f"{capacity.gpus:g} GPU")
    by_id = {job.id: job for job in trace}
    if len(by_id) != len(trace):
        raise ConfigError("trace: job ids must be unique")
    arrivals = sorted(trace, key=lambda j: (j.submit_s, j.id))
    ends: list[tuple[float, str]] = []
    queue: list[QueuedJob] = []
    running: dict[str, RunningJob] = {}
    started: dict[str, float] = {}
    free, now, index = capacity, 0.0, 0
    while index < len(arrivals) or queue or running:
        next_arrival = arrivals[index].submit_s if index < len(arrivals) else math.inf
        next_end = ends[0][0] if ends else math.inf
        now = min(next_arrival, next_end)
        while ends and ends[0][0] <= now:
            _, job_id = heapq.heappop(ends)
            done = running.pop(job_id)
            free = free + done.job.needs
            policy.ended(done, now)
        while index < len(arrivals) and arrivals[index].submit_s <= now:
            arrival = arrivals[index].queued()
            index += 1
            if arrival.id in pinned:
                running[arrival.id] = RunningJob(arrival, now)
                started[arrival.id] = now
                free = free - arrival.needs
                heapq.heappush(ends, (now + by_id[arrival.id].duration_s, arrival.id))
            else:
                queue.append(arrival)
        if not queue:
            continue
        for chosen in policy.decide(queue, list(running.values()), Capacity(free), capacity,
                                    now):
            queue.remove(chosen)
            running[chosen.id] = RunningJob(chosen, now)
            started[chosen.id] = now
            free = free - chosen.needs
            heapq.heappush(ends, (now + by_id[chosen.id].duration_s, chosen.id))
        if not running and queue and index >= len(arrivals):
            raise ConfigError(f"policy {policy.name} can start none of "
                              f"{', '.join(j.id for j in queue)} on an idle cluster (a job "
                              "larger than its team's quota?)")
    return [Scheduled(job, started[job.id], started[job.id] + job.duration_s)
            for job in trace]
