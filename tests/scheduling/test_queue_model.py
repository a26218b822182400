"""Issue 52: a model-based test of the queue. A Hypothesis state machine drives the real
:class:`JobQueue` and its SQLite :class:`Store` against a job server that fails on cue
(tests/fixtures/chaos_job_server.py, behind a :class:`TimedLauncher` that gives up on a call
the moment it hangs, and on no other: so an example depends on its steps alone and replays
exactly), and checks after every step what the queue guarantees.

Rules drawn at random: submissions (fixed and elastic, ids reused after they end), cancels,
reprioritizations, policy changes, a job's checkpoints (obeying the queue's "stop here" or not),
its report that training ran to its end, its driver's exit with any code, a user's ``ray job
stop``, the job server's faults (an answer lost, a timeout, busy for now, refused for good, a
hang the test releases later, down for a while, a head restart that forgets every job), a queue
actor restart (a new :class:`JobQueue` on the same database and job server), the clock
advancing, ticks, and ``settle``: the faults cleared and every job cooperating for a bounded
number of ticks.

Invariants, after every step:

- agreement: every attempt the job server runs is the current attempt of a job the queue has
  started (or whose submission's answer was lost), so at most one attempt of a job runs and a
  cancelled or ended job has none; the node's capacity is not oversubscribed. A fault may make
  the two disagree for a while, never past the next tick in which no fault fired (a clean
  tick); and a cancel that returned has stopped every attempt of the job it knew of;
- outcomes: an ended job's recorded state and exit code are the job server's; an attempt the
  queue moved past (requeued as preempted, or relaunched at a new size) exited with the
  preempted code 75, was stopped by the queue, or exited 0 after being told to stop without
  reporting that training ran to its end (or died with the head);
- an attempt that is not its job's current one is told to stop at each checkpoint, and its
  report that training ran to its end is not recorded;
- no submission id is ever accepted twice by the job server, across head restarts too;
- under ``las`` and ``gittins``, a job's attained service (``raydeck queue``'s column) never
  decreases;
- liveness, in ``settle``: a job victims were stopped for, and under ``priority`` the queued job
  of strictly the highest priority, starts within ``SETTLE_ROUNDS`` cooperative ticks.

Profiles: ``HYPOTHESIS_PROFILE=ci`` (the default: derandomized, 30 examples of 50 steps, about
10 s) and ``HYPOTHESIS_PROFILE=soak`` (random, 2000 examples of 80 steps, shrunk; by hand:
``HYPOTHESIS_PROFILE=soak .venv/bin/pytest tests/scheduling/test_queue_model.py -p no:randomly
-n 0``). Each failure the model found has a test of its own, its steps shrunk by hand.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from raydeck._internal.contract import PREEMPTED_EXIT_CODE
from raydeck.errors import ConfigError
from raydeck.scheduling.policies.resources import Gang, Resources
from raydeck.scheduling.queue.failures import Backoff
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.job_queue import JobQueue, JobSpec
from raydeck.scheduling.queue.launcher import TimedLauncher
from raydeck.scheduling.queue.store import ACTIVE, ENDED, JobRow, Store, submission_id
from tests.fixtures.chaos_job_server import CALLS, MODES, NODE_CPUS, ChaosJobServer, Record

# ci: the same examples every run, not shrunk (a failure prints its steps at once; the soak
# profile shrinks, and each failure found so far has a test of its own below).
settings.register_profile(
    "ci", max_examples=30, stateful_step_count=50, deadline=None, derandomize=True,
    database=None, phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "soak", max_examples=2000, stateful_step_count=80, deadline=None, database=None,
    print_blob=True, suppress_health_check=[HealthCheck.too_slow])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
TIMEOUT_S = {"ci": 120}.get(PROFILE, 6 * 3600)

ADMIN = Identity("ana", "laptop")
JOB_IDS = ("a", "b", "c")
POLICIES = ("fifo", "priority", "las", "gittins", "fairshare")
ATTAINED_SERVICE = ("las", "gittins")  # the policies raydeck queue shows the service of
# The queue's bound on a job-server call, as its messages say it; the chaos job server ends the
# wait itself (ChaosJobServer.await_answer): at once for a hang, never for any other call.
CALL_BOUND_S = 1.0
MAX_HANGS = 2
# How an attempt ends: its driver's exit code, a user's ``ray job stop``, or training done.
ENDS: tuple[int | str, ...] = (0, 1, 2, PREEMPTED_EXIT_CODE, 137, "stop", "completed")
# Each injected fault of each call, the job server going down and coming back, its head
# restarting, and blocked calls released.
FAULTS = ([(call, mode) for call in CALLS for mode in MODES[call]]
          + [("down", "yes"), ("down", "no"), ("head", "restart"), ("release", "all")])
# Aging out of the way: the liveness rule's "highest priority first" holds for days.
AGING_S = 30 * 86400.0
SETTLE_ROUNDS = 12
SETTLE_STEP_S = 120.0
HOUR = 3600.0


def _spec(job_id: str, cpus: int, priority: int, elastic: bool) -> JobSpec:
    """A job of ``cpus`` CPUs: a fixed one, or an elastic gang of 1 to ``cpus`` workers."""
    if elastic and cpus > 1:
        gang = Gang(1, Resources(cpus=1), "PACK", cpus)
        return JobSpec(job_id, "t", priority, f"cpu-1-{cpus}", gang.needs, job_id,
                       "python job.py", {}, estimate_s=HOUR, gang=gang, submitter=ADMIN)
    return JobSpec(job_id, "t", priority, "custom", Resources(cpus=cpus), job_id,
                   "python job.py", {}, estimate_s=HOUR, submitter=ADMIN)


def _live_by_job(live: list[Record]) -> dict[str, list[str]]:
    by_job: dict[str, list[str]] = {}
    for record in live:
        by_job.setdefault(record.queue_id, []).append(record.sid)
    return by_job


class QueueModel(RuleBasedStateMachine):
    """The queue, its database and the chaos job server; what the model remembers: which
    attempts were told to stop (``told``) or reported their end (``completed``), each job's
    last attempt and its service as last seen."""

    def __init__(self) -> None:
        super().__init__()
        self._dir = tempfile.TemporaryDirectory(prefix="raydeck-queue-model-")
        self.url = f"sqlite:///{Path(self._dir.name) / 'q.db'}"
        self.server = ChaosJobServer()
        self.now = 0.0
        self.store = Store(self.url)  # the test's own reads
        self.queue = self._new_queue()
        self.queue.configure(ADMIN, policy="priority", aging_s=AGING_S)
        self.told: set[str] = set()
        self.completed: set[str] = set()
        self.faults_at_clean = 0  # the job server's fault count after the last clean tick
        # job -> (submitted_at, attempt, state) as last seen
        self.lives: dict[str, tuple[float, int, str]] = {}
        self.service: dict[tuple[str, float], float] = {}

    def _new_queue(self) -> JobQueue:
        launcher = TimedLauncher(self.server, CALL_BOUND_S, self.server.await_answer)
        return JobQueue(Store(self.url), launcher, clock=lambda: self.now,
                        backoff=Backoff(initial_s=1.0, max_s=8.0))

    def teardown(self) -> None:
        self.server.down = False
        self.server.release()
        self._dir.cleanup()

    # --- clients -----------------------------------------------------------------------------
    @rule(job=st.sampled_from(JOB_IDS), cpus=st.integers(1, 4), priority=st.integers(0, 3),
          elastic=st.booleans())
    def submit(self, job: str, cpus: int, priority: int, elastic: bool) -> None:
        with contextlib.suppress(ConfigError):  # already queued, or the job server is down
            self.queue.submit(_spec(job, cpus, priority, elastic))

    @rule(job=st.sampled_from(JOB_IDS), cpus=st.integers(2, 4))
    def submit_urgent(self, job: str, cpus: int) -> None:
        """A job of the highest priority: it preempts what it needs, once they checkpoint."""
        self.submit(job, cpus, 3, elastic=False)

    @rule(job=st.sampled_from(JOB_IDS))
    def cancel(self, job: str) -> None:
        row = self.store.get(job)
        earlier = {r.sid for r in self.server.live() if r.queue_id == job} - (
            {row.submission_id} if row is not None else set())
        try:
            self.queue.cancel(job, ADMIN)
        except ConfigError:
            return  # no such job, ended, or the job server cannot stop it now
        # Every attempt it knew of is stopped; an earlier life's orphan is the tick's.
        running = {r.sid for r in self.server.live() if r.queue_id == job}
        assert running <= earlier, f"cancelled {job}, and {sorted(running - earlier)} runs"

    @rule(job=st.sampled_from(JOB_IDS), priority=st.integers(0, 3))
    def reprioritize(self, job: str, priority: int) -> None:
        with contextlib.suppress(ConfigError):  # no such job, or it ended
            self.queue.reprioritize(job, priority, ADMIN)

    @rule(policy=st.sampled_from(POLICIES))
    def configure(self, policy: str) -> None:
        self.queue.configure(ADMIN, policy=policy)

    @rule()
    def restart_queue(self) -> None:
        """The queue's actor restarts: a new queue on the same database and job server."""
        self.queue = self._new_queue()

    # --- the jobs ------------------------------------------------------------------------------
    @precondition(lambda self: self.server.live())
    @rule(pick=st.integers(0, 7), obey=st.booleans())
    def checkpoint(self, pick: int, obey: bool) -> None:
        """An attempt commits a checkpoint; told to stop there, it exits 75 if it ``obey``s."""
        self._checkpoint(self._pick(pick), obey)

    @precondition(lambda self: self.server.live())
    @rule(obey=st.booleans())
    def work(self, obey: bool) -> None:
        """Every running attempt commits a checkpoint (told to stop, it exits 75 if they
        ``obey``)."""
        for record in sorted(self.server.live(), key=lambda r: r.sid):
            self._checkpoint(record, obey)

    @precondition(lambda self: self.server.live())
    @rule(pick=st.integers(0, 7), end=st.sampled_from(ENDS))
    def ends(self, pick: int, end: int | str) -> None:
        """An attempt ends: its driver exits with a code, a user stops it (``ray job stop``),
        or its training runs to its end (``completed``: it says so, then exits 0)."""
        record = self._pick(pick)
        if end == "stop":
            self.server.stop_externally(record.sid)
        elif end == "completed":
            self._complete(record)
        else:
            assert isinstance(end, int)
            self.server.exit(record.sid, end)

    def _complete(self, record: Record) -> None:
        """``record`` reports its end, then exits 0; one that is not its job's current attempt
        is refused or ignored, never recorded."""
        current = self._current(record)
        row = self.store.get(record.queue_id)
        try:
            self.queue.completed(record.queue_id, record.token)
        except ConfigError:
            assert not current, f"{record.sid}, the current attempt, may not report its end"
        if current:
            self.completed.add(record.sid)
        elif row is not None:
            after = self.store.get(record.queue_id)
            assert after is not None and after.completed_at == row.completed_at, (
                f"{record.sid}, not the current attempt, reported the end of {after}")
        self.server.exit(record.sid, 0)

    def _checkpoint(self, record: Record, obey: bool) -> None:
        """``record``'s attempt commits a checkpoint: an attempt that is not current is always
        told to stop (and exits 75 if it ``obey``s, its ``preempted`` call refused)."""
        current = self._current(record)
        stop = self.queue.checkpointed(record.queue_id, record.token)
        assert stop or current, f"{record.sid}, not the current attempt, was not told to stop"
        if stop and current:
            self.told.add(record.sid)
        if stop and obey:
            try:
                self.queue.preempted(record.queue_id, record.token)
            except ConfigError:
                assert not current, f"{record.sid}, the current attempt, may not say it stopped"
            self.server.exit(record.sid, PREEMPTED_EXIT_CODE)

    def _current(self, record: Record) -> bool:
        """Whether ``record`` is its job's current attempt: the one it started (or whose
        submission's answer was lost), by its token."""
        row = self.store.get(record.queue_id)
        return row is not None and row.token == record.token and (
            row.state in ACTIVE or (row.state == "queued" and row.submit_failures > 0))

    def _pick(self, pick: int) -> Record:
        live = sorted(self.server.live(), key=lambda r: r.sid)
        return live[pick % len(live)]

    # --- the job server's faults ---------------------------------------------------------------
    @rule(fault=st.sampled_from(FAULTS))
    def fault(self, fault: tuple[str, str]) -> None:
        """The next call of a kind fails (a hang: at most ``MAX_HANGS`` at once, each holding a
        thread of the TimedLauncher), blocked calls go on, the job server goes down or comes
        back, or its head restarts."""
        call, mode = fault
        if call == "down":
            self.server.down = mode == "yes"
        elif call == "release":
            self.server.release()
        elif call == "head":
            self.server.restart_head()
        elif mode != "hang" or self.server.pending_hangs() < MAX_HANGS:
            self.server.fail_next(call, mode)

    # --- time --------------------------------------------------------------------------------
    @rule(seconds=st.sampled_from((1.0, 10.0, 60.0, 301.0, 900.0)))
    def advance(self, seconds: float) -> None:
        """Time passes (a hung request ends within its own timeout, before much of it does),
        and the queue's actor ticks, as it does every few seconds."""
        self.server.release()
        self.now += seconds
        self.tick()

    @rule()
    def tick(self) -> None:
        faults = self.server.faults
        try:
            self.queue.tick()
        except ConfigError:
            # The cluster's resources could not be read: the actor logs it, ticks again.
            assert self.server.faults > faults, "a tick failed with no fault"
        if self.server.faults == faults:
            self.faults_at_clean = faults

    @rule()
    def settle(self) -> None:
        """Faults cleared and every attempt cooperating (a checkpoint each round, obeying):
        the jobs victims were stopped for, and under ``priority`` the queued job of strictly the
        highest priority that fits the node, start within ``SETTLE_ROUNDS`` ticks."""
        self.server.calm()
        targets = self._targets()
        for _ in range(SETTLE_ROUNDS):
            if all(self._started(job) for job in targets):
                return
            self.now += SETTLE_STEP_S
            for record in self.server.live():
                self._checkpoint(record, obey=True)
            self.tick()
        late = sorted(job for job in targets if not self._started(job))
        assert not late, f"{late} did not start within {SETTLE_ROUNDS} cooperative ticks"

    def _started(self, job: str) -> bool:
        row = self.store.get(job)
        return row is not None and row.state != "queued"

    def _targets(self) -> set[str]:
        rows = {r.id: r for r in self.store.jobs()}
        queued = {j for j, r in rows.items() if r.state == "queued"}
        targets = {r.preempted_for for r in rows.values()
                   if r.state == "preempting" and r.preempted_for in queued}
        if self.queue.policy_name() == "priority":
            alive = [r for r in rows.values() if r.state not in ENDED]
            for job in queued:
                row = rows[job]
                if row.cpus <= NODE_CPUS and all(
                        other.priority < row.priority for other in alive if other.id != job):
                    targets.add(job)
        return targets

    # --- invariants --------------------------------------------------------------------------
    @invariant()
    def queue_and_job_server_agree(self) -> None:
        """What the job server runs is what the queue runs (see module docs); a disagreement a
        fault caused lasts until the next clean tick at most."""
        if self.server.faults > self.faults_at_clean:
            return
        rows = {r.id: r for r in self.store.jobs()}
        live = self.server.live()
        for job, sids in _live_by_job(live).items():
            row = rows.get(job)
            assert row is not None, f"the job server runs {sorted(sids)} of unknown job {job}"
            current = row.state in ACTIVE or (row.state == "queued" and row.submit_failures > 0)
            assert current and sids == [row.submission_id], (
                f"the job server runs {sorted(sids)} of job {job}, which the queue has "
                f"{row.state} at attempt {row.attempt}")
        used = sum(r.cpus for r in live)
        assert used <= NODE_CPUS, f"{used:g} CPUs of {NODE_CPUS:g} in use"

    @invariant()
    def attempts_start_once(self) -> None:
        twice = sorted(sid for sid, n in self.server.accepted.items() if n > 1)
        assert not twice, f"the job server accepted {twice} more than once"

    @invariant()
    def outcomes_are_the_job_servers(self) -> None:
        for row in self.store.jobs():
            before = self.lives.get(row.id)
            if before is not None and before[2] not in ENDED:  # the same life (not a new one)
                for attempt in range(before[1], row.attempt):
                    self._moved_past(row, submission_id(row.id, attempt))
            self.lives[row.id] = (row.submitted_at, row.attempt, row.state)
            if row.state in ENDED and row.state != "cancelled" and row.started_at is not None:
                self._ended_as_server_says(row)

    def _moved_past(self, row: JobRow, sid: str) -> None:
        """``row`` went on to its next attempt after ``sid``: requeued or relaunched."""
        record = self.server.records.get(sid)
        if record is None or record.forgot:
            return  # never reached the job server, or its head forgot it (ended or not)
        stopped_for_queue = (record.exit_code == PREEMPTED_EXIT_CODE
                             or (record.status == "STOPPED" and record.stopped_by == "queue")
                             or (record.exit_code == 0 and sid in self.told
                                 and sid not in self.completed))
        assert stopped_for_queue, (
            f"job {row.id} went on from {sid} ({record.status}, exit {record.exit_code}, "
            f"stopped by {record.stopped_by or 'nobody'}, told: {sid in self.told}): only the "
            "preempted exit, the queue's own stop or a stop it told is a preemption")

    def _ended_as_server_says(self, row: JobRow) -> None:
        sid = row.submission_id
        record = self.server.records.get(sid)
        assert record is not None, f"job {row.id} ended {row.state}; {sid} never ran"
        expected = {"SUCCEEDED": "succeeded", "FAILED": "failed", "STOPPED": "stopped"}
        if (expected.get(record.status), record.exit_code) == (row.state, row.exit_code):
            return
        # Forgotten by a restarted head before the queue read its end: only the job's own
        # word (it reported its end) may make it succeeded, with no exit code to record.
        assert record.forgot and (row.state, row.exit_code) == ("succeeded", None) \
            and row.completed_at is not None, (
                f"job {row.id} recorded {row.state} (exit {row.exit_code}); the job server "
                f"says {record.status} (exit {record.exit_code})"
                + (", then forgot it" if record.forgot else ""))

    @invariant()
    def attained_service_never_decreases(self) -> None:
        if self.queue.policy_name() not in ATTAINED_SERVICE:
            return
        with self.server.quiet():
            entries = self.queue.listing()
        for entry in entries:
            if not entry.service:
                continue
            served = float(entry.service.split()[0])
            ident = (entry.job.id, entry.job.submitted_at)
            before = self.service.get(ident, 0.0)
            assert served >= before, (f"job {entry.job.id}'s attained service went from "
                                      f"{before} to {served} h")
            self.service[ident] = served


