"""Preemption never loops and a stopped job is never recorded as finished: the real
:class:`JobQueue` in front of a fake job server that behaves like Ray's job client (a driver's
exit status decides SUCCEEDED or FAILED), and the job's side of the handshake with the queue
actor's call failing as it does on a cluster (``ray.get`` timing out).

Issue 25: a requeued victim kept its place (its submission time) and its old checkpoint, so
under FIFO, or ``priority`` once it had waited an hour, it restarted first in the room it had
freed and was at once a victim again (B preempted 4 times while H stayed queued). And a driver
whose confirmation call timed out exited 0 after its workers had stopped, so the queue recorded
a fraction of the epochs as a success.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from raydeck._internal import contract
from raydeck.errors import JobPreemptedError
from raydeck.scheduling.policies.core import Resources
from raydeck.scheduling.policies.preemption import MIN_RUN_BEFORE_PREEMPTION_S
from raydeck.scheduling.policies.registry import POLICIES, make_policy
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.job_queue import JobQueue, JobSpec
from raydeck.scheduling.queue.store import Store
from raydeck.scheduling.simulator.replay import simulate
from raydeck.scheduling.simulator.trace import TraceJob
from raydeck.tracking.client import preemption
from raydeck.train.trainer import end_if_preempted
from tests.fixtures.fake_job_server import FakeJobServer

pytestmark = pytest.mark.timeout(60)

# Every policy make_policy builds (backfill over another base too).
ALL_POLICIES = [*POLICIES, "backfill-priority", "backfill-fairshare"]
HOUR = 3600.0


def _spec(job_id: str, priority: int, estimate_s: float = HOUR) -> JobSpec:
    return JobSpec(job_id, "a", priority, "custom", Resources(cpus=4), job_id, "python job.py",
                   {}, estimate_s=estimate_s)


def _row(queue: JobQueue, job_id: str) -> Any:
    (entry,) = [e for e in queue.listing() if e.job.id == job_id]
    return entry


def _setup(tmp_path: Path, policy: str) -> tuple[JobQueue, FakeJobServer, list[float]]:
    """B (priority 0, the whole node) running with a checkpoint; H (priority 5, the whole
    node) queued 2 h after B, so that B, once requeued, has waited past the aging bound."""
    server, clock = FakeJobServer(), [0.0]
    queue = JobQueue(Store(f"sqlite:///{tmp_path / 'q.db'}"), server, clock=lambda: clock[0])
    queue.configure(Identity.here(), policy)
    queue.submit(_spec("B", 0, estimate_s=4 * HOUR))
    assert queue.tick() == ["B"]
    clock[0] = 2 * HOUR
    assert queue.checkpointed("B", server.tokens["B"]) is False  # nothing asked yet
    queue.submit(_spec("H", 5, estimate_s=600.0))
    assert queue.tick() == []
    assert _row(queue, "B").job.state == "preempting"
    return queue, server, clock


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_the_high_job_starts_in_the_room_its_victim_frees_and_the_victim_then_resumes(
        tmp_path: Path, policy: str) -> None:
    queue, server, clock = _setup(tmp_path, policy)
    clock[0] += 60
    # Told at this checkpoint; its driver exits 75.
    assert queue.checkpointed("B", server.tokens["B"]) is True
    server.exit("B", 75)
    # B is back in the queue ahead of H in every order here (aged, older, or longer waited),
    # yet H takes the room B freed, in the same tick.
    assert queue.tick() == ["H"]
    assert _row(queue, "B").job.state == "queued"
    for _ in range(3):  # B never restarts beside H, nor takes H's place
        clock[0] += 30
        assert queue.tick() == []
    clock[0] += 600
    server.exit("H", 0)
    assert queue.tick() == ["B"]
    assert server.submitted == ["B", "H", "B-r1"]
    b = _row(queue, "B").job
    assert (b.state, b.preemptions) == ("starting", 1)


def test_a_victim_waits_while_the_job_it_was_stopped_for_cannot_start_yet(
        tmp_path: Path) -> None:
    queue, server, clock = _setup(tmp_path, "fifo")
    server.jobs["outside"], server.cpus["outside"] = "RUNNING", 1.0  # not the queue's job
    clock[0] += 60
    assert queue.checkpointed("B", server.tokens["B"]) is True
    server.exit("B", 75)
    assert queue.tick() == []  # 3 CPUs free: H waits, and B (listed) waits for H
    assert _row(queue, "B").why.startswith("waits for H to start (it was preempted for it)")
    server.exit("outside", 0)
    assert queue.tick() == ["H"]


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_a_resumed_victim_is_not_preempted_again_without_a_new_checkpoint_and_a_minimum_run(
        tmp_path: Path, policy: str) -> None:
    queue, server, clock = _setup(tmp_path, policy)
    clock[0] += 60
    assert queue.checkpointed("B", server.tokens["B"]) is True
    server.exit("B", 75)
    assert queue.tick() == ["H"]
    clock[0] += 600
    server.exit("H", 0)
    assert queue.tick() == ["B"]
    restarted = clock[0]
    # Another urgent job comes while B runs its second attempt: B's old checkpoint does not
    # count, nor does a new one before it has run MIN_RUN_BEFORE_PREEMPTION_S.
    queue.submit(_spec("H2", 5, estimate_s=600.0))
    assert queue.tick() == [] and _row(queue, "B").job.state == "running"
    clock[0] += 120
    assert queue.checkpointed("B", server.tokens["B"]) is False
    assert queue.tick() == [] and _row(queue, "B").job.state == "running"
    clock[0] = restarted + MIN_RUN_BEFORE_PREEMPTION_S
    assert queue.tick() == [] and _row(queue, "B").job.state == "preempting"
    clock[0] += 60
    assert queue.checkpointed("B", server.tokens["B"]) is True
    server.exit("B-r1", 75)
    assert queue.tick() == ["H2"]
    assert _row(queue, "B").job.preemptions == 2


def test_a_told_job_that_exits_0_without_reporting_completion_is_requeued(
        tmp_path: Path) -> None:
    queue, server, clock = _setup(tmp_path, "fifo")
    clock[0] += 60
    assert queue.checkpointed("B", server.tokens["B"]) is True
    # The driver's confirmation call timed out, so (before the fix) it exited 0.
    server.exit("B", 0)
    assert queue.tick() == ["H"]
    b = _row(queue, "B").job
    assert (b.state, b.preemptions, b.submission_id) == ("queued", 1, "B-r1")


def test_a_told_job_that_reports_completion_or_was_never_told_ends_succeeded(
        tmp_path: Path) -> None:
    queue, server, clock = _setup(tmp_path, "fifo")
    clock[0] += 60
    assert queue.checkpointed("B", server.tokens["B"]) is True
    # Training ran to its end: the checkpoint was its last epoch's.
    queue.completed("B", server.tokens["B"])
    server.exit("B", 0)
    assert queue.tick() == ["H"]
    assert Store(f"sqlite:///{tmp_path / 'q.db'}").get("B").state == "succeeded"  # type: ignore[union-attr]
    # Asked but ended before its next checkpoint: it finished, nothing to resume.
    clock[0] += 600
    queue.submit(_spec("L", 0))
    server.exit("H", 0)
    assert queue.tick() == ["L"]
    clock[0] += 60
    queue.checkpointed("L", server.tokens["L"])
    clock[0] += 60
    queue.submit(_spec("H3", 5))
    assert queue.tick() == [] and _row(queue, "L").job.state == "preempting"
    server.exit("L", 0)
    assert queue.tick() == ["H3"]
    assert Store(f"sqlite:///{tmp_path / 'q.db'}").get("L").state == "succeeded"  # type: ignore[union-attr]


# --- the simulator applies the same rules --------------------------------------------------
def test_the_simulator_starts_the_high_job_before_its_victim_and_never_loops() -> None:
    # B (all 4 GPUs, 4 h, a checkpoint each 10 min of work) runs from 0; H (priority 5) comes
    # at 2 h. Under FIFO B is ahead of H once requeued; it still waits for H, then resumes.
    capacity = Resources(cpus=64, gpus=4)
    low = TraceJob("B", 0, 4 * HOUR, Resources(cpus=1, gpus=4), "a", 0, checkpoint_s=600)
    high = TraceJob("H", 2 * HOUR, 600, Resources(cpus=1, gpus=4), "b", 5)
    high2 = TraceJob("H2", 2 * HOUR + 700, 600, Resources(cpus=1, gpus=4), "b", 5)
    for policy in ALL_POLICIES:
        pieces = {s.job.id: s.pieces for s in simulate([low, high, high2],
                                                       make_policy(policy), capacity)}
        assert pieces["H"] == ((2 * HOUR, 2 * HOUR + 600),), policy
        # H2 came while H ran: B resumed after H, and H2 waits for B's first checkpoint in its
        # new attempt after MIN_RUN_BEFORE_PREEMPTION_S.
        b = pieces["B"]
        assert b[0] == (0, 2 * HOUR) and b[1][0] == 2 * HOUR + 600, (policy, b)
        assert b[1][1] - b[1][0] >= MIN_RUN_BEFORE_PREEMPTION_S, (policy, b)
        assert pieces["H2"][0][0] == b[1][1], (policy, pieces)
        assert sum(end - start for start, end in b) == pytest.approx(4 * HOUR)


# --- the job's side: the driver's decision ---------------------------------------------------
class _Tracker:
    run_id = "run-1"

    def __init__(self) -> None:
        self.tags: dict[str, Any] = {}
        self.status: str | None = None

    def set_tags(self, tags: dict[str, Any], strict: bool = True) -> None:
        self.tags.update(tags)

    def finish(self, status: str = "FINISHED") -> None:
        self.status = status


class _Result:
    metrics = {"epoch": 3}


class _Actor:
    """The queue actor's handle: every method's ``.remote`` returns its name."""

    def __getattr__(self, method: str) -> Any:
        return type("Method", (), {"remote": staticmethod(lambda *_: method)})()


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A queued job's Ray: its queue actor answers ``answers[method]``, or times out as
    ``ray.get`` does when it is missing; the cluster's key-value store is a dict."""
    import ray
    import ray.exceptions
    import ray.experimental.internal_kv as kv

    state: dict[str, Any] = {"answers": {}, "kv": {}, "calls": []}

    def get(method: str, timeout: float | None = None) -> Any:
        state["calls"].append(method)
        if method not in state["answers"]:
            raise ray.exceptions.GetTimeoutError(f"Get timed out: {timeout}s")
        return True, state["answers"][method]

    context = type("Context", (), {"get_job_id": staticmethod(lambda: "02000000")})()
    monkeypatch.setenv(contract.QUEUE_JOB_ENV, "B")
    monkeypatch.setattr(preemption, "_handle", None)
    monkeypatch.setattr(preemption, "_stop_requested", False)
    monkeypatch.setattr(ray, "get_actor", lambda *_, **__: _Actor())
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    monkeypatch.setattr(kv, "_internal_kv_put", lambda key, value, overwrite=True,
                        namespace=None: state["kv"].__setitem__((namespace, key), value))
    monkeypatch.setattr(kv, "_internal_kv_exists",
                        lambda key, namespace=None: (namespace, key) in state["kv"])
    return state


