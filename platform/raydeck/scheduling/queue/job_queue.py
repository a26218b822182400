"""The job queue: policies applied to real jobs, with durable state, in front of a job server.

Owns: :class:`JobQueue` (submit, cancel, reprioritize, list with the reason each job waits and
its predicted start, and :meth:`JobQueue.tick`, which reconciles the jobs it started with the
job server and starts what the policy says). Who may submit, cancel, reprioritize and configure
is :mod:`raydeck.scheduling.queue.access`'s rule, applied here and by
:mod:`~raydeck.scheduling.queue.job_changes` (cancel, reprioritize). The job server is behind the
small :class:`~raydeck.scheduling.queue.launcher.Launcher` interface
(:mod:`raydeck.scheduling.queue.ray_jobs` is Ray's), so the queue's logic is the same in tests and
on a cluster. Does not own: what a job and a team are (:mod:`raydeck.scheduling.queue.jobspec`), the
listing's explanations (:mod:`raydeck.scheduling.queue.listing`), the Ray actor that hosts it
(:mod:`raydeck.scheduling.queue.actor`), the policies (:mod:`raydeck.scheduling.policies.core`) or
the job's side of preemption (:mod:`raydeck.tracking.client.preemption`).

Concurrency: the queue's lock is held only to read, decide and write its state (the store and
the policy), never across a call to the job server or MLflow. A tick reads the job server's
answers first and applies them under the lock; a job is recorded ``starting`` under the lock
and submitted outside it; a submission predicts the job's duration (MLflow) before taking it.
So a slow job server or MLflow delays only the call that waits on it: ``raydeck queue`` and a
job's checkpoint call answer meanwhile. Ticks run one at a time.

Ids: an id the job server already has (a job started outside the queue) is refused at
submission, not adopted; the id of a queued job that ended may be queued again (it runs as
``<id>-r<N>``). Ended jobs are deleted ``RETENTION_S`` after they ended (docs/scheduling.md).

Preemption: when the policy names victims for a job that cannot start, each becomes
``preempting``; the job learns it when it next commits a checkpoint
(:mod:`raydeck.tracking.client.preemption`), stops there and exits; the queue puts it back in the
queue (same submission time, but behind the job it was stopped for, and not stopped again
before it commits a new checkpoint: :mod:`raydeck.scheduling.policies.preemption`) and later
starts it again as a new job-server job (``<id>-r<N>``) with the same MLflow run id, so it
resumes from that checkpoint in its run. A job told to stop that still ends SUCCEEDED without
its driver saying training ran to its end (:meth:`JobQueue.completed`) is requeued the same
way. A job still running ``PREEMPT_GRACE_S`` after being asked is stopped by the job server
and requeued the same way (it loses the work since its last checkpoint), and so is a started
job the job server no longer knows (the head restarted), unless the job's own witness says it
finished (:mod:`raydeck.scheduling.queue.witness`): then it is recorded ``succeeded``, run once.

Elastic jobs (an elastic preset's gang; :mod:`raydeck.scheduling.queue.resizing`): admitted and
queued at their minimum, started at the largest size that fits when no waiting job could use the
room. For the first waiting job that does not fit, elastic jobs are asked to shrink before any
job is preempted, and they are asked to grow into room no waiting job can use; either way the job
stops at its next checkpoint (as a victim does) and is relaunched at once at its new size
(``<id>-r<N>``, same run). Each job's allowed size is in its row and reaches it as
``RAYDECK_QUEUE_WORKERS``. A growth its job does not reach at a checkpoint within
``PREEMPT_GRACE_S`` is dropped (nothing waits on it), not forced. Each Serve deployment that
autoscales is an elastic job of its own (:mod:`raydeck.scheduling.queue.serve_apps`): the queue
lowers its ``max_replicas`` toward its minimum before any job is preempted and raises it when room
returns; Serve's autoscaler decides the count within it.

A job whose submission fails never holds up the queue (:mod:`raydeck.scheduling.queue.submission`):
the jobs behind it start in the same tick.

Resources a queued job may use are the smaller of what the cluster has free now (jobs started
outside the queue count) and the total minus what the queue's active jobs hold (a job that has
just started may not have claimed its resources yet); a job with a preset starts only when its
whole gang can be placed on what each node has free
(:class:`~raydeck.scheduling.policies.core.Gang`).

Strict gangs start alone, since Ray, not the queue, chooses each worker's node
(:func:`~raydeck.scheduling.queue.reconcile.claiming` says why and how long).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from raydeck.errors import ConfigError
from raydeck.scheduling.policies import preemption as rules
from raydeck.scheduling.policies.core import Capacity, QueuedJob, Resources, RunningJob
from raydeck.scheduling.queue import access, attempts, job_changes, reconcile, resizing
from raydeck.scheduling.queue.config_change import ConfigChange
from raydeck.scheduling.queue.configuration import QueueConfig
from raydeck.scheduling.queue.failures import Backoff, classify
from raydeck.scheduling.queue.history import CachedHistory, predict
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.job_changes import JobChanges
from raydeck.scheduling.queue.job_view import JobView
from raydeck.scheduling.queue.jobspec import JobSpec, TeamsFile, admit
from raydeck.scheduling.queue.launcher import JobState, Launcher, Observer
from raydeck.scheduling.queue.listing import Entry, explain, held_back, predicted_starts
from raydeck.scheduling.queue.reconcile import PREEMPT_GRACE_S, free_capacity, verdict
from raydeck.scheduling.queue.reconcile import queued as _queued
from raydeck.scheduling.queue.reconcile import refused as _refused
from raydeck.scheduling.queue.reconcile import running as _running
from raydeck.scheduling.queue.reconcile import told as _told
from raydeck.scheduling.queue.serve_apps import NoServe, ServeApp, ServeApps
from raydeck.scheduling.queue.store import ACTIVE, ENDED, JobRow, Store, queued_row
from raydeck.scheduling.queue.submission import Outcome, Submitter
from raydeck.scheduling.queue.witness import RunFinished

logger = logging.getLogger(__name__)

DEFAULT_ESTIMATE_S = 3600.0
# How long ``raydeck queue`` keeps showing a job the job server refused (it never started).
REFUSED_SHOWN_S = 24 * 3600.0
# How long an ended job (and the working-dir package only it used) stays in the queue's
# database: its row is the queue's own duration history and ``raydeck jobs``' refused list.
RETENTION_S = 7 * 24 * 3600.0
# How often a tick deletes what is past retention (and the first tick always does).
PRUNE_EVERY_S = 3600.0
class JobQueue:
    """The queue's logic over a :class:`Store` and a :class:`Launcher` (see module docs).
    Thread-safe: clients call it while its tick runs."""

    def __init__(self, store: Store, launcher: Launcher,
                 clock: Callable[[], float] = time.time,
                 observer: Observer | None = None,
                 history: Callable[[str], list[float]] | None = None,
                 backoff: Backoff | None = None,
                 run_finished: RunFinished | None = None,
                 cluster: Callable[[], list[float]] | None = None,
                 serve: ServeApps | None = None,
                 admins: access.AdminsFile | None = None) -> None:
        """``history(key)``: how long earlier runs of the job with that key took, newest first
        (MLflow's: :class:`raydeck.scheduling.queue.history.MlflowHistory`); the queue's own record
        of the jobs it ran is used when it has none or fails. It is called without the queue's
        lock, so it may be slow. ``backoff``: when a job whose submission failed transiently is
        tried again. ``launcher``: its calls should be bounded
        (:class:`~raydeck.scheduling.queue.launcher.TimedLauncher`); the queue never holds its lock
        while one runs. ``run_finished``: whether a job's MLflow run ended FINISHED
        (:class:`~raydeck.scheduling.queue.witness.MlflowRuns`), asked without the lock before a job
        the job server forgot is run again. ``cluster()``: any job's earlier durations
        (:meth:`~raydeck.scheduling.queue.history.MlflowHistory.cluster`), for ``gittins``.
        ``serve``: the cluster's Serve deployments, elastic jobs of their own
        (:mod:`raydeck.scheduling.queue.serve_apps`; read and bounded without the lock).
        ``admins``: the head's file naming the queue's admins (None: it has none)."""
        self._store = store
        self._run_finished = run_finished
        self._backoff = backoff or Backoff()
        self._launcher = launcher
        self._serve = serve or NoServe()
        self._history = CachedHistory(history, cluster)  # read by gittins under the lock
        self._clock = clock
        self._observer = observer or Observer()
        # The store's read-decide-write sequences and the policy's state; never held across
        # a call to the job server or MLflow.
        self._lock = threading.RLock()
        self._ticking = threading.Lock()  # one tick at a time
        self._pruned_at: float | None = None
        self._submitter = Submitter(store, launcher, self._backoff, self._lock)
        self._changes = JobChanges(store, launcher, self._lock, clock)
        self._config = QueueConfig(store, clock, self._history, admins)
        self._policy = self._config.policy()
        self._min_run_s = self._config.min_run_s()

    # --- configuration ---------------------------------------------------------------------
    def teams_file(self) -> TeamsFile:
        return self._config.teams_file()

    def policy_name(self) -> str:
        return self._config.policy_name()

    def describe(self) -> str:
        """The settings in words (:meth:`QueueConfig.describe`)."""
        return self._config.describe()

    def configure(self, who: Identity, policy: str | None = None, aging_s: float | None = None,
                  teams: Mapping[str, Any] | None = None,
                  thresholds_s: Sequence[float] | None = None,
                  min_run_s: float | None = None) -> str:
        """Change the settings as ``who``, an admin: the policy, its aging bound, the teams
        file, ``las``' thresholds, the minimum run between preemptions
        (:class:`~raydeck.scheduling.queue.configuration.ConfigChange`; None leaves one as it is);
        returns the policy's name.

        Raises:
            ConfigError: a bad value (:class:`ConfigChange`) or ``who`` is not an admin;
                nothing is changed.
        """
        change = ConfigChange(policy, aging_s, teams, thresholds_s, min_run_s)
        with self._lock:
            self._config.change(who, change)
            self._policy = self._config.policy()
            self._min_run_s = self._config.min_run_s()
        return self.policy_name()

    # --- clients -----------------------------------------------------------------------------
    def submit(self, spec: JobSpec, package: bytes | None = None) -> JobView:
        """Queue a job (nothing is queued when it is refused). An id whose job ended is queued
        again under a new submission id (see module docs).

        Raises:
            ConfigError: unknown team, a job larger than the cluster or its team's quota, an
                id already queued, or one the job server already has; a submitter who is not
                a member of the team, or a priority over its bound (:mod:`.access`).
        """
        _, nodes = self._resources()
        teams = self.teams_file()
        admit(spec, teams.teams, nodes)
        access.check_submit(spec.submitter, spec, teams)
        previous = self._store.get(spec.id)
        if previous is not None and previous.state not in ENDED:
            raise ConfigError(f"job {spec.id} is already in the queue ({previous.state}); "
                              f"`raydeck cancel {spec.id}` takes it out")
        attempt = self._submitter.free_attempt(
            spec.id, previous.attempt + 1 if previous is not None else 0)
        # History beats a guess: the user's estimate counts only for a job never run before.
        estimate = self.predict(spec.key) or spec.estimate_s or DEFAULT_ESTIMATE_S
        row = queued_row(spec, estimate, self._clock(), attempt)
        with self._lock:
            if package is not None and spec.package_uri:
                self._store.add_package(spec.package_uri, package)
            if not self._store.add(row, replacing=previous.attempt if previous else None):
                raise ConfigError(f"job {spec.id} was queued meanwhile by another submission")
        return JobView.of(row)

    def predict(self, key: str) -> float | None:
        """The job's predicted duration (:func:`~raydeck.scheduling.queue.history.predict`); called
        without the queue's lock."""
        return predict(self._history, self._store.durations, key)

    def cancel(self, job_id: str, who: Identity) -> JobView:
        """As ``who``: take a job out of the queue or stop it
        (:meth:`~raydeck.scheduling.queue.job_changes.JobChanges.cancel`)."""
        return self._changes.cancel(job_id, who, self.teams_file())

    def reprioritize(self, job_id: str, priority: int, who: Identity) -> JobView:
        """As ``who``: give a job not yet ended a new priority
        (:meth:`~raydeck.scheduling.queue.job_changes.JobChanges.reprioritize`)."""
        return self._changes.reprioritize(job_id, priority, who, self.teams_file())

    def _job(self, job_id: str) -> JobRow:
        return job_changes.job(self._store, job_id)

    def listing(self, ended: bool = False) -> list[Entry]:
        """Every job not ended, in start order, with why it waits and when it should start;
        then the jobs the job server refused in the last ``REFUSED_SHOWN_S`` (why: its
        reason); with ``ended``, every job that ended within ``RETENTION_S`` instead (how it
        ended: cancelled, its exit code and its log's last line), oldest first."""
        now = self._clock()
        rows = {r.id: r for r in self._store.jobs("queued")}
        queued = [_queued(r) for r in rows.values()]
        active = self._store.jobs(*ACTIVE)
        running = [_running(r, now) for r in active]
        apps = self._serve.read()
        free, total = self._free(active, apps)
        claiming = reconcile.claiming(active, queued, now, self._launcher.placed)
        with self._lock:
            ordered = self._policy.order(queued, running, now)
            policy = copy.deepcopy(self._policy)  # read without the lock below
        predicted = predicted_starts(policy, ordered, running, total, now)
        entries = explain(rows, ordered, active, running, free, claiming, self._config.teams(),
                          policy, predicted, now)
        entries += [Entry(app.view(now), None, None, app.why()) for app in apps]
        shown = self._store.ended_since(now - (RETENTION_S if ended else REFUSED_SHOWN_S))
        entries += [Entry(JobView.of(r), None, None, r.reason) for r in shown
                    if ended or _refused(r)]
        return entries

    # --- what a queued job tells the queue ----------------------------------------------------
    # Each carries the token of the attempt that calls (RAYDECK_QUEUE_TOKEN in its runtime
    # env): only the current attempt reports its checkpoints, its stop and its completion.
    def checkpointed(self, job_id: str, token: str) -> bool:
        """The attempt of a started job holding ``token`` committed a checkpoint now (it can be
        preempted from here on).

        Returns:
            Whether the queue asks it to stop there: it is ``preempting``, or ``token`` is not
            the current attempt's (an attempt the queue no longer runs, or a process that is
            not the job's; nothing is recorded).
        """
        with self._lock:
            row = self._store.get(job_id)
            if row is None:
                return False
            if not access.is_current_attempt(row, token):
                logger.warning("job %s: a checkpoint reported without the token of its current "
                               "attempt %s; told to stop, nothing recorded", job_id,
                               row.submission_id)
                return True
            if row.state not in ACTIVE:
                # An attempt of a job that ended (cancelled while its submission landed) stops;
                # one of a queued job whose lost submission landed goes on (the next tick
                # adopts it as started).
                return row.state in ENDED
            now = self._clock()
            stop = row.state == "preempting"
            self._store.update(job_id, checkpoint_at=now, **({"told_at": now} if stop else {}))
            return stop

    def preempted(self, job_id: str, token: str) -> int | None:
        """Which of ``job_id``'s stops for the queue (preemptions and elastic resizes) this is
        (1 for the first): it was told so at a checkpoint it committed after being asked. None
        if it was not (it may have finished first).

        Raises:
            ConfigError: ``token`` is not the current attempt's.
        """
        with self._lock:
            row = self._store.get(job_id)
            if row is None:
                return None
            access.check_attempt(row, token, "preempted")
            return row.preemptions + row.resizes + 1 if _told(row) else None

    def completed(self, job_id: str, token: str) -> None:
        """The job's driver saw training run to its end (not stopped for the queue): a job
        that was told to stop and still ends SUCCEEDED is requeued unless it said this, and a
        job the job server forgot counts as finished (:mod:`.witness`).

        Raises:
            ConfigError: ``token`` is not the current attempt's (nothing is recorded).
        """
        with self._lock:
            row = self._store.get(job_id)
            if row is None:
                return
            access.check_attempt(row, token, "completed")
            if row.state in ACTIVE:
                self._store.update(job_id, completed_at=self._clock())

    # --- the loop ----------------------------------------------------------------------------
    def tick(self) -> list[str]:
        """Delete what is past retention (hourly), reconcile started jobs with the job server,
        then start what the policy says.

        Returns:
            Ids of the jobs started in this tick.
        """
        with self._ticking:
            now = self._clock()
            self._prune(now)
            seen = attempts.read(self._store, self._launcher, self._run_finished, now)
            if seen is not None:
                with self._lock:
                    for row in seen.adopt:
                        self._adopt(row, now)
                attempts.stop(self._launcher, seen.orphans)
                for row, state, finished, tail in seen.active:
                    try:
                        self._reconcile(row, state, finished, tail, now)
                    except Exception as exc:
                        # One job (the job server briefly unreachable) never holds up the
                        # others or what starts next: it is read again at the next tick.
                        logger.warning("cannot reconcile job %s now: %s", row.id,
                                       classify(exc).reason)
            try:
                return self._schedule(now)
            finally:
                counts: dict[tuple[str, str], int] = {}
                for row in self._store.jobs("queued", *ACTIVE):
                    kind = "queued" if row.state == "queued" else "running"
                    counts[(row.team, kind)] = counts.get((row.team, kind), 0) + 1
                self._observer.counts(counts)

    def _prune(self, now: float) -> None:
        if self._pruned_at is not None and now - self._pruned_at < PRUNE_EVERY_S:
            return
        self._pruned_at = now
        with self._lock:
            jobs, packages = self._store.prune(now - RETENTION_S)
        if jobs or packages:
            logger.info("deleted %d job(s) ended over %.0f days ago and %d unused package(s)",
                        jobs, RETENTION_S / 86400, packages)

    def _adopt(self, row: JobRow, now: float) -> None:
        """Queued ``row``'s submission, whose answer was lost, reached the job server: it is
        started (its next reconcile reads how it runs), never submitted a second time."""
        current = self._store.get(row.id)
        if current is None or current.state != "queued" or current.attempt != row.attempt:
            return
        self._store.update(row.id, state="starting", started_at=now, accepted_at=now,
                           submit_failures=0, retry_at=None, reason="")
        logger.info("job %s: its submission reached the job server after all", row.id)

    def _reconcile(self, row: JobRow, state: JobState | None, finished: str, tail: str,
                   now: float) -> None:
        """Apply the job server's ``state`` of the job, the witness's ``finished`` and a failed
        job's log ``tail`` (read without the lock) to ``row``, unless the job changed meanwhile
        (cancelled, or requeued)."""
        with self._lock:
            current = self._store.get(row.id)
            if current is None or current.state not in ACTIVE or current.attempt != row.attempt:
                return
            decided = verdict(current, state, now, finished)
            if decided.action == "relaunch":
                current = self._relaunch(current, now, decided.why)
            elif decided.action == "keep":
                # Not asked again before its next checkpoint (it may not be a victim either
                # until then: it would not stop sooner).
                self._store.update(row.id, state="running", resize_to=0, preempt_at=None,
                                   told_at=None,
                                   checkpoint_at=None, reason=decided.why)
            elif decided.action == "requeue":
                self._requeue(current, now, decided.why, decided.preempted)
            elif decided.action == "end":
                last = tail.splitlines()[-1] if tail else ""
                why = f"{decided.why}; its log ends: {last}" if last else decided.why
                self._store.update(row.id, state=decided.state, ended_at=now, log_tail=tail,
                                   exit_code=None if state is None else state.exit_code,
                                   attained_s=reconcile.attained(current, now),
                                   **({"reason": why} if why else {}))
                self._policy.ended(_running(current, now), now)
                self._policy.finished(_running(current, now), now)
                self._observer.ended(current, now)
            elif decided.action == "running":
                self._store.update(row.id, state="running")
        if decided.action in ("resubmit", "relaunch"):
            # resubmit: recorded, then the queue stopped; relaunch: at its new size, at once.
            self._submitter.start(current, now)
        elif decided.action == "stop":
            logger.warning("job %s did not stop within %.0f s of its preemption; stopping it "
                           "(it resumes from its last checkpoint)", row.id, PREEMPT_GRACE_S)
            with self._lock:  # recorded first: its STOPPED end is then the queue's doing
                self._store.update(row.id, stopped_at=now)
            self._launcher.stop(current.submission_id)

    def _schedule(self, now: float) -> list[str]:
        """Start what the policy says (an elastic job at the size :func:`~raydeck.scheduling.
        resizing.start_sizes` gives it), then make room for the first job that still cannot
        start, or grow elastic jobs into room no job can use (:meth:`_make_room`). One read of
        the queue and of the cluster's resources per tick; each submission outside the lock."""
        # A job waiting out a transient submission failure is not a candidate until its time.
        queued_rows = self._store.jobs("queued")
        # A submission that timed out and is still under way may land: its job holds its room
        # and is not submitted again until it returned (then the next read adopts it if it did).
        landing = self._launcher.submitting()
        queued = [_queued(r) for r in queued_rows if (r.retry_at is None or r.retry_at <= now)
                  and r.submission_id not in landing]
        active = self._store.jobs(*ACTIVE)
        preempted_for = self._held_back(queued_rows, active)
        apps = self._serve.read()
        if not queued and not any(r.workers < r.max_workers for r in active) \
                and not any(app.lowered for app in apps):
            return []  # nothing to start, and no elastic job or Serve ceiling that could grow
        if self._policy.name == "gittins":  # outside the lock: MLflow may be slow
            self._history.refresh(r.key for r in [*queued_rows, *active])
        running = [_running(r, now) for r in active]
        free, total = self._free([*active, *(r for r in queued_rows if r.submission_id in landing)],
                                 apps)
        claiming = reconcile.claiming(active, queued, now, self._launcher.placed)
        started: list[str] = []
        unstarted: set[str] = set()  # refused, or retried at a later tick
        deciding = True
        while deciding:
            deciding = False
            candidates = [j for j in queued if j.id not in started and j.id not in unstarted]
            with self._lock:
                decided = rules.decide(self._policy, candidates, running, free, total, now,
                                       preempted_for)
                sizes = resizing.start_sizes(self._policy, decided,
                                             [j for j in candidates if j not in decided],
                                             running, free, now)
            for job in decided:
                if held_back(job, claiming):
                    break  # Ray places the claiming jobs first; the rest starts at a later tick
                if job.id in sizes:
                    job = resizing.at(job, sizes[job.id])
                with self._lock:
                    chosen = self._store.get(job.id)
                    if chosen is None or chosen.state != "queued":
                        continue  # cancelled meanwhile
                    # Recorded before submitting: a queue that dies here resubmits under the
                    # same id, which the job server refuses if the first submission got through.
                    self._store.update(job.id, state="starting", started_at=now,
                                       preempted_for="", **chosen.sized(sizes.get(job.id)))
                    chosen = self._job(job.id)
                outcome = self._submitter.start(chosen, now)
                if outcome is Outcome.NOT_STARTED:
                    # What it would have held is still free: the policy decides again without
                    # it, so the jobs behind a bad one start in this same tick.
                    unstarted.add(job.id)
                    deciding = True
                    break
                if outcome is Outcome.UNKNOWN:
                    # It may have reached the job server: its room stays taken in this tick
                    # (the next tick's read adopts it if it did), the jobs behind it fit around.
                    unstarted.add(job.id)
                    free = free.after(job) or free
                    continue
                self._observer.started(chosen, now)
                started.append(job.id)
                running.append(RunningJob(job, now))
                claiming.append(job)
                left = free.after(job)
                assert left is not None, "the policy placed it on this same capacity"
                free = left
        waiting = [job for job in queued if job.id not in started and job.id not in unstarted]
        with self._lock:
            ceilings = self._make_room(waiting, preempted_for, running, free, now, apps)
        self._serve.bound(ceilings)  # Serve's API, outside the lock
        return started

    def _held_back(self, queued_rows: list[JobRow], active: list[JobRow]) -> dict[str, str]:
        """Victims stay behind the job they were preempted (or shrunk) for while it is queued
        (:func:`~raydeck.scheduling.policies.preemption.held_back`): victim -> that job. A hold
        whose job has left the queue since (started, or ended) is over for good, and is cleared
        from its row here, as the simulator drops it from its map: kept, it would come back
        when that job is queued again, and when that job was requeued as a victim of the held
        job itself (their priorities turned), each would wait for the other, neither ever
        starting (tests/scheduling/test_queue_model.py). Ticks run one at a time, and only a
        tick writes ``preempted_for``."""
        recorded = {r.id: r.preempted_for for r in [*queued_rows, *active] if r.preempted_for}
        held = rules.held_back(recorded, {r.id for r in queued_rows})
        if len(held) < len(recorded):
            with self._lock:
                for job_id in recorded.keys() - held.keys():
                    self._store.update(job_id, preempted_for="")
        return held

    def _make_room(self, waiting: list[QueuedJob], preempted_for: Mapping[str, str],
                   running: list[RunningJob], free: Capacity, now: float,
                   apps: list[ServeApp]) -> tuple[tuple[ServeApp, int], ...]:
        """Record what :func:`~raydeck.scheduling.queue.resizing.make_room` decides (under the
        lock): elastic jobs to shrink, else victims to stop, for the first of ``waiting`` that
        cannot start, each at its next checkpoint; or elastic jobs to grow at theirs. Returns
        the Serve ceilings to set (``apps``: the deployments)."""
        rows = {r.id: r for r in self._store.jobs(*ACTIVE)}
        room = resizing.make_room(self._policy, waiting, preempted_for, running, rows, free,
                                  now, self._min_run_s, apps)
        for job_id, size in room.resizes:
            why = (f"shrinks to {size} workers for {room.job.id} at its next checkpoint"
                   if room.job is not None else f"grows to {size} workers at its next checkpoint")
            self._store.update(job_id, state="preempting", preempt_at=now, resize_to=size,
                               reason=why, **({"preempted_for": room.job.id} if room.job else {}))
            logger.info("job %s %s", job_id, why)
        for victim in room.victims:
            assert room.job is not None
            self._store.update(victim, state="preempting", preempt_at=now,
                               preempted_for=room.job.id,
                               reason=f"preempted for {room.job.id} (priority "
                                      f"{room.job.priority}): stops at its next checkpoint")
            self._observer.preempted(self._job(victim), now)
            logger.info("preempting %s for %s", victim, room.job.id)
        return room.ceilings

    def _requeue(self, row: JobRow, now: float, why: str, preempted: bool = False) -> None:
        """Put a started job back in the queue, its place kept (same submission time; an
        elastic job at its minimum); its next attempt is a new job-server job with the same run
        id, so it resumes from its last checkpoint in its MLflow run."""
        self._store.update(row.id, state="queued", attempt=row.attempt + 1,
                           preemptions=row.preemptions + int(preempted), started_at=None,
                           preempt_at=None, checkpoint_at=None, completed_at=None, resize_to=0,
                           stopped_at=None, accepted_at=None, told_at=None,
                           reason=f"{why}; resumes from its checkpoint",
                           attained_s=reconcile.attained(row, now), **row.sized())
        self._policy.ended(_running(row, now), now)
        logger.info("job %s is back in the queue: %s", row.id, why)

    def _relaunch(self, row: JobRow, now: float, why: str) -> JobRow:
        """Start elastic ``row``, stopped at its checkpoint for a resize, again at once at its
        new size (recorded ``starting``, as in :meth:`_schedule`): a new job-server job with
        the same run id, resuming from that checkpoint in its MLflow run."""
        self._store.update(row.id, state="starting", attempt=row.attempt + 1,
                           resizes=row.resizes + 1, started_at=now, preempt_at=None,
                           checkpoint_at=None, completed_at=None, resize_to=0, stopped_at=None,
                           accepted_at=None, told_at=None,
                           reason=why, attained_s=reconcile.attained(row, now),
                           **row.sized(row.resize_to))
        self._policy.ended(_running(row, now), now)
        logger.info("job %s restarts at once: %s", row.id, why)
        return self._job(row.id)

    def _resources(self) -> tuple[tuple[Resources, ...], tuple[Resources, ...]]:
        """The launcher's ``resources()``; a failure as one line for the client."""
        try:
            return self._launcher.resources()
        except Exception as exc:
            raise ConfigError(f"cannot read the cluster's resources now "
                              f"({classify(exc).reason}); try again") from None

    def _free(self, active: list[JobRow], apps: list[ServeApp]) -> tuple[Capacity, Resources]:
        """Free (per node, and a pool) and total resources (:func:`free_capacity`), ``apps``
        Serve's deployments."""
        return free_capacity(*self._resources(), active,
                             Resources.total(app.holds(app.replicas) for app in apps),
                             Resources.total(app.holds(app.stopping) for app in apps))
