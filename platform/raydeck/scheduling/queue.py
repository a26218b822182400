"""The job queue: policies applied to real jobs, with durable state, in front of a job server.

Owns: :class:`JobQueue` (submit, cancel, list with the reason each job waits and its predicted
start, and :meth:`JobQueue.tick`, which reconciles the jobs it started with the job server and
starts what the policy says), :class:`Team` and :class:`JobSpec`. The job server is behind the
small :class:`Launcher` interface (:mod:`raydeck.scheduling.ray_jobs` is Ray's), so the queue's
logic is the same in tests and on a cluster. Does not own: the Ray actor that hosts it
(:mod:`raydeck.scheduling.actor`), the policies (:mod:`raydeck.scheduling.policies`) or the
job's side of preemption (:mod:`raydeck.preemption`).

Preemption: when the policy names victims for a job that cannot start, each becomes
``preempting``; the job learns it when it next commits a checkpoint
(:mod:`raydeck.preemption`), stops there and exits; the queue puts it back in the
queue (same submission time, but behind the job it was stopped for, and not stopped again
before it commits a new checkpoint: :mod:`raydeck.scheduling.preemption_rules`) and later
starts it again as a new job-server job (``<id>-r<N>``) with the same MLflow run id, so it
resumes from that checkpoint in its run. A job told to stop that still ends SUCCEEDED without
its driver saying training ran to its end (:meth:`JobQueue.completed`) is requeued the same
way. A job still running ``PREEMPT_GRACE_S`` after being asked is stopped by the job server
and requeued the same way (it loses the work since its last checkpoint), and so is a started
job the job server no longer knows (the head restarted and the job died with it).

A job whose submission fails is never retried in a loop that holds up the queue: a permanent
failure (the job server refuses its runtime env or the job) fails that job with the reason,
shown by ``raydeck queue``; a transient one (the job server down or busy) puts it back in its
place to be tried again after a backoff (:mod:`raydeck.scheduling.failures`). Either way the
jobs behind it start in the same tick.

Resources a queued job may use are the smaller of what the cluster has free now (jobs started
outside the queue count) and the total minus what the queue's active jobs hold (a job that has
just started may not have claimed its resources yet); a job with a preset starts only when its
whole gang can be placed on what each node has free (:class:`~raydeck.scheduling.policies.Gang`).

Ray, not the queue, chooses each worker's node. A strict gang (``STRICT_PACK``,
``STRICT_SPREAD``) therefore starts alone: not while a job the queue started in the last
``CLAIM_S`` seconds has no placement group placed by Ray yet, and nothing starts after it until
Ray has placed its own (or ``CLAIM_S`` has passed: a job that never asks Ray for a placement
group). Otherwise Ray may put a job started beside it on the node the gang was counted on (seen
on two nodes: two 1-CPU jobs started in the gang's tick took its node, and it waited in Ray).
"""

from __future__ import annotations

import abc
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raydeck.errors import ConfigError
from raydeck.redaction import redact_text
from raydeck.scheduling import preemption_rules as rules
from raydeck.scheduling.failures import Backoff, classify
from raydeck.scheduling.policies import (
    DEFAULT_AGING_S,
    Capacity,
    Gang,
    Policy,
    QueuedJob,
    Resources,
    RunningJob,
    make_policy,
    team_usage,
)
from raydeck.scheduling.store import ACTIVE, JobRow, JobView, Store

logger = logging.getLogger(__name__)

DEFAULT_ESTIMATE_S = 3600.0
PREEMPT_GRACE_S = 300.0
# How long a strict gang waits at most for a job started before it (or the jobs after it wait
# for it) to be placed by Ray: a job may never ask Ray for a placement group.
CLAIM_S = 120.0
PREDICTION_QUANTILE = 0.75
DEFAULT_TEAM = "default"
_TEAM_NAME = re.compile(r"^[a-z0-9][a-z0-9_\-]{0,63}$")
TERMINAL = {"SUCCEEDED": "succeeded", "FAILED": "failed", "STOPPED": "stopped"}
# How long ``raydeck queue`` keeps showing a job the job server refused (it never started).
REFUSED_SHOWN_S = 24 * 3600.0