# The failures the model found, as its steps (shrunk by hand): each fails on the queue that has
# the bug, in well under a second.


@pytest.mark.timeout(30)
def test_a_started_job_its_head_forgot_is_not_started_again_under_the_same_id() -> None:
    """The head forgets a job the queue submitted but had not yet seen running: the queue
    must not submit that same attempt again (it starts a new one, or ends it)."""
    model = QueueModel()
    try:
        model.submit("a", 1, 0, elastic=False)
        model.tick()  # submitted: recorded starting
        model.fault(("head", "restart"))
        model.tick()
        model.attempts_start_once()
    finally:
        model.teardown()


@pytest.mark.timeout(30)
def test_a_submission_whose_answer_was_lost_keeps_its_room_in_that_tick() -> None:
    """A submission whose answer was lost may have started (it had here): the jobs behind it
    in the same tick may not take its room."""
    model = QueueModel()
    try:
        model.fault(("submit", "lose"))
        model.submit("a", 4, 0, elastic=False)
        model.submit("b", 2, 0, elastic=False)
        model.tick()  # a accepted, its answer lost; b started in the room a holds
        model.tick()  # a clean tick: a is adopted, and both run on 4 CPUs
        model.queue_and_job_server_agree()
    finally:
        model.teardown()


@pytest.mark.timeout(30)
def test_an_attempt_of_a_cancelled_job_is_told_to_stop_at_its_checkpoint() -> None:
    """A submission that hung lands after its job was cancelled: the attempt is not current,
    and its first checkpoint call is told to stop (the next tick stops it anyway)."""
    model = QueueModel()
    try:
        model.submit("a", 1, 0, elastic=False)
        model.fault(("submit", "hang"))
        model.tick()  # the queue gives up on the submission: a is queued to retry
        model.cancel("a")  # not found on the job server: cancelled
        model.fault(("release", "all"))  # the submission lands
        model.checkpoint(0, obey=False)
    finally:
        model.teardown()


