"""The attained-service policies (las, gittins) and the simulator's preemption cost, on small
cases worked out by hand. Pure Python: no Ray."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from raydeck.errors import ConfigError
from raydeck.scheduling import (
    RESTART_OVERHEAD_S,
    Backfill,
    Capacity,
    Fifo,
    Gittins,
    LeastAttainedService,
    Policy,
    PreemptionCost,
    QueuedJob,
    Report,
    Resources,
    RunningJob,
    TraceJob,
    generate_trace,
    make_policy,
    read_trace,
    simulate,
)
from raydeck.scheduling.policies.attained_service import (
    DEFAULT_THRESHOLDS,
    MIN_HISTORY,
    adaptive_thresholds,
    gittins_index,
    service_rate,
)
from raydeck.scheduling.policies.preemption import MIN_RUN_BEFORE_PREEMPTION_S

GPUS4 = Resources(cpus=64, gpus=4)


def _queued(job_id: str, submitted: float = 0.0, gpus: float = 1, priority: int = 0,
            key: str = "", attained: float = 0.0) -> QueuedJob:
    return QueuedJob(job_id, "a", priority, Resources(cpus=1, gpus=gpus), submitted, 50.0,
                     key=key, attained_s=attained)


def _pieces(trace: list[TraceJob], policy: Policy, cost: PreemptionCost | None = None
            ) -> dict[str, tuple[tuple[float, float], ...]]:
    return {s.job.id: s.pieces for s in simulate(trace, policy, GPUS4, cost=cost)}


def _trace(every: float) -> list[TraceJob]:
    # A (4 GPUs, 100 s, a checkpoint every `every` s) runs alone; B (4 GPUs, 10 s) comes at 30.
    return [TraceJob("A", 0, 100, Resources(cpus=1, gpus=4), "a", checkpoint_s=every),
            TraceJob("B", 30, 10, Resources(cpus=1, gpus=4), "a", checkpoint_s=5)]


def test_las_levels_and_its_thresholds_are_validated() -> None:
    las = LeastAttainedService(thresholds=(10, 100))
    assert [las.level(s) for s in (0, 9.9, 10, 99, 100, 1e9)] == [0, 0, 1, 1, 2, 2]
    for bad in ((100, 10), (0, 10), (10, 10), (float("inf"),)):
        with pytest.raises(ConfigError, match="increasing numbers > 0"):
            LeastAttainedService(thresholds=bad)
    # GPU-seconds; CPU-seconds for a job without GPUs.
    assert (service_rate(Resources(cpus=8, gpus=2)), service_rate(Resources(cpus=8))) == (2, 8)


def test_las_preempts_a_job_past_a_threshold_for_a_new_one_which_starts_first() -> None:
    # A passes 20 GPU-s at t=5 (level 1). B (level 0) comes at 30, when A is at a checkpoint:
    # A stops there, B runs 30-40 (the victim waits behind it), A runs its 70 s left from 40.
    las = LeastAttainedService(thresholds=(20,))
    assert _pieces(_trace(5), las) == {"A": ((0, 30), (40, 110)), "B": ((30, 40),)}
    # A checkpointing every 8 s stops at its next checkpoint (32) when preemption is free.
    assert _pieces(_trace(8), LeastAttainedService(thresholds=(20,))) == {
        "A": ((0, 32), (42, 110)), "B": ((32, 42),)}
    # FIFO never preempts: B waits for A.
    assert _pieces(_trace(5), Fifo()) == {"A": ((0, 100),), "B": ((100, 110),)}


def test_a_charged_preemption_loses_the_work_since_the_checkpoint_and_a_restart() -> None:
    # With a cost A stops at once (30), 6 s after its checkpoint at 24: it redoes them and
    # restarts 45 s before progressing, so it runs 40 -> 40 + 45 + (100 - 24) = 161.
    assert RESTART_OVERHEAD_S == 45.0
    schedule = simulate(_trace(8), LeastAttainedService(thresholds=(20,)), GPUS4,
                        cost=PreemptionCost())
    by_id = {s.job.id: s for s in schedule}
    assert by_id["A"].pieces == ((0, 30), (40, 161))
    assert by_id["B"].pieces == ((30, 40),)
    assert (by_id["A"].lost_s, by_id["B"].lost_s) == (6 + 45, 0)
    assert (by_id["A"].wait_s, by_id["B"].wait_s) == (10, 0)
    report = Report.of("las", schedule, GPUS4)
    assert report.preemptions == 1
    assert report.lost_gpu_hours == pytest.approx(51 * 4 / 3600)
    # A replay without preemptions costs nothing.
    free = simulate(_trace(8), Fifo(), GPUS4, cost=PreemptionCost())
    assert Report.of("fifo", free, GPUS4).lost_gpu_hours == 0
    with pytest.raises(ConfigError, match="restart_s=-1"):
        PreemptionCost(restart_s=-1)


def test_las_starvation_bound_counts_from_when_a_job_last_ran() -> None:
    las = LeastAttainedService(aging_s=100, thresholds=(10,))
    las.ended(RunningJob(_queued("old", submitted=0), 0.0), 20.0)  # ran 0-20, queued again
    old = _queued("old", submitted=0, attained=20)  # 20 GPU-s: level 1
    new = _queued("new", submitted=50)
    assert [j.id for j in las.order([old, new], [], 110)] == ["new", "old"]  # not 100 s yet
    assert [j.id for j in las.order([old, new], [], 119)] == ["new", "old"]
    assert [j.id for j in las.order([old, new], [], 120)] == ["old", "new"]  # promoted
    # Once it finishes (20 GPU-s more), its total joins the history; its wait is forgotten.
    las.finished(RunningJob(old, 120.0), 140.0)
    assert las.ended_services == [40.0]
    assert las.waiting(old, 200.0) == 200.0


def test_las_levels_adapt_to_the_ended_jobs_services_unless_pinned() -> None:
    """Issue 52: by default las' thresholds are the 90th and 99th percentiles of the service
    ended jobs attained (the cluster's history, then each job it sees finish); Tiresias' fixed
    ones until ``MIN_HISTORY`` jobs have ended; thresholds set explicitly win."""
    history = [60.0 * minute for minute in range(1, 101)]  # 1 to 100 GPU-minutes
    las = LeastAttainedService(services=history)
    assert las.thresholds == adaptive_thresholds(history) == (91 * 60.0, 100 * 60.0)
    # 80 GPU-minutes is short on this cluster: the top level (past the fixed 1 GPU-hour).
    assert [las.describe_rank(_queued("j"), s) for s in (80 * 60, 95 * 60, 6000)] == [
        "Q0 of 3", "Q1 of 3", "Q2 of 3"]
    assert LeastAttainedService().level(80 * 60) == 1  # no history: the fixed levels
    pinned = LeastAttainedService(thresholds=(30.0,), services=history)
    assert pinned.thresholds == (30.0,) and pinned.level(60) == 1
    # Too few ended jobs say little: the fixed levels, until MIN_HISTORY have ended here.
    learning = LeastAttainedService(services=history[:MIN_HISTORY - 1])
    assert learning.thresholds == DEFAULT_THRESHOLDS
    learning.finished(RunningJob(_queued("last", gpus=2), 0.0), 30.0)  # 60 GPU-s
    assert learning.ended_services[:2] == [60.0, 60.0]  # 1 to 19 GPU-minutes, and this one
    assert learning.thresholds == (18 * 60.0, 19 * 60.0)
    # Repeated or zero quantiles collapse to the levels left.
    assert adaptive_thresholds([0.0] * 10 + [50.0] * 90) == (50.0,)
    assert adaptive_thresholds([0.0] * MIN_HISTORY) == DEFAULT_THRESHOLDS
    with pytest.raises(ConfigError, match="must be a number >= 0"):
        LeastAttainedService(services=[-1.0])


def test_a_job_that_does_not_fit_lets_smaller_ones_pass_until_it_has_aged() -> None:
    """Work-conserving, as Tiresias places jobs: B (4 GPUs) cannot start beside A, so C (1 GPU)
    starts in the room left; once B has waited the aging bound (5 s, at 6) its room is kept,
    so D (at 7) waits for it. A bound of 1,000 s lets D pass too. FIFO blocks C behind B."""
    trace = [TraceJob("A", 0, 10, Resources(cpus=1, gpus=2), "a"),
             TraceJob("B", 1, 5, Resources(cpus=1, gpus=4), "a"),
             TraceJob("C", 2, 3, Resources(cpus=1, gpus=1), "a"),
             TraceJob("D", 7, 3, Resources(cpus=1, gpus=1), "a")]

    def starts(policy: Policy) -> dict[str, float]:
        return {s.job.id: s.start_s for s in simulate(trace, policy, GPUS4)}

    for kind in (LeastAttainedService, Gittins):
        assert starts(kind(aging_s=5)) == {"A": 0, "C": 2, "B": 10, "D": 15}
        assert starts(kind(aging_s=1000)) == {"A": 0, "C": 2, "D": 7, "B": 10}
    assert starts(Fifo(aging_s=5)) == {"A": 0, "B": 10, "C": 15, "D": 15}


def test_a_replay_gives_a_preempted_job_its_attained_service_back_in_the_queue() -> None:
    """The policy keeps no service of its own: A's 30 s on 4 GPUs are in the job the replay
    queues again (the queue's store does the same), and only B's wait has none."""
    seen: dict[str, set[float]] = {}

    class Watched(LeastAttainedService):
        def decide(self, queue: Sequence[QueuedJob], running: Sequence[RunningJob],
                   free: Capacity, total: Resources, now: float) -> list[QueuedJob]:
            for job in queue:
                seen.setdefault(job.id, set()).add(job.attained_s)
            return super().decide(queue, running, free, total, now)

    pieces = _pieces(_trace(5), Watched(thresholds=(20,)))
    assert pieces == {"A": ((0, 30), (40, 110)), "B": ((30, 40),)}
    assert seen == {"A": {0.0, 120.0}, "B": {0.0}}


def test_priority_beats_attained_service_when_preempting() -> None:
    las = LeastAttainedService(thresholds=(10,))
    served = RunningJob(_queued("served", gpus=2, priority=1), 0.0, checkpoint_s=90.0)
    # At t=100 it has 200 GPU-s (level 1); a new level-0 job of lower priority never stops it,
    # one of its priority does, and one of higher priority stops even a level-0 job.
    assert not las.outranks(_queued("low", 99, priority=0), served, 100.0)
    assert las.outranks(_queued("same", 99, priority=1), served, 100.0)
    fresh = RunningJob(_queued("fresh", 95, priority=1), 95.0, checkpoint_s=99.0)
    assert not las.outranks(_queued("same", 99, priority=1), fresh, 100.0)  # tie: level 0
    assert las.outranks(_queued("high", 99, priority=2), fresh, 100.0)
    decision = las.preempt([_queued("same", 99, gpus=4, priority=1)], [served, fresh],
                           Resources(cpus=60, gpus=2), now=100.0)
    assert decision is not None and [v.job.id for v in decision.victims] == ["served"]
    assert las.preempt([_queued("same", 99, gpus=5, priority=1)], [served, fresh],
                       Resources(cpus=60, gpus=2), now=100.0) is None  # the tie never helps


def test_gittins_index_of_a_known_distribution() -> None:
    services = [10.0, 10.0, 10.0, 100.0]
    # New: a quantum of 10 ends 3 in 4 jobs for 10 GPU-s each: 0.75 / 10.
    assert gittins_index(services, 0) == pytest.approx(0.075)
    # After 5 s the same 3 in 4 end within 5 more: the index rises (unlike LAS's rank).
    assert gittins_index(services, 5) == pytest.approx(0.15)
    assert gittins_index(services, 10) == pytest.approx(1 / 90)
    assert gittins_index(services, 100) == 0 == gittins_index([], 0)


def test_gittins_orders_by_index_over_the_jobs_own_history_or_the_clusters() -> None:
    gittins = Gittins(services=[10.0, 10.0, 10.0, 100.0],
                      history={"slow": [200.0, 200.0]})
    half = _queued("half", submitted=0, attained=5)
    long = _queued("long", submitted=1, attained=20)
    new, slow = _queued("new", submitted=30), _queued("slow", submitted=2, key="slow")
    # half 0.15 > new 0.075 > long 1/80 > slow (its own history: 1/200).
    assert [j.id for j in gittins.order([slow, long, new, half], [], 40)] == [
        "half", "new", "long", "slow"]
    # A 2-GPU run of the same key is drawn from 400 GPU-s.
    assert gittins.distribution(_queued("x", gpus=2, key="slow")) == [400.0, 400.0]
    # A job that finishes joins the cluster's distribution: half, 5 + 2 GPU-s.
    gittins.finished(RunningJob(half, 40.0), 42.0)
    assert gittins.distribution(new) == [7.0, 10.0, 10.0, 10.0, 100.0]
    with pytest.raises(ConfigError, match="must be a number >= 0"):
        Gittins(services=[-1.0])


def test_make_policy_knows_las_and_gittins() -> None:
    assert isinstance(make_policy("las", aging_s=60), LeastAttainedService)
    assert make_policy("las", aging_s=60).aging_s == 60
    assert isinstance(make_policy("gittins"), Gittins)
    # Backfill's reservations are not theirs to keep: they preempt for the head instead.
    for name in ("backfill-las", "backfill-gittins", "lottery"):
        with pytest.raises(ConfigError, match="las, gittins, backfill"):
            make_policy(name)
    assert isinstance(make_policy("backfill-sjf"), Backfill)


@pytest.mark.parametrize("name", ["las", "gittins"])
def test_attained_service_on_a_generated_trace_runs_every_job_within_capacity(
        name: str) -> None:
    capacity = Resources(cpus=64, gpus=16)
    trace = generate_trace(150, seed=2, gpus=16, checkpoint_s=600)
    for cost in (None, PreemptionCost()):
        schedule = simulate(trace, make_policy(name), capacity, cost=cost)
        assert sorted(s.job.id for s in schedule) == sorted(j.id for j in trace)
        events = []
        for s in schedule:
            ran = sum(end - start for start, end in s.pieces)
            assert ran == pytest.approx(s.job.duration_s + s.lost_s)
            assert s.lost_s <= s.preemptions * (RESTART_OVERHEAD_S + 600) + 1e-6
            assert all(end - start >= MIN_RUN_BEFORE_PREEMPTION_S
                       for start, end in s.pieces[1:-1])
            events += [(start, s.job.needs.gpus) for start, _ in s.pieces]
            events += [(end, -s.job.needs.gpus) for _, end in s.pieces]
        held = 0.0
        for _, delta in sorted(events):
            held += delta
            assert held <= capacity.gpus + 1e-6


@pytest.mark.timeout(10)
def test_the_vendored_public_trace_reads_as_converted() -> None:
    # benchmarks/traces/README.md: Tiresias' 60-job example, 1/2/4/8 GPUs, 121 s to 30 min.
    trace = read_trace(Path(__file__).parents[2] / "benchmarks" / "traces"
                       / "tiresias_60_job.csv")
    assert len(trace) == 60 and trace[0] == TraceJob(
        "t000", 0.0, 164.0, Resources(cpus=2, gpus=1), "tiresias")
    assert sorted({job.needs.gpus for job in trace}) == [1, 2, 4, 8]
    assert min(j.duration_s for j in trace) == 121 and max(j.duration_s for j in trace) == 1800
