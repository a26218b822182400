"""Replaying a cluster's job trace through a policy, without Ray.

Owns: :func:`simulate` (an event-driven replay through the same :class:`Policy` objects the
queue uses, preemption and elastic resizes included) and :class:`PreemptionCost`. Does not own:
the trace (its CSV format, seeded synthetic traces: :mod:`raydeck.scheduling.simulator.trace`) or
what a replay returns and the figures made of it
(:class:`~raydeck.scheduling.simulator.report.Scheduled`,
:class:`~raydeck.scheduling.simulator.report.Report`: :mod:`raydeck.scheduling.simulator.report`).

Preemption as the queue does it, with the same rules
(:mod:`raydeck.scheduling.policies.preemption`): when the policy's first waiting job does not fit,
the policy names victims among the jobs that may be stopped; each stops at its next checkpoint,
losing no work, goes back to the queue (same submission time, behind the job it was stopped for) and
later runs what it had left, with the service it attained so far in its queued job
(:attr:`~raydeck.scheduling.policies.core.QueuedJob.attained_s`, as the queue keeps it in its
store: ``las`` and ``gittins`` rank by it). With a :class:`PreemptionCost` a preemption costs
what it costs a real job: it stops at once, losing the work since its last checkpoint, and its
restart holds its resources :data:`RESTART_OVERHEAD_S` before it makes progress again.

Elastic jobs (a trace job with ``min_workers < workers``; which ones resize and by how much is
:mod:`raydeck.scheduling.policies.elastic`'s), as Ray Train v2 runs them and the queue's preemption
path stops jobs: the policy sees a waiting elastic job at its minimum, and it starts at the largest
size that fits when no waiting job could use the room, else at its minimum. When the policy's
first waiting job does not fit, elastic jobs are shrunk before any job is preempted, if
shrinking those that may be stopped (:func:`~raydeck.scheduling.policies.preemption.preemptible`)
makes it fit; the room is kept for that job as a victim's is. They grow back into free room no
waiting job can use, at a checkpoint (a restarted attempt, once it has run
:data:`~raydeck.scheduling.policies.preemption.MIN_RUN_BEFORE_PREEMPTION_S`). A resize is a
restart from the latest checkpoint. A shrink is made as a preemption is: at the next checkpoint,
losing nothing, or with a :class:`PreemptionCost` at once, losing the work since the last one;
a growth, which nothing waits on, always at a checkpoint (with a cost, growing at once lost 1.7x
the GPU-hours and made FIFO's average JCT 1.4x, SJF's 1.7x on the benchmark's trace). Either
pays the restart with a cost, and the job goes on at once at its new size (it does not queue).
Work progresses at the speed of the current size (its scaling curve), and utilization counts
the GPUs held at each size, less what bought no progress.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from raydeck.errors import ConfigError
from raydeck.scheduling.policies import elastic as resizing
from raydeck.scheduling.policies import preemption as rules
from raydeck.scheduling.policies.attained_service import service_rate
from raydeck.scheduling.policies.core import Capacity, Policy, QueuedJob, Resources, RunningJob
from raydeck.scheduling.simulator.report import Scheduled
from raydeck.scheduling.simulator.trace import TraceJob

# Seconds from a preempted job's stop to its training running again (workers start, the
# checkpoint loads): the queue's preemption test on a one-node cluster measured 30-60 s.
RESTART_OVERHEAD_S = 45.0


@dataclass(frozen=True)
class PreemptionCost:
    """What a preemption costs in a replay: the work since the victim's last checkpoint and
    ``restart_s`` of holding its resources before it runs again (module docstring)."""

    restart_s: float = RESTART_OVERHEAD_S

    def __post_init__(self) -> None:
        if not (math.isfinite(self.restart_s) and self.restart_s >= 0):
            raise ConfigError(f"restart_s={self.restart_s}: must be a number >= 0")


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
        needs = job.queued().needs  # an elastic job's minimum
        if not capacity.fits(needs):
            raise ConfigError(f"job {job.id} needs {needs.cpus:g} CPU, {needs.gpus:g} "
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
        self.served: dict[str, float] = {}  # service its ended pieces had (attained_service)
        self.ends: list[tuple[float, str]] = []
        self.end_at: dict[str, float] = {}
        self.stopping: set[str] = set()
        self.preempted_for: dict[str, str] = {}  # victim -> the job it was stopped for
        self.pieces: dict[str, list[tuple[float, float]]] = {}
        # Elastic jobs: workers now (while running), per piece, resizes, resizes asked for.
        self.elastic = any(job.elasticity.elastic for job in jobs.values())
        self.size: dict[str, int] = {}
        self.sizes: dict[str, list[int]] = {}
        self.resizes: dict[str, int] = {}
        self.resizing: dict[str, int] = {}
        self.woken: dict[str, float] = {}  # the checkpoint an elastic job last woke us for

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
            started: list[str] = []
            if self.queue:
                running = [self._view(r, now) for r in self.running.values()]
                self.preempted_for = rules.held_back(self.preempted_for,
                                                     {job.id for job in self.queue})
                for chosen in rules.decide(self.policy, self.queue, running,
                                           Capacity(self.free), self.capacity, now,
                                           self.preempted_for):
                    self.queue.remove(chosen)
                    self._start(chosen, now)
                    started.append(chosen.id)
                self._preempt(now)
                if not self.running and self.queue and index >= len(arrivals):
                    raise ConfigError(f"policy {self.policy.name} can start none of "
                                      f"{', '.join(j.id for j in self.queue)} on an idle "
                                      "cluster (a job larger than its team's quota?)")
            if self.elastic:
                self._grow(started, now)
        return [Scheduled(job, tuple(self.pieces[job.id]), self.lost.get(job.id, 0.0),
                          tuple(self.sizes.get(job.id, ())), self.resizes.get(job.id, 0))
                for job in self.jobs.values()]

    def _start(self, job: QueuedJob, now: float, workers: int | None = None) -> None:
        """Start (or restart) ``job`` at ``workers`` (default: the size it was queued at, an
        elastic job's minimum)."""
        trace = self.jobs[job.id]
        size = trace.elasticity.min_workers if workers is None else workers
        self.running[job.id] = RunningJob(job, now, resumed=job.id in self.pieces)
        self.free = self.free - job.needs
        overhead = self.cost.restart_s if self.cost and job.id in self.pieces else 0.0
        if overhead:
            self.overhead[job.id] = overhead
            self.lost[job.id] = (self.lost.get(job.id, 0.0)
                                 + overhead * self._share(job.id, size))
        if trace.elasticity.elastic:
            self.size[job.id] = size
        self._end_at(job.id, _after(now + overhead, trace.duration_s,
                                    self.done_before.get(job.id, 0), trace.elasticity.speed(size)))

    def _share(self, job_id: str, workers: int) -> float:
        """The share of its gang a job holds at ``workers`` (1.0 for a fixed gang)."""
        full = self.jobs[job_id].workers
        return 1.0 if workers == full else workers / full

    def _rate(self, job_id: str) -> float:
        """The running job's progress per second (1.0 at its full size)."""
        trace = self.jobs[job_id]
        return trace.elasticity.speed(self.size.get(job_id, trace.workers))

    def _end_at(self, job_id: str, at: float) -> None:
        self.end_at[job_id] = at
        heapq.heappush(self.ends, (at, job_id))

    def _end(self, job_id: str, now: float) -> None:
        """A piece ended: the job finished, or stopped at the checkpoint it was asked to."""
        piece = self.running.pop(job_id)
        del self.end_at[job_id]
        self.free = self.free + piece.job.needs
        self.served[job_id] = (self.served.get(job_id, 0.0)
                               + service_rate(piece.job.needs) * (now - piece.started_s))
        self.policy.ended(piece, now)
        self.pieces.setdefault(job_id, []).append((piece.started_s, now))
        size = self.size.get(job_id)
        if size is not None:
            self.sizes.setdefault(job_id, []).append(size)
        resize = self.resizing.pop(job_id, None)
        if job_id not in self.stopping and resize is None:
            self.size.pop(job_id, None)
            self.policy.finished(piece, now)
            return
        self.stopping.discard(job_id)
        done = self._done(piece, now)
        checkpoints = self._checkpoints(piece, now)
        self.size.pop(job_id, None)
        if self.cost and checkpoints is not None:
            done = checkpoints[1]  # back to its last checkpoint
            if size is None:  # a fixed gang: summed as it always was
                self.lost[job_id] = self.lost.get(job_id, 0.0) + checkpoints[0] - done
            else:  # the piece's seconds since, at the share of the gang it held
                self.lost[job_id] = (self.lost.get(job_id, 0.0) + (checkpoints[0] - done)
                                     / self.jobs[job_id].elasticity.speed(size)
                                     * self._share(job_id, size))
        self.overhead.pop(job_id, None)
        self.done_before[job_id] = done
        if resize is None:
            self.queue.append(self.jobs[job_id].queued(done, served_s=self.served[job_id]))
            return
        self.resizes[job_id] = self.resizes.get(job_id, 0) + 1
        self._start(self.jobs[job_id].queued(done, resize, self.served[job_id]), now, resize)

    def _done(self, piece: RunningJob, now: float) -> float:
        """Work done by ``now`` (a restart's overhead is none)."""
        overhead = self.overhead.get(piece.job.id, 0.0)
        if overhead:
            now = max(now - overhead, piece.started_s)
        rate = self._rate(piece.job.id)
        if rate == 1.0:  # as before elastic jobs: fixed gangs' replays stay bit for bit
            return self.done_before.get(piece.job.id, 0.0) + now - piece.started_s
        return self.done_before.get(piece.job.id, 0.0) + (now - piece.started_s) * rate

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
                          now - (done - committed) / self._rate(piece.job.id) if new else None,
                          piece.resumed)

    def _next_checkpoint(self, piece: RunningJob, now: float) -> float | None:
        """When ``piece`` stops at a checkpoint if asked now: now with a cost (it goes back to
        its last one) or when at one (within rounding), else at its next; None: it never
        checkpoints."""
        checkpoints = self._checkpoints(piece, now)
        if checkpoints is None:
            return None
        done, committed, every = checkpoints
        if self.cost:
            return now
        return _after(now, committed if done - committed < 1e-9 else committed + every, done,
                      self._rate(piece.job.id))

    def _preempt(self, now: float) -> None:
        """Shrink elastic jobs for the first waiting job if that is enough, else ask the
        policy's victims to stop at their next checkpoint (jobs already stopping count as
        gone, as in the queue; what a shrink under way gives back, as free)."""
        if not self.queue:
            return
        pool = self.free
        for job_id in self.stopping:
            pool = pool + self.running[job_id].job.needs
        for job_id, size in self.resizing.items():
            trace = self.jobs[job_id]
            pool = pool + self.running[job_id].job.needs - trace.elasticity.needs_at(
                trace.needs, size)
        others = [self._view(r, now) for r in self.running.values()
                  if r.job.id not in self.stopping and r.job.id not in self.resizing]
        queue = [job for job in self.queue if job.id not in self.preempted_for]
        if self.elastic and self._shrink(queue, others, pool, now):
            return
        decision = rules.preempt(self.policy, queue, others, pool, now)
        if decision is None:
            self._wake_at_next_checkpoint(others, now)
            return
        for victim in decision.victims:
            stop = self._next_checkpoint(victim, now)
            assert stop is not None, "the policy takes only jobs with a checkpoint"
            if stop < self.end_at[victim.job.id]:
                self.stopping.add(victim.job.id)
                self.preempted_for[victim.job.id] = decision.job.id
                self._end_at(victim.job.id, stop)

    def _resizable(self, running: Sequence[RunningJob]) -> list[resizing.Resizable]:
        """The elastic ones of ``running`` (views), as :mod:`~raydeck.scheduling.policies.elastic`
        decides on them."""
        return [resizing.Resizable(piece, self.size[piece.job.id],
                                   self.jobs[piece.job.id].elasticity,
                                   self.jobs[piece.job.id].needs)
                for piece in running if piece.job.id in self.size]

    def _shrink(self, queue: list[QueuedJob], others: list[RunningJob], pool: Resources,
                now: float) -> bool:
        """Shrink elastic jobs at their next checkpoint (as a preemption stops a victim) so
        that the first waiting job fits, the room kept for it; whether any was."""
        head, shrinks = resizing.shrink(self.policy, queue, others, self._resizable(others),
                                        pool, now,
                                        lambda r: rules.preemptible(r.running, now))
        views = {piece.job.id: piece for piece in others}
        asked = False
        for job_id, size in shrinks:
            assert head is not None
            stop = self._next_checkpoint(views[job_id], now)
            if stop is not None and stop < self.end_at[job_id]:
                self.resizing[job_id] = size
                self.preempted_for[job_id] = head.id
                self._end_at(job_id, stop)
                asked = True
        return asked

    def _grow(self, started: list[str], now: float) -> None:
        """Grow elastic jobs into free room no waiting job can use (:func:`~raydeck.scheduling.
        elastic.grow`): one started just now at once, in place; a running one by a resize now,
        if it may be stopped (:func:`~raydeck.scheduling.policies.preemption.preemptible`) and is
        at a checkpoint (module docstring). Then wake at the next checkpoint of each elastic
        job that may have to shrink or may grow."""
        queued = {job.id for job in self.queue}
        if self.resizing or self.stopping or any(
                job in queued for job in self.preempted_for.values()):
            return  # room is being made for a waiting job: it is that job's
        views = [self._view(r, now) for r in self.running.values()]
        fresh = set(started)

        def can_resize(job: resizing.Resizable) -> bool:
            if job.running.job.id in fresh:
                return True
            if not rules.preemptible(job.running, now):
                return False
            checkpoints = self._checkpoints(job.running, now)
            assert checkpoints is not None, "an elastic job checkpoints (TraceJob)"
            return checkpoints[0] - checkpoints[1] < 1e-9

        elastic = self._resizable(views)
        for job_id, size in resizing.grow(self.policy, self.queue, views, elastic, self.free,
                                          now, can_resize):
            if job_id in fresh:
                self._regrow(job_id, size, now)
            else:
                self.resizing[job_id] = size
                self._end(job_id, now)
        for piece in self.running.values():
            job_id = piece.job.id
            if job_id not in self.size:
                continue
            range_ = self.jobs[job_id].elasticity
            room = self.free.fits(range_.needs_at(self.jobs[job_id].needs, 1))
            if not ((self.queue and self.size[job_id] > range_.min_workers)
                    or (room and self.size[job_id] < range_.workers)):
                continue
            checkpoints = self._checkpoints(piece, now)
            assert checkpoints is not None
            done, committed, every = checkpoints
            at = now + (committed + every - done) / self._rate(job_id)
            if at < self.end_at[job_id] and self.woken.get(job_id) != at:
                self.woken[job_id] = at
                heapq.heappush(self.ends, (at, ""))

    def _regrow(self, job_id: str, size: int, now: float) -> None:
        """A job started at ``now`` starts at ``size`` workers instead (it has not run yet:
        no restart)."""
        old = self.running[job_id]
        trace = self.jobs[job_id]
        self.free = self.free + old.job.needs
        grown = trace.queued(self.done_before.get(job_id, 0.0), size,
                             self.served.get(job_id, 0.0))
        self.running[job_id] = RunningJob(grown, old.started_s, old.checkpoint_s, old.resumed)
        self.free = self.free - grown.needs
        overhead = self.overhead.get(job_id, 0.0)
        if overhead:  # a resumed job's restart, lost at the size it restarts at
            self.lost[job_id] += overhead * (self._share(job_id, size)
                                             - self._share(job_id, self.size[job_id]))
        self.size[job_id] = size
        self._end_at(job_id, _after(now + overhead, trace.duration_s,
                                    self.done_before.get(job_id, 0.0),
                                    trace.elasticity.speed(size)))

    def _wake_at_next_checkpoint(self, running: list[RunningJob], now: float) -> None:
        """The queue decides at every tick; the replay only at events. A job the policy says a
        waiting one may outrank (by default: of lower priority) may become a victim when it
        next commits a checkpoint: decide again then (an event with no job)."""
        times = []
        for piece in running:
            checkpoints = self._checkpoints(piece, now)
            if checkpoints is not None and self.policy.may_outrank(self.queue, piece):
                done, committed, every = checkpoints
                rate = self._rate(piece.job.id)
                at = (now + committed + every - done if rate == 1.0  # as _after's
                      else now + (committed + every - done) / rate)
                if at < self.end_at[piece.job.id]:
                    times.append(at)
        if times:
            heapq.heappush(self.ends, (min(times), ""))


def _after(now: float, target: float, done: float, rate: float) -> float:
    """When a job that has done ``done`` of its work at ``now`` reaches ``target``, making
    ``rate`` of progress per second (at rate 1.0 in the order the replay always summed it, so
    fixed gangs' replays stay bit for bit what they were)."""
    return now + target - done if rate == 1.0 else now + (target - done) / rate