@dataclass(frozen=True)
class Team:
    """A team sharing the cluster: its fair-share weight and optional quota."""

    name: str
    weight: float = 1.0
    quota: Resources | None = None

    def __post_init__(self) -> None:
        if not _TEAM_NAME.match(self.name):
            raise ConfigError(f"team {self.name!r}: use 1-64 of a-z 0-9 _ -")
        if not self.weight > 0:
            raise ConfigError(f"team {self.name}: weight={self.weight} must be > 0")

    @classmethod
    def parse(cls, name: str, spec: Mapping[str, Any]) -> Team:
        """A team from ``{weight: 2, gpus: 4, cpus: 32}`` (the teams file's entries)."""
        unknown = set(spec) - {"weight", "gpus", "cpus"}
        if unknown:
            raise ConfigError(f"team {name}: unknown key(s) {', '.join(sorted(unknown))}; "
                              "a team has weight, gpus, cpus")
        quota = (Resources(float(spec.get("cpus", float("inf"))),
                           float(spec.get("gpus", float("inf"))))
                 if "gpus" in spec or "cpus" in spec else None)
        return cls(name, float(spec.get("weight", 1.0)), quota)


@dataclass(frozen=True)
class JobSpec:
    """What a client queues: one job for the job server, and what it needs."""

    id: str
    team: str
    priority: int
    preset: str
    needs: Resources
    key: str
    entrypoint: str
    runtime_env: dict[str, Any]
    metadata: dict[str, str] = field(default_factory=dict)
    package_uri: str = ""
    estimate_s: float | None = None
    gang: Gang | None = None

    def __post_init__(self) -> None:
        if self.priority < 0:
            raise ConfigError(f"--priority={self.priority}: must be >= 0 (higher runs first)")
        if self.estimate_s is not None and not self.estimate_s > 0:
            raise ConfigError(f"--estimate={self.estimate_s}: must be > 0 seconds")


@dataclass(frozen=True)
class Entry:
    """One job in ``raydeck queue``: where it is and why it waits."""

    job: JobView
    position: int | None
    predicted_start_s: float | None
    why: str


class Launcher(abc.ABC):
    """The job server the queue starts jobs on."""

    @abc.abstractmethod
    def submit(self, row: JobRow, package: bytes | None) -> None:
        """Start the job as ``row.submission_id``; a job with that id already there counts as
        started. Raises what the job server's client raises (the queue classifies it with
        :func:`~raydeck.scheduling.failures.classify`)."""

    @abc.abstractmethod
    def status(self, submission_id: str) -> str | None:
        """Ray's job status (``PENDING``, ``RUNNING``, ``SUCCEEDED``...), None if unknown."""

    @abc.abstractmethod
    def stop(self, submission_id: str) -> None:
        """Stop a running job; raises as ``submit`` does (an HTTP 404: the job server never
        got it)."""

    @abc.abstractmethod
    def resources(self) -> tuple[tuple[Resources, ...], tuple[Resources, ...]]:
        """``(free now, total)`` of each node of the cluster (aligned)."""

    @abc.abstractmethod
    def placed(self, submission_id: str) -> bool:
        """Whether the cluster has placed the job's placement groups (its workers' resources;
        one given back since counts); False when it has none yet, one still waits, or that
        cannot be read."""


class Observer:
    """What the queue reports as it works (the actor exports it as metrics); no-ops here."""

    def started(self, row: JobRow, now: float) -> None:
        """``row`` was submitted to the job server at ``now`` (its wait: now - submitted)."""
        return None

    def ended(self, row: JobRow, now: float) -> None:
        """``row`` ended at ``now`` (its duration: now - started; predicted: estimate_s)."""
        return None

    def counts(self, by_team_and_state: dict[tuple[str, str], int]) -> None:
        """After each tick: how many jobs each team has queued and running."""
        return None

    def preempted(self, row: JobRow, now: float) -> None:
        """``row`` was asked at ``now`` to stop at its next checkpoint."""
        return None


