"""Replaying a cluster's job trace through a policy, without Ray; and seeded synthetic traces.

Owns: the trace format (CSV, :func:`read_trace` / :func:`write_trace`), :func:`generate_trace`
(heavy-tailed durations, as in production clusters: a few long jobs hold most of the time),
:func:`simulate` (an event-driven replay through the same :class:`Policy` objects the queue
uses, preemption included) and :class:`Report` (per policy: average and p95 job completion
time, average queueing delay, utilization, the longest wait, the top priority's average wait,
preemptions, and Jain's fairness index across teams).

Trace format: one row per job, a header with at least ``submit_s,duration_s,team`` and any of
``id,cpus,gpus,priority,estimate_s,checkpoint_s``. ``submit_s`` counts from the trace's start;
``duration_s`` is how long the job really ran; ``estimate_s`` is what the scheduler is told
(default: the duration, a perfect prediction); ``cpus``/``gpus`` are the whole gang's resources
(default 1 CPU, 0 GPUs); ``priority`` is an integer >= 0 (default 0); ``checkpoint_s`` is the
work between two of the job's checkpoints (empty: it never checkpoints, so it is never
preempted). Export your cluster's history in this form to replay it (``raydeck jobs`` or Ray's
job API give submit, start and end times).

Preemption as the queue does it, with the same rules (:mod:`raydeck.scheduling.preemption_rules`):
when the policy's first waiting job does not fit, the policy names victims among the jobs that
may be stopped; each stops at its next checkpoint, losing no work, goes back to the queue (same
submission time, behind the job it was stopped for) and later runs what it had left. With a
:class:`PreemptionCost` a preemption costs what it costs a real job: it stops at once, losing
the work since its last checkpoint, and its restart holds its resources
:data:`RESTART_OVERHEAD_S` before it makes progress again.
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
from raydeck.scheduling import preemption_rules as rules
from raydeck.scheduling.policies import Capacity, Policy, QueuedJob, Resources, RunningJob

# Seconds from a preempted job's stop to its training running again (workers start, the
# checkpoint loads): the queue's preemption test on a one-node cluster measured 30-60 s.
RESTART_OVERHEAD_S = 45.0

COLUMNS = ("id", "submit_s", "duration_s", "cpus", "gpus", "team", "priority", "estimate_s",
           "checkpoint_s")


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

    def __post_init__(self) -> None:
        for name in ("submit_s", "duration_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"job {self.id}: {name}={value} must be a number >= 0")
        if self.priority < 0:
            raise ConfigError(f"job {self.id}: priority={self.priority} must be >= 0")
        for name in ("estimate_s", "checkpoint_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"job {self.id}: {name}={value} must be > 0")

    def queued(self, done_s: float = 0.0) -> QueuedJob:
        """As the queue sees it, ``done_s`` of its work already done (before a preemption)."""
        estimate = self.estimate_s if self.estimate_s is not None else self.duration_s
        return QueuedJob(self.id, self.team, self.priority, self.needs, self.submit_s,
                         max(estimate - done_s, 1e-9))


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
                             "" if job.estimate_s is None else f"{job.estimate_s:.3f}",
                             "" if job.checkpoint_s is None else f"{job.checkpoint_s:.3f}"])


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


@dataclass(frozen=True)
class PreemptionCost:
    """What a preemption costs in a replay: the work since the victim's last checkpoint and
    ``restart_s`` of holding its resources before it runs again (module docstring)."""

    restart_s: float = RESTART_OVERHEAD_S

    def __post_init__(self) -> None:
        if not (math.isfinite(self.restart_s) and self.restart_s >= 0):
            raise ConfigError(f"restart_s={self.restart_s}: must be a number >= 0")


@dataclass(frozen=True)
class Scheduled:
    """When one job ran in a replay: ``pieces`` of (start, end), more than one when it was
    preempted; ``lost_s``: seconds of them that bought no progress (work redone after a
    preemption, restarts), 0 unless the replay charged a :class:`PreemptionCost`."""

    job: TraceJob
    pieces: tuple[tuple[float, float], ...]
    lost_s: float = 0.0

    @property
    def start_s(self) -> float:
        return self.pieces[0][0]

    @property
    def end_s(self) -> float:
        return self.pieces[-1][1]

    @property
    def preemptions(self) -> int:
        return len(self.pieces) - 1

    @property
    def completion_s(self) -> float:
        return self.end_s - self.job.submit_s

    @property
    def wait_s(self) -> float:
        """Time queued in all: before it started and after each preemption."""
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
        top = max(s.job.priority for s in schedule)
        return cls(policy, len(schedule), float(completions.mean()),
                   float(np.percentile(completions, 95)), float(waits.mean()),
                   float(waits.max()), busy / (size * span) if span > 0 else 0.0,
                   float(per_team.sum() ** 2 / (len(per_team) * (per_team ** 2).sum())),
                   float(np.mean([s.wait_s for s in schedule if s.job.priority == top])),
                   sum(s.preemptions for s in schedule),
                   sum(s.lost_s * s.job.needs.gpus for s in schedule) / 3600)


def simulate(trace: Sequence[TraceJob], policy: Policy, capacity: Resources,
             pinned: Sequence[str] = (), cost: PreemptionCost | None = None) -> list[Scheduled]:
    """Replay ``trace`` on a cluster of ``capacity`` under ``policy``: every job runs all its
    work, in one piece or, preempted at checkpoints, in several.

    Jobs whose ids are in ``pinned`` start when they arrive, whatever the policy says (the
    queue uses this for jobs already running when it predicts start times). ``cost``: what a
    preemption costs (None: nothing; victims stop at their next checkpoint).

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
    return _Replay(by_id, policy, capacity, pinned, cost).run(
        sorted(trace, key=lambda j: (j.submit_s, j.id)))