def test_workers_told_to_stop_end_the_driver_as_preempted_when_its_confirmation_times_out(
        cluster: dict[str, Any]) -> None:
    cluster["answers"]["checkpointed"] = True  # rank 0 is told at its checkpoint
    assert preemption.checkpoint_committed(0) is True
    del cluster["answers"]["checkpointed"]
    tracker = _Tracker()
    # The driver's confirmation times out: it still raises, so the job exits 75.
    with pytest.raises(JobPreemptedError, match="preemption \\(unconfirmed\\)"):
        end_if_preempted(tracker, _Result())  # type: ignore[arg-type]
    assert tracker.status == "KILLED" and cluster["calls"][-1] == "preempted"
    assert "completed" not in cluster["calls"]


def test_the_queues_confirmation_alone_ends_the_driver_as_preempted(
        cluster: dict[str, Any]) -> None:
    cluster["answers"]["preempted"] = 2  # the workers' word was lost; the queue's record holds
    tracker = _Tracker()
    with pytest.raises(JobPreemptedError, match="preemption 2"):
        end_if_preempted(tracker, _Result())  # type: ignore[arg-type]
    assert tracker.tags == {"raydeck.preemptions": 2,
                            "raydeck.preemption.2": "stopped after epoch 3"}


def test_a_job_that_ran_to_its_end_tells_the_queue_and_returns(cluster: dict[str, Any]) -> None:
    cluster["answers"].update(preempted=None, completed=None)
    tracker = _Tracker()
    end_if_preempted(tracker, _Result())  # type: ignore[arg-type]
    assert cluster["calls"] == ["preempted", "completed"] and tracker.status is None
    # A queue that cannot be reached is not told; the job is not taken as preempted either.
    cluster["answers"].clear()
    cluster["calls"].clear()
    end_if_preempted(tracker, _Result())  # type: ignore[arg-type]
    assert cluster["calls"] == ["preempted"] and tracker.status is None


def test_a_preempted_digits_job_exits_with_the_preempted_status(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from raydeck.examples import digits

    def preempted(**_: Any) -> Any:
        raise JobPreemptedError("job B: preempted by the queue")

    monkeypatch.setattr(digits, "run_digits", preempted)
    with pytest.raises(SystemExit) as exited:
        digits.run_job(lambda _: None, description="d", run_name="r", argv=[])
    assert exited.value.code == contract.PREEMPTED_EXIT_CODE == 75