class JobQueue:
    """The queue's logic over a :class:`Store` and a :class:`Launcher` (see module docs)."""

    def __init__(self, store: Store, launcher: Launcher,
                 clock: Callable[[], float] = time.time,
                 observer: Observer | None = None,
                 history: Callable[[str], list[float]] | None = None,
                 backoff: Backoff | None = None) -> None:
        """``history(key)``: how long earlier runs of the job with that key took, newest first
        (MLflow's: :func:`raydeck.scheduling.history.mlflow_durations`); the queue's own
        record of the jobs it ran is used when it has none or fails. ``backoff``: when a job
        whose submission failed transiently is tried again."""
        self._store = store
        self._backoff = backoff or Backoff()
        self._launcher = launcher
        self._history = history
        self._clock = clock
        self._observer = observer or Observer()
        self._policy = self._make_policy()

    # --- configuration ---------------------------------------------------------------------
    def teams(self) -> dict[str, Team]:
        raw = self._store.setting("teams", {})
        return {name: Team.parse(name, spec) for name, spec in raw.items()}

    def set_teams(self, teams: Mapping[str, Mapping[str, Any]]) -> None:
        """Replace the teams (validated first: a bad file changes nothing)."""
        for name, spec in teams.items():
            Team.parse(name, spec)
        self._store.set_setting("teams", dict(teams))
        self._policy = self._make_policy()

    def policy_name(self) -> str:
        return str(self._store.setting("policy", "fifo"))

    def set_policy(self, name: str, aging_s: float | None = None) -> None:
        make_policy(name)  # raises for an unknown name before anything is stored
        self._store.set_setting("policy", name)
        if aging_s is not None:
            if not aging_s > 0:
                raise ConfigError(f"--aging={aging_s}: must be > 0 seconds")
            self._store.set_setting("aging_s", aging_s)
        self._policy = self._make_policy()

    def _make_policy(self) -> Policy:
        name = self.policy_name()
        aging_s = float(self._store.setting("aging_s", DEFAULT_AGING_S))
        teams = self.teams()
        weights = {t.name: t.weight for t in teams.values()}
        quotas = {t.name: t.quota for t in teams.values() if t.quota is not None}
        policy = make_policy(name, aging_s, quotas, weights)
        # Fair share remembers usage: replay what ended (decay makes old history vanish).
        for row in self._store.jobs("succeeded", "failed", "stopped", "cancelled"):
            if row.started_at is not None and row.ended_at is not None:
                policy.ended(RunningJob(_queued(row), row.started_at), row.ended_at)
        return policy

    # --- clients -----------------------------------------------------------------------------
    def submit(self, spec: JobSpec, package: bytes | None = None) -> JobView:
        """Queue a job (nothing is queued when it is refused).

        Raises:
            ConfigError: unknown team, a job larger than the cluster or its team's quota, or
                an id already queued.
        """
        teams = self.teams()
        if teams and spec.team not in teams:
            raise ConfigError(f"--team {spec.team!r} is not one of the queue's teams: "
                              f"{', '.join(sorted(teams))} (`raydeck queue --teams FILE`)")
        _, nodes = self._launcher.resources()
        total = Resources.total(nodes)
        if not total.fits(spec.needs):
            raise ConfigError(f"job {spec.id} needs {spec.needs.describe()} but the whole "
                              f"cluster has {total.describe()}: it could never start")
        idle = Capacity(total, nodes)
        if spec.gang is not None and not idle.places(spec.gang):
            raise ConfigError(f"job {spec.id} needs {spec.gang.describe()}, which no placement "
                              f"on the cluster's {len(nodes)} node(s) ({idle.describe_nodes()}) "
                              "holds even when idle: it could never start")
        quota = teams[spec.team].quota if spec.team in teams else None
        if quota is not None and not quota.fits(spec.needs):
            raise ConfigError(f"job {spec.id} needs {spec.needs.describe()}, more than team "
                              f"{spec.team}'s quota of {quota.describe()}")
        # History beats a guess: the user's estimate counts only for a job never run before.
        estimate = self.predict(spec.key) or spec.estimate_s or DEFAULT_ESTIMATE_S
        if package is not None and spec.package_uri:
            self._store.add_package(spec.package_uri, package)
        row = JobRow(id=spec.id, team=spec.team, priority=spec.priority, cpus=spec.needs.cpus,
                     gpus=spec.needs.gpus, preset=spec.preset, key=spec.key,
                     entrypoint=spec.entrypoint, runtime_env=json.dumps(spec.runtime_env),
                     metadata_json=json.dumps(spec.metadata), package_uri=spec.package_uri,
                     estimate_s=estimate, state="queued", reason="",
                     submitted_at=self._clock(), started_at=None, ended_at=None, attempt=0,
                     preemptions=0, checkpoint_at=None, preempt_at=None, submit_failures=0,
                     retry_at=None,
                     workers=spec.gang.workers if spec.gang else 0,
                     placement=spec.gang.strategy if spec.gang else "")
        if not self._store.add(row):
            raise ConfigError(f"job {spec.id} is already in the queue")
        return JobView.of(row)

    def predict(self, key: str) -> float | None:
        """Predicted duration of a job from earlier runs of the same job (same job file,
        preset and arguments): the 75th percentile of their durations in MLflow (runs started
        outside the queue count), else in the queue's own record, else None."""
        durations: list[float] = []
        if self._history is not None:
            try:
                durations = self._history(key)
            except Exception as exc:  # MLflow down: predict from what the queue knows
                logger.warning("no duration history from MLflow (%s); using the queue's own",
                               redact_text(str(exc)).splitlines()[0][:200])
        durations = durations or self._store.durations(key)
        return float(np.quantile(durations, PREDICTION_QUANTILE)) if durations else None

    def cancel(self, job_id: str) -> JobView:
        """Take a queued job out (one waiting to retry its submission too), stop a started one,
        or clear one the job server refused from ``raydeck queue``.

        Raises:
            ConfigError: no such job, it has already run and ended, or the job server cannot
                stop it now (it is unreachable: the job keeps running; try again).
        """
        row = self._store.get(job_id)
        if row is None:
            raise ConfigError(f"no job {job_id!r} in the queue (`raydeck queue` lists them)")
        if row.state not in ("queued", *ACTIVE) and not _refused(row):
            raise ConfigError(f"job {job_id} has already ended ({row.state})")
        if row.state in ACTIVE:
            try:
                self._launcher.stop(row.submission_id)
            except Exception as exc:
                failure = classify(exc)
                # 404: the job server never got it (the queue stopped between recording and
                # submitting it): there is nothing to stop.
                if failure.http_status != 404:
                    raise ConfigError(f"cannot stop job {job_id} now: {failure.reason}; it "
                                      "keeps running, try again") from None
        self._store.update(job_id, state="cancelled", ended_at=self._clock(), retry_at=None,
                           reason="cancelled by raydeck cancel"
                                  + (f" (it had failed: {row.reason})" if _refused(row) else ""))
        updated = self._store.get(job_id)
        assert updated is not None
        return JobView.of(updated)

    def listing(self) -> list[Entry]:
        """Every job not ended, in start order, with why it waits and when it should start;
        then the jobs the job server refused in the last ``REFUSED_SHOWN_S`` (why: its
        reason)."""
        now = self._clock()
        rows = {r.id: r for r in self._store.jobs("queued")}
        queued = [_queued(r) for r in rows.values()]
        active = self._store.jobs(*ACTIVE)
        running = [_running(r, now) for r in active]
        free, total = self._free(active)
        ordered = self._policy.order(queued, running, now)
        predicted = self._predicted_starts(ordered, running, total, now)
        claiming = self._claiming(active, queued, now)
        entries = [Entry(JobView.of(r), None, r.started_at,
                         r.reason if r.state == "preempting" else r.state) for r in active]
        for position, job in enumerate(ordered, start=1):
            row = rows[job.id]
            if row.retry_at is not None:  # retries later
                why = row.reason
            elif row.preempted_for in rows:
                why = f"waits for {row.preempted_for} to start (it was preempted for it)"
            else:
                why = self._why(job, ordered, running, free, claiming)
            if rows[job.id].preemptions:
                why += f" (preempted {rows[job.id].preemptions}x; resumes from its checkpoint)"
            entries.append(Entry(JobView.of(rows[job.id]), position, predicted.get(job.id), why))
        entries += [Entry(JobView.of(r), None, None, r.reason) for r in self._store.jobs("failed")
                    if _refused(r) and r.ended_at is not None
                    and now - r.ended_at < REFUSED_SHOWN_S]
        return entries

    def _why(self, job: QueuedJob, ordered: list[QueuedJob], running: list[RunningJob],
             free: Capacity, claiming: list[QueuedJob]) -> str:
        team = self.teams().get(job.team)
        if team is not None and team.quota is not None:
            used = team_usage(job.team, running)
            if not team.quota.fits(used + job.needs):
                return (f"needs {job.needs.describe()}; team {job.team} uses {used.describe()} "
                        f"of its {team.quota.describe()}")
        if not free.pool.fits(job.needs):
            return (f"needs {job.needs.describe()}; {free.pool.gpus:g} GPU, "
                    f"{free.pool.cpus:g} CPU free")
        if not free.fits(job) and job.gang is not None:
            return (f"needs {job.gang.describe()}: fits the free total, but no node "
                    f"placement holds it now ({free.describe_nodes()} free)")
        ahead = ordered[:ordered.index(job)]
        if ahead:
            return f"behind {ahead[0].id} ({self._policy.name} order)"
        if _held_back(job, claiming):
            return (f"waits for Ray to place {', '.join(j.id for j in claiming)} first (a "
                    "STRICT_ gang starts alone)")
        return "starts at the next tick"

    def _predicted_starts(self, ordered: list[QueuedJob], running: list[RunningJob],
                          total: Resources, now: float) -> dict[str, float]:
        """When each queued job should start: the policy replayed with running jobs ending
        at their estimates and no new arrivals."""
        from raydeck.scheduling.simulator import TraceJob, simulate

        ahead = [TraceJob(r.job.id, now, max(r.expected_end_s - now, 0.0), r.job.needs,
                          r.job.team, 0) for r in running]
        trace = ahead + [TraceJob(j.id, j.submitted_s, j.estimate_s, j.needs, j.team,
                                  j.priority, j.estimate_s) for j in ordered]
        try:
            schedule = simulate(trace, _fresh(self._policy), total, pinned=[a.id for a in ahead])
        except ConfigError:
            return {}
        return {s.job.id: max(s.start_s, now) for s in schedule if s.job.id not in
                {a.id for a in ahead}}

    # --- what a queued job tells the queue ----------------------------------------------------
    def checkpointed(self, job_id: str) -> bool:
        """A started job committed a checkpoint now (it can be preempted from here on).

        Returns:
            Whether the queue asks it to stop there (it is ``preempting``).
        """
        row = self._store.get(job_id)
        if row is None or row.state not in ACTIVE:
            return False
        self._store.update(job_id, checkpoint_at=self._clock())
        return row.state == "preempting"

    def preempted(self, job_id: str) -> int | None:
        """Which preemption of ``job_id`` stopped it (1 for the first): it was told so at a
        checkpoint it committed after being asked. None if it was not (it may have finished
        first)."""
        row = self._store.get(job_id)
        return row.preemptions + 1 if row is not None and _told(row) else None

    def completed(self, job_id: str) -> None:
        """The job's driver saw training run to its end (not stopped for the queue): a job
        that was told to stop and still ends SUCCEEDED is requeued unless it said this."""
        row = self._store.get(job_id)
        if row is not None and row.state in ACTIVE:
            self._store.update(job_id, completed_at=self._clock())

    # --- the loop ----------------------------------------------------------------------------
    def tick(self) -> list[str]:
        """Reconcile started jobs with the job server, then start what the policy says.

        Returns:
            Ids of the jobs started in this tick.
        """
        now = self._clock()
        for row in self._store.jobs(*ACTIVE):
            try:
                self._reconcile(row, now)
            except Exception as exc:
                # One job's status (the job server briefly unreachable) never holds up the
                # others or what starts next: it is read again at the next tick.
                logger.warning("cannot reconcile job %s now: %s", row.id, classify(exc).reason)
        try:
            return self._schedule(now)
        finally:
            counts: dict[tuple[str, str], int] = {}
            for row in self._store.jobs("queued", *ACTIVE):
                state = "queued" if row.state == "queued" else "running"
                counts[(row.team, state)] = counts.get((row.team, state), 0) + 1
            self._observer.counts(counts)

    def _schedule(self, now: float) -> list[str]:
        """Start what the policy says, then ask the policy's victims to stop at their next
        checkpoint for the first job that still cannot start (jobs already stopping count as
        gone, so one waiting job never takes more victims than it needs). One read of the
        queue and of the cluster's resources per tick."""
        # A job waiting out a transient submission failure is not a candidate until its time.
        queued_rows = self._store.jobs("queued")
        queued = [_queued(r) for r in queued_rows if r.retry_at is None or r.retry_at <= now]
        if not queued:
            return []
        active = self._store.jobs(*ACTIVE)
        # Victims stay behind the job they were preempted for while it is queued.
        preempted_for = rules.held_back({r.id: r.preempted_for for r in [*queued_rows, *active]},
                                        {r.id for r in queued_rows})
        running = [_running(r, now) for r in active]
        free, total = self._free(active)
        claiming = self._claiming(active, queued, now)
        started: list[str] = []
        unstarted: set[str] = set()  # refused, or retried at a later tick
        deciding = True
        while deciding:
            deciding = False
            candidates = [j for j in queued if j.id not in started and j.id not in unstarted]
            for job in rules.decide(self._policy, candidates, running, free, total, now,
                                    preempted_for):
                if _held_back(job, claiming):
                    break  # Ray places the claiming jobs first; the rest starts at a later tick
                chosen = self._store.get(job.id)
                if chosen is None or chosen.state != "queued":
                    continue  # cancelled meanwhile
                # Recorded before submitting: a queue that dies here resubmits under the same
                # id, which the job server refuses if the first submission got through.
                self._store.update(job.id, state="starting", started_at=now, preempted_for="")
                if not self._start(chosen, now):
                    # What it would have held is still free: the policy decides again without
                    # it, so the jobs behind a bad one start in this same tick.
                    unstarted.add(job.id)
                    deciding = True
                    break
                self._observer.started(chosen, now)
                started.append(job.id)
                running.append(RunningJob(job, now))
                claiming.append(job)
                left = free.after(job)
                assert left is not None, "the policy placed it on this same capacity"
                free = left
        stopping = {r.id for r in active if r.state == "preempting"}
        pool = free.pool
        for row in active:
            if row.id in stopping:
                pool = pool + Resources(row.cpus, row.gpus)
        waiting = [job for job in queued if job.id not in started and job.id not in unstarted]
        decision = rules.preempt(self._policy, [j for j in waiting if j.id not in preempted_for],
                                 [r for r in running if r.job.id not in stopping], pool, now)
        if decision is None:
            return started
        for victim in decision.victims:
            self._store.update(victim.job.id, state="preempting", preempt_at=now,
                               preempted_for=decision.job.id,
                               reason=f"preempted for {decision.job.id} (priority "
                                      f"{decision.job.priority}): stops at its next checkpoint")
            asked = self._store.get(victim.job.id)
            assert asked is not None
            self._observer.preempted(asked, now)
            logger.info("preempting %s for %s", victim.job.id, decision.job.id)
        return started

    def _start(self, row: JobRow, now: float) -> bool:
        """Submit ``row`` (recorded ``starting``); whether it was. A failure is classified
        (:func:`~raydeck.scheduling.failures.classify`) and recorded on this job alone: a
        permanent one fails it with the reason, a transient one puts it back in the queue (its
        place and submission id kept: a submission that did get through is refused as a
        duplicate next time and counts as started) to be tried again after a backoff."""
        try:
            self._launcher.submit(row, self._store.package(row.package_uri)
                                  if row.package_uri else None)
        except Exception as exc:
            failure = classify(exc)
            if failure.permanent:
                self._store.update(row.id, state="failed", started_at=None, ended_at=now,
                                   retry_at=None, reason=f"not started: {failure.reason}")
                logger.error("job %s was refused: %s", row.id, failure.reason)
                return False
            failures = row.submit_failures + 1
            retry_at = now + self._backoff.delay_s(failures)
            self._store.update(
                row.id, state="queued", started_at=None, submit_failures=failures,
                retry_at=retry_at,
                reason=f"submission failed {failures}x ({failure.reason}); retried at "
                       f"{time.strftime('%H:%M:%S', time.localtime(retry_at))}")
            logger.warning("job %s: submission failed (%s); retrying in %.0f s", row.id,
                           failure.reason, retry_at - now)
            return False
        if row.submit_failures or row.retry_at is not None:
            self._store.update(row.id, submit_failures=0, retry_at=None, reason="")
        return True

    def _reconcile(self, row: JobRow, now: float) -> None:
        status = self._launcher.status(row.submission_id)
        if status is None:
            if row.state == "starting":
                self._start(row, now)  # the queue stopped between recording and submitting
            else:
                # The job server forgot a job it ran: the head restarted (Ray keeps its jobs
                # in the head's GCS) and the job died with it.
                self._requeue(row, now, "lost when the cluster's head restarted")
            return
        if row.state == "preempting" and status in TERMINAL and (
                status != "SUCCEEDED" or (_told(row) and row.completed_at is None)):
            # Stopped at its checkpoint (or by the job server after the grace period). A job
            # told to stop whose driver still exited 0 without saying training ran to its end
            # stopped there too: its run resumes rather than being taken as finished.
            self._requeue(row, now, "preempted", preempted=True)
            return
        if row.state == "preempting" and row.preempt_at is not None \
                and now - row.preempt_at > PREEMPT_GRACE_S and status not in TERMINAL:
            logger.warning("job %s did not stop within %.0f s of its preemption; stopping it "
                           "(it resumes from its last checkpoint)", row.id, PREEMPT_GRACE_S)
            self._launcher.stop(row.submission_id)
            return
        if status in TERMINAL:
            self._store.update(row.id, state=TERMINAL[status], ended_at=now)
            self._policy.ended(_running(row, now), now)
            self._observer.ended(row, now)
        elif row.state == "starting":
            self._store.update(row.id, state="running")

    def _requeue(self, row: JobRow, now: float, why: str, preempted: bool = False) -> None:
        """Put a started job back in the queue, its place kept (same submission time); its
        next attempt is a new job-server job with the same run id, so it resumes from its last
        checkpoint in its MLflow run."""
        self._store.update(row.id, state="queued", attempt=row.attempt + 1,
                           preemptions=row.preemptions + int(preempted), started_at=None,
                           preempt_at=None, checkpoint_at=None, completed_at=None,
                           reason=f"{why}; resumes from its checkpoint")
        self._policy.ended(_running(row, now), now)
        logger.info("job %s is back in the queue: %s", row.id, why)

    def _free(self, active: list[JobRow]) -> tuple[Capacity, Resources]:
        """Free (per node, and a pool) and total resources, ``active`` being the queue's
        started jobs."""
        free_nodes, total_nodes = self._launcher.resources()
        available, total = Resources.total(free_nodes), Resources.total(total_nodes)
        held = Resources()
        for row in active:
            held = held + Resources(row.cpus, row.gpus)
        by_reservation = total - held
        pool = Resources(min(available.cpus, by_reservation.cpus),
                         min(available.gpus, by_reservation.gpus))
        return Capacity(pool, free_nodes), total

    def _claiming(self, active: list[JobRow], queued: list[QueuedJob], now: float
                  ) -> list[QueuedJob]:
        """The jobs started less than ``CLAIM_S`` ago that Ray has not placed yet; asked only
        when a strict gang is queued or among them (no other start depends on it)."""
        recent = [r for r in active
                  if r.started_at is not None and now - r.started_at < CLAIM_S]
        if not any(map(_strict, [*queued, *map(_queued, recent)])):
            return []
        return [_queued(r) for r in recent if not self._launcher.placed(r.submission_id)]