class _Replay:
    """One replay's state: the queue, the running jobs (each from when its current piece
    started, with the work it had done before), and the events (a heap of (time, job): an
    event whose time is not its job's end is only a time to decide again: the job was asked
    to stop earlier, or it is a checkpoint at which a victim may be chosen)."""

    def __init__(self, jobs: dict[str, TraceJob], policy: Policy, capacity: Resources,
                 pinned: Sequence[str], cost: PreemptionCost | None) -> None:
        self.jobs, self.policy, self.capacity, self.pinned = jobs, policy, capacity, pinned
        self.cost = cost
        self.overhead: dict[str, float] = {}  # the running piece's restart, with a cost
        self.lost: dict[str, float] = {}
        self.free = capacity
        self.queue: list[QueuedJob] = []
        self.running: dict[str, RunningJob] = {}
        self.done_before: dict[str, float] = {}  # work done before the running piece
        self.ends: list[tuple[float, str]] = []
        self.end_at: dict[str, float] = {}
        self.stopping: set[str] = set()
        self.preempted_for: dict[str, str] = {}  # victim -> the job it was stopped for
        self.pieces: dict[str, list[tuple[float, float]]] = {}

    def run(self, arrivals: list[TraceJob]) -> list[Scheduled]:
        index = 0
        while index < len(arrivals) or self.queue or self.running:
            next_arrival = arrivals[index].submit_s if index < len(arrivals) else math.inf
            now = min(next_arrival, self.ends[0][0] if self.ends else math.inf)
            while self.ends and self.ends[0][0] <= now:
                at, job_id = heapq.heappop(self.ends)
                if self.end_at.get(job_id) == at:
                    self._end(job_id, now)
            while index < len(arrivals) and arrivals[index].submit_s <= now:
                arrival = arrivals[index]
                index += 1
                if arrival.id in self.pinned:
                    self._start(arrival.queued(), now)
                else:
                    self.queue.append(arrival.queued())
            if not self.queue:
                continue
            running = [self._view(r, now) for r in self.running.values()]
            self.preempted_for = rules.held_back(self.preempted_for,
                                                 {job.id for job in self.queue})
            for chosen in rules.decide(self.policy, self.queue, running, Capacity(self.free),
                                       self.capacity, now, self.preempted_for):
                self.queue.remove(chosen)
                self._start(chosen, now)
            self._preempt(now)
            if not self.running and self.queue and index >= len(arrivals):
                raise ConfigError(f"policy {self.policy.name} can start none of "
                                  f"{', '.join(j.id for j in self.queue)} on an idle cluster "
                                  "(a job larger than its team's quota?)")
        return [Scheduled(job, tuple(self.pieces[job.id]), self.lost.get(job.id, 0.0))
                for job in self.jobs.values()]

    def _start(self, job: QueuedJob, now: float) -> None:
        self.running[job.id] = RunningJob(job, now, resumed=job.id in self.pieces)
        self.free = self.free - job.needs
        overhead = self.cost.restart_s if self.cost and job.id in self.pieces else 0.0
        if overhead:
            self.overhead[job.id] = overhead
            self.lost[job.id] = self.lost.get(job.id, 0.0) + overhead
        self._end_at(job.id, now + overhead + self.jobs[job.id].duration_s
                     - self.done_before.get(job.id, 0))

    def _end_at(self, job_id: str, at: float) -> None:
        self.end_at[job_id] = at
        heapq.heappush(self.ends, (at, job_id))

    def _end(self, job_id: str, now: float) -> None:
        """A piece ended: the job finished, or stopped at the checkpoint it was asked to."""
        piece = self.running.pop(job_id)
        del self.end_at[job_id]
        self.free = self.free + piece.job.needs
        self.policy.ended(piece, now)
        self.pieces.setdefault(job_id, []).append((piece.started_s, now))
        if job_id not in self.stopping:
            self.policy.finished(piece, now)
            return
        self.stopping.discard(job_id)
        done = self._done(piece, now)
        if self.cost and (checkpoints := self._checkpoints(piece, now)) is not None:
            done = checkpoints[1]  # back to its last checkpoint
            self.lost[job_id] = self.lost.get(job_id, 0.0) + checkpoints[0] - done
        self.overhead.pop(job_id, None)
        self.done_before[job_id] = done
        self.queue.append(self.jobs[job_id].queued(done))

    def _done(self, piece: RunningJob, now: float) -> float:
        """Work done by ``now`` (a restart's overhead is none)."""
        overhead = self.overhead.get(piece.job.id, 0.0)
        if overhead:
            now = max(now - overhead, piece.started_s)
        return self.done_before.get(piece.job.id, 0.0) + now - piece.started_s

    def _checkpoints(self, piece: RunningJob, now: float) -> tuple[float, float, float] | None:
        """``(done, committed, every)``: the work the job has done by ``now``, the work its last
        checkpoint holds, and the work between checkpoints; None when it never checkpoints."""
        every = self.jobs[piece.job.id].checkpoint_s
        if every is None:
            return None
        done = self._done(piece, now)
        return done, math.floor(done / every + 1e-9) * every, every

    def _view(self, piece: RunningJob, now: float) -> RunningJob:
        """``piece`` with when it last committed a checkpoint in this piece (None: none yet;
        the one it resumed from does not count)."""
        checkpoints = self._checkpoints(piece, now)
        if checkpoints is None:
            return piece
        done, committed, _ = checkpoints
        new = committed > self.done_before.get(piece.job.id, 0.0) + 1e-9
        return RunningJob(piece.job, piece.started_s,
                          now - (done - committed) if new else None, piece.resumed)

    def _preempt(self, now: float) -> None:
        """Ask the policy's victims to stop at their next checkpoint (jobs already stopping
        count as gone, as in the queue)."""
        if not self.queue:
            return
        pool = self.free
        for job_id in self.stopping:
            pool = pool + self.running[job_id].job.needs
        others = [self._view(r, now) for r in self.running.values()
                  if r.job.id not in self.stopping]
        decision = rules.preempt(self.policy, [job for job in self.queue
                                               if job.id not in self.preempted_for],
                                 others, pool, now)
        if decision is None:
            self._wake_at_next_checkpoint(others, now)
            return
        for victim in decision.victims:
            checkpoints = self._checkpoints(victim, now)
            assert checkpoints is not None, "the policy takes only jobs with a checkpoint"
            done, committed, every = checkpoints
            # At a checkpoint now (within rounding) or with a cost: stop here; else at the next.
            stop = (now if self.cost else
                    now + (committed if done - committed < 1e-9 else committed + every) - done)
            if stop < self.end_at[victim.job.id]:
                self.stopping.add(victim.job.id)
                self.preempted_for[victim.job.id] = decision.job.id
                self._end_at(victim.job.id, stop)

    def _wake_at_next_checkpoint(self, running: list[RunningJob], now: float) -> None:
        """The queue decides at every tick; the replay only at events. A job the policy says a
        waiting one may outrank (by default: of lower priority) may become a victim when it
        next commits a checkpoint: decide again then (an event with no job)."""
        times = []
        for piece in running:
            checkpoints = self._checkpoints(piece, now)
            if checkpoints is not None and self.policy.may_outrank(self.queue, piece):
                done, committed, every = checkpoints
                at = now + committed + every - done
                if at < self.end_at[piece.job.id]:
                    times.append(at)
        if times:
            heapq.heappush(self.ends, (min(times), ""))