@pytest.mark.timeout(30)
def test_a_victim_is_not_held_back_by_a_job_it_was_stopped_for_that_has_since_started() -> None:
    """b is preempted for a, a starts, then the priorities turn: a is preempted for b. b's old
    hold ("waits for a") must not come back with a in the queue, or each waits for the other and
    neither ever starts (the soak's "['b'] did not start", under las, then priority)."""
    model = QueueModel()
    try:
        model.submit("b", 4, 0, elastic=False)
        model.tick()  # b starts
        model.work(obey=True)  # b checkpoints
        model.submit_urgent("a", 4)
        model.tick()  # b is preempted for a
        model.work(obey=True)  # b stops at its checkpoint
        model.tick()  # b is back in the queue (held for a), a starts
        model.reprioritize("a", 0)
        model.reprioritize("b", 3)
        model.work(obey=True)  # a checkpoints: it may be stopped for b
        model.settle()  # a is preempted for b; b must start
    finally:
        model.teardown()


@pytest.mark.timeout(30)
def test_an_elastic_job_whose_submission_answer_was_lost_keeps_the_size_it_was_sent_at() -> None:
    """c, elastic, starts at 4 workers and its submission's answer is lost: it runs at 4 on the
    job server. Requeued at its minimum (1), the queue would count 1 CPU for it once adopted:
    no room for a, and stopping c "frees" 1 CPU, too little, so a would never start."""
    model = QueueModel()
    try:
        model.fault(("submit", "lose"))
        model.submit("c", 4, 0, elastic=True)
        model.tick()  # c submitted at 4 workers, accepted, its answer lost
        model.submit_urgent("a", 2)
        model.settle()  # c adopted at 4 workers, shrunk for a; a must start
    finally:
        model.teardown()


TestQueueModel = QueueModel.TestCase
TestQueueModel.settings = settings.get_profile(PROFILE)
TestQueueModel = pytest.mark.timeout(TIMEOUT_S)(TestQueueModel)