def _queued(row: JobRow) -> QueuedJob:
    gang = (Gang(row.workers, Resources(row.cpus / row.workers, row.gpus / row.workers),
                 row.placement) if row.workers else None)
    return QueuedJob(row.id, row.team, row.priority, Resources(row.cpus, row.gpus),
                     row.submitted_at, row.estimate_s, gang)


def _refused(row: JobRow) -> bool:
    """A job that failed without ever starting (the job server refused its submission)."""
    return row.state == "failed" and row.started_at is None


def _strict(job: QueuedJob) -> bool:
    """A gang whose placement depends on which nodes Ray chose for the jobs beside it."""
    return job.gang is not None and job.gang.strategy.startswith("STRICT_")


def _held_back(job: QueuedJob, claiming: list[QueuedJob]) -> bool:
    """Whether ``job`` waits for Ray to place the ``claiming`` jobs: a strict gang starts
    alone (see the module docs)."""
    return any(map(_strict, claiming)) or (bool(claiming) and _strict(job))


def _running(row: JobRow, now: float) -> RunningJob:
    return RunningJob(_queued(row), row.started_at or now, row.checkpoint_at,
                      resumed=row.preemptions > 0)


def _told(row: JobRow) -> bool:
    """Whether ``row`` was told to stop: asked (``preempting``), then it committed a
    checkpoint, where the queue's answer was recorded before the job got it."""
    return (row.state == "preempting" and row.preempt_at is not None
            and row.checkpoint_at is not None and row.checkpoint_at >= row.preempt_at)


def _fresh(policy: Policy) -> Policy:
    """A copy to simulate with, so predictions never charge the live policy's usage."""
    import copy

    return copy.deepcopy(policy)

