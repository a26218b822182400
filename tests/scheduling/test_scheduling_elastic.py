"""Elastic jobs in the simulator, on small traces whose schedules were worked out by hand (each
test says how), the trace columns that make a job elastic, and their errors. Pure Python: no
Ray."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from raydeck.errors import ConfigError
from raydeck.scheduling import (
    Fifo,
    PreemptionCost,
    PriorityAging,
    Report,
    Resources,
    TraceJob,
    generate_trace,
    make_policy,
    read_trace,
    simulate,
    write_trace,
)
from raydeck.scheduling.policies.elastic import Elasticity

GPUS4 = Resources(cpus=64, gpus=4)


def _elastic(job_id: str, submit: float, duration: float, *, min_workers: int,
             scaling: float = 1.0, checkpoint_s: float = 10, priority: int = 0) -> TraceJob:
    """A 4-worker gang of one GPU each, elastic down to ``min_workers``."""
    return TraceJob(job_id, submit, duration, Resources(cpus=4, gpus=4), "a", priority,
                    checkpoint_s=checkpoint_s, workers=4, min_workers=min_workers,
                    scaling=scaling)


def _fixed(job_id: str, submit: float, duration: float, gpus: float,
           priority: int = 0) -> TraceJob:
    return TraceJob(job_id, submit, duration, Resources(cpus=1, gpus=gpus), "a", priority)


@pytest.mark.timeout(10)
def test_an_elastic_job_starts_at_what_fits_and_grows_to_its_maximum_at_a_checkpoint() -> None:
    # F holds 3 GPUs until 30. E (4 workers, down to 1, scaling 0.5: at 1 worker it runs at
    # (1/4) ** 0.5 = 0.5 of full speed; 100 s of work at full size, a checkpoint each 10 s of
    # work) comes at 5 and starts on the 1 free GPU. At 30 it has done 12.5 s of work, its last
    # checkpoint at 10: it grows at its next one, 20 s of work, at 30 + 7.5 / 0.5 = 45, and
    # runs its 80 s left on 4 workers: 45-125.
    trace = [_fixed("F", 0, 30, 3), _elastic("E", 5, 100, min_workers=1, scaling=0.5)]
    schedule = {s.job.id: s for s in simulate(trace, Fifo(), GPUS4)}
    assert schedule["E"].pieces == ((5, 45), (45, 125))
    assert (schedule["E"].sizes, schedule["E"].resizes, schedule["E"].preemptions) == (
        (1, 4), 1, 0)
    assert schedule["F"].pieces == ((0, 30),) and schedule["F"].sizes == ()
    # Utilization counts the GPUs held: E held 1 GPU for 40 s and 4 for 80 s (360 GPU-s, not
    # the 400 of 4 GPUs x 100 s), F 3 x 30; over 4 GPUs x 125 s: 450 / 500.
    report = Report.of("fifo", list(schedule.values()), GPUS4)
    assert (report.utilization, report.resizes, report.preemptions) == (0.9, 1, 0)
    # Alone on the cluster it starts whole: one piece, at 4 workers.
    alone = simulate([_elastic("E", 5, 100, min_workers=1)], Fifo(), GPUS4)
    assert (alone[0].pieces, alone[0].sizes) == (((5, 105),), (4,))


@pytest.mark.timeout(10)
def test_with_a_cost_a_shrink_is_at_once_and_a_growth_waits_for_a_checkpoint() -> None:
    # A resize costs what a preemption does (5 s restart here). E (4 workers down to 2, 100 s,
    # a checkpoint each 10 s) holds all 4 GPUs; G (2 GPUs) comes at 15. E shrinks at once,
    # back to its checkpoint at 10 (5 s of work on the whole gang lost), restarts on 2 workers
    # (5 s on half the gang: 2.5 lost) and runs its 90 s left at half speed: 15 + 5 + 180 = 200.
    # G starts in the room at once: 15-35.
    cost = PreemptionCost(restart_s=5)
    trace = [_elastic("E", 0, 100, min_workers=2), _fixed("G", 15, 20, 2)]
    schedule = {s.job.id: s for s in simulate(trace, Fifo(), GPUS4, cost=cost)}
    assert schedule["G"].pieces == ((15, 35),)
    assert (schedule["E"].pieces, schedule["E"].sizes) == (((0, 15), (15, 200)), (4, 2))
    assert schedule["E"].lost_s == 7.5
    # A growth gives nothing up: as in the test above E grows at its checkpoint at 45, losing
    # only the restart (5 s on the whole gang), and its 80 s left end at 45 + 5 + 80 = 130.
    trace = [_fixed("F", 0, 30, 3), _elastic("E", 5, 100, min_workers=1, scaling=0.5)]
    schedule = {s.job.id: s for s in simulate(trace, Fifo(), GPUS4, cost=cost)}
    assert schedule["E"].pieces == ((5, 45), (45, 130))
    assert (schedule["E"].sizes, schedule["E"].lost_s) == ((1, 4), 5.0)


@pytest.mark.timeout(10)
def test_an_elastic_job_shrinks_for_a_higher_priority_arrival_and_grows_back() -> None:
    # E (4 workers down to 2, linear, 2000 s of work, a checkpoint each 100 s) starts whole at
    # 0. H (priority 2, 2 GPUs, 200 s) comes at 150: E is asked to give 2 workers back at its
    # next checkpoint (200), not to stop. E restarts on 2 workers at 200 (half speed), H runs
    # 200-400. At 400 room is back but E's restarted attempt may be stopped again only after
    # 600 s (MIN_RUN_BEFORE_PREEMPTION_S) and at a checkpoint: at 800 (500 s of work done,
    # one each 200 s at half speed) it grows to 4 and runs its 1500 s left: 800-2300.
    elastic = _elastic("E", 0, 2000, min_workers=2, checkpoint_s=100)
    high = _fixed("H", 150, 200, 2, priority=2)
    schedule = {s.job.id: s for s in simulate([elastic, high], PriorityAging(), GPUS4)}
    assert schedule["E"].pieces == ((0, 200), (200, 800), (800, 2300))
    assert (schedule["E"].sizes, schedule["E"].resizes, schedule["E"].preemptions) == (
        (4, 2, 4), 2, 0)
    assert schedule["H"].pieces == ((200, 400),)
    # As a fixed gang E is preempted whole instead: H runs 200-400, E waits, ends at 2200.
    fixed = TraceJob("E", 0, 2000, Resources(cpus=4, gpus=4), "a", checkpoint_s=100,
                     workers=4)
    schedule = {s.job.id: s for s in simulate([fixed, high], PriorityAging(), GPUS4)}
    assert schedule["E"].pieces == ((0, 200), (400, 2200))
    assert (schedule["E"].preemptions, schedule["E"].resizes) == (1, 0)


@pytest.mark.timeout(10)
def test_a_fixed_gang_starts_when_an_elastic_job_shrinks_which_no_preemption_would_do() -> None:
    # G (2 GPUs, same priority: never a reason to preempt) comes at 15 while E holds all 4.
    # E shrinks to 2 at its next checkpoint (20) and runs its 80 s left at half speed
    # (20-180); G runs 20-40. E's restarted attempt is too young to grow back before it ends.
    trace = [_elastic("E", 0, 100, min_workers=2), _fixed("G", 15, 20, 2)]
    schedule = {s.job.id: s for s in simulate(trace, Fifo(), GPUS4)}
    assert schedule["G"].pieces == ((20, 40),)
    assert (schedule["E"].pieces, schedule["E"].sizes) == (((0, 20), (20, 180)), (4, 2))
    # With E a fixed gang, G waits for it to end.
    trace[0] = TraceJob("E", 0, 100, Resources(cpus=4, gpus=4), "a", checkpoint_s=10)
    assert {s.job.id: s.pieces for s in simulate(trace, Fifo(), GPUS4)} == {
        "E": ((0, 100),), "G": ((100, 120),)}


@pytest.mark.timeout(10)
def test_elastic_jobs_on_a_generated_trace_do_all_their_work_within_capacity() -> None:
    capacity = Resources(cpus=64, gpus=16)
    trace = [job if job.needs.gpus < 2 or index % 2 else
             TraceJob(job.id, job.submit_s, job.duration_s, job.needs, job.team, job.priority,
                      job.estimate_s, job.checkpoint_s, workers=int(job.needs.gpus),
                      min_workers=int(job.needs.gpus) // 2, scaling=0.8)
             for index, job in enumerate(generate_trace(200, seed=1, gpus=16,
                                                        checkpoint_s=600))]
    for name in ("fifo", "priority", "backfill-sjf"):
        schedule = simulate(trace, make_policy(name), capacity)
        assert sum(s.resizes for s in schedule) > 0, name
        events = []
        for s in schedule:
            sizes = s.sizes or (s.job.workers,) * len(s.pieces)
            work = sum((end - start) * s.job.elasticity.speed(size)
                       for (start, end), size in zip(s.pieces, sizes, strict=True))
            assert abs(work - s.job.duration_s) < 1e-6 * max(s.job.duration_s, 1), name
            for (start, end), size in zip(s.pieces, sizes, strict=True):
                gpus = s.job.needs.gpus * size / s.job.workers
                events += [(end, -gpus), (start, gpus)]
        held = 0.0
        for _, delta in sorted(events):
            held += delta
            assert held <= capacity.gpus + 1e-6, name
    # With a cost and a linear curve, the GPU-time that bought progress is the job's work at
    # full size, however often it was resized: what each resize lost is counted exactly.
    linear = [dataclasses.replace(job, scaling=1.0) for job in trace]
    schedule = simulate(linear, make_policy("priority"), capacity, cost=PreemptionCost())
    assert sum(s.resizes for s in schedule) > 0 and sum(s.lost_s for s in schedule) > 0
    for s in schedule:
        assert abs(s.useful_s - s.job.duration_s) < 1e-6 * max(s.job.duration_s, 1), s.job.id


@pytest.mark.timeout(10)
def test_the_elastic_columns_round_trip_and_bad_values_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    trace = [_fixed("F", 0, 30, 3), _elastic("E", 5, 100, min_workers=1, scaling=0.5)]
    write_trace(trace, path)
    assert path.read_text().splitlines()[0].endswith(",workers,min_workers,scaling")
    assert [(j.id, j.workers, j.min_workers, j.scaling, j.elasticity)
            for j in read_trace(path)] == [("F", 1, None, 1.0, Elasticity(1, 1, 1.0)),
                                            ("E", 4, 1, 0.5, Elasticity(4, 1, 0.5))]
    header = "submit_s,duration_s,team,gpus,checkpoint_s,workers,min_workers,scaling\n"
    for row, error in (("0,10,a,4,5,4,5,1", r"min_workers=5: must be between 1 and workers=4"),
                       ("0,10,a,4,5,0,,1", r"workers=0: must be >= 1"),
                       ("0,10,a,4,5,4,2,1.5", r"scaling=1.5: must be between 0 and 1"),
                       ("0,10,a,4,,4,2,1", r"min_workers=2 < workers=4 needs checkpoint_s"),
                       ("0,10,a,4,5,four,2,1", "line 2")):
        path.write_text(header + row + "\n")
        with pytest.raises(ConfigError, match=error):
            read_trace(path)
