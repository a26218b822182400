"""Scheduling policies on a heavy-tailed trace: completion time, waits, utilization, fairness.

Replays a seeded synthetic trace and each public trace in ``benchmarks/traces/`` (source,
licence and conversion in its README; each on its own cluster size), or only ``--trace`` (your
own cluster's CSV, format in ``raydeck.scheduling.simulator.trace``), through every policy with the
simulator, which drives the same policy objects the queue uses, and prints per policy: average
and p95 job completion time (JCT), average queueing delay, the longest wait, GPU utilization
over the replay, Jain's fairness index across teams (of their mean slowdown), the top priority's
average wait, the preemptions, and average JCT as a ratio of FIFO's. FIFO with head-of-line
blocking is what a shared Ray cluster does today (its job server starts jobs in submission order
as resources allow). The last row replays priority again with every job checkpointing each
``--checkpoint-minutes`` of work, so the policy preempts lower priorities for a waiting job.

A second table compares the attained-service policies (``las``, ``gittins``: no estimates, they
preempt at checkpoints) with the estimate-driven ones on two traces: the same trace, and one
whose estimates are off by a log-normal factor of sigma ``--estimate-error``, seeded with
``--seed`` (so SJF and backfill face realistic predictions;
:mod:`raydeck.scheduling.simulator.comparison`). Preemptions there cost what they cost a real job
(the work since the last checkpoint and a restart, ``PreemptionCost``); columns: preemptions per
job, GPU-hours lost to them, and average JCT relative to FIFO and to backfill-SJF with perfect
estimates. ``las``' levels adapt to the ended jobs' services and Gittins ranks over them: they
start from the services of another seeded trace (the cluster's history; on a public trace, from
nothing) and learn from the jobs that finish; ``las 1h,10h`` is ``las`` with Tiresias' fixed
levels. Other public traces (Philly, Helios, PAI) were not brought in: pass one converted to the
trace CSV with ``--trace``.

A third table replays each trace with elastic jobs (issue 29): ``--elastic-fraction`` of its
multi-GPU jobs (seeded) may run on as few as half their workers (one worker per GPU), at the
scaling curve ``(w / workers) ** --elastic-scaling`` of full speed (0.8 by default: half the
workers run at 57% of full speed, a data-parallel job's usual sublinear scaling). Every job
checkpoints each ``--checkpoint-minutes`` of work in both replays, so the fixed-gang replay is the
same trace with the same preemptions open to it; per policy, without a preemption cost and with
one: average JCT with fixed gangs and with elasticity and their ratio, GPU utilization and
preemptions of both, the elastic replay's resizes, and the GPU-hours lost to preemptions and
resizes (fixed / elastic).

Run: ``.venv/bin/python benchmarks/scheduling.py`` (about a minute; 53 s on this 2-core machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from dataclasses import dataclass
from pathlib import Path

from raydeck.scheduling import (
    PreemptionCost,
    Report,
    Resources,
    TraceJob,
    generate_trace,
    make_policy,
    read_trace,
    simulate,
)
from raydeck.scheduling.policies.attained_service import service_rate
from raydeck.scheduling.simulator import comparison
from raydeck.scheduling.simulator.comparison import ideal

POLICIES = ("fifo", "priority", "fairshare", "sjf", "backfill", "backfill-sjf")
TRACES = Path(__file__).parent / "traces"


@dataclass(frozen=True)
class PublicTrace:
    """A vendored trace replayed by default: its file in ``TRACES``, the GPUs of the cluster
    it is replayed on, and the work between its jobs' checkpoints (a trace has neither)."""

    file: str
    gpus: float
    checkpoint_minutes: float


# Tiresias' 60-job example: 26,624 GPU-s offered in its first 30 min (about 15 GPUs' worth),
# replayed on 8 GPUs so that jobs queue (on 16 almost none waits). Its jobs run 2-30 min: they
# checkpoint each minute, else none could be preempted.
PUBLIC_TRACES = (PublicTrace("tiresias_60_job.csv", gpus=8, checkpoint_minutes=1.0),)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path,
                        help="a trace CSV (default: a generated one, then the public ones)")
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpus", type=float, default=16)
    parser.add_argument("--cpus", type=float, default=128)
    parser.add_argument("--load", type=float, default=0.9, help="offered GPU load")
    parser.add_argument("--aging-hours", type=float, default=4.0)
    parser.add_argument("--checkpoint-minutes", type=float, default=10.0,
                        help="work between checkpoints in the preempting replay")
    parser.add_argument("--estimate-error", type=float, default=1.0,
                        help="sigma of the log-normal estimate error in the second trace")
    parser.add_argument("--elastic-fraction", type=float, default=0.5,
                        help="share of the multi-GPU jobs that are elastic in the third table")
    parser.add_argument("--elastic-scaling", type=float, default=0.8,
                        help="the elastic jobs' scaling exponent (1: linear)")
    args = parser.parse_args()

    aging_s = args.aging_hours * 3600
    if args.trace:
        replays = [(str(args.trace), read_trace(args.trace), args.gpus, args.checkpoint_minutes)]
    else:
        generated = generate_trace(args.jobs, seed=args.seed, gpus=args.gpus, load=args.load)
        replays = [(f"generated: {args.jobs} jobs, seed {args.seed}, load {args.load}",
                    generated, args.gpus, args.checkpoint_minutes),
                   *((f"public: {p.file}", read_trace(TRACES / p.file), p.gpus,
                      p.checkpoint_minutes) for p in PUBLIC_TRACES)]
    history = generate_trace(args.jobs, seed=args.seed + 1, gpus=args.gpus, load=args.load)
    for source, trace, gpus, checkpoint_minutes in replays:
        capacity = Resources(cpus=args.cpus, gpus=gpus)
        print(f"\ntrace {source}; cluster {gpus:g} GPU, {args.cpus:g} CPU; aging bound "
              f"{args.aging_hours:g} h; a checkpoint each {checkpoint_minutes:g} min of work")
        checkpointed = [job if job.checkpoint_s else
                        dataclasses.replace(job, checkpoint_s=checkpoint_minutes * 60)
                        for job in trace]
        policies(trace, checkpointed, capacity, aging_s)
        # las' and gittins' history: the generated cluster's, or none on a public trace.
        services = ([service_rate(job.needs) * job.duration_s for job in history]
                    if source.startswith("generated") else [])
        compare(checkpointed, capacity, aging_s, args.estimate_error, args.seed, services)
        elasticity(checkpointed, capacity, aging_s, args.elastic_fraction, args.elastic_scaling,
                   args.seed)


def policies(trace: list[TraceJob], checkpointed: list[TraceJob], capacity: Resources,
             aging_s: float) -> None:
    """The first table (module docstring): every policy on ``trace``, then priority with
    preemption on ``checkpointed``."""
    print(f"{'policy':<16} {'avg JCT':>9} {'p95 JCT':>9} {'avg wait':>9} {'longest':>9} "
          f"{'util':>6} {'Jain':>6} {'top wait':>9} {'preempt':>8} {'JCT/FIFO':>9} "
          f"{'replay':>7}")
    fifo = None
    for name, jobs in [*((name, trace) for name in POLICIES),
                       ("priority+preempt", checkpointed)]:
        started = time.perf_counter()
        schedule = simulate(jobs, make_policy(name.removesuffix("+preempt"), aging_s=aging_s),
                            capacity)
        elapsed = time.perf_counter() - started
        report = Report.of(name, schedule, capacity)
        fifo = fifo or report
        print(f"{name:<16} {report.avg_completion_s / 60:8.1f}m"
              f" {report.p95_completion_s / 60:8.1f}m {report.avg_wait_s / 60:8.1f}m"
              f" {report.longest_wait_s / 3600:8.1f}h"
              f" {report.utilization:6.2f} {report.fairness:6.3f}"
              f" {report.top_priority_wait_s / 60:8.1f}m {report.preemptions:8d}"
              f" {report.avg_completion_s / fifo.avg_completion_s:9.2f} {elapsed:6.2f}s")


def compare(trace: list[TraceJob], capacity: Resources, aging_s: float, error: float,
            seed: int, services: list[float]) -> None:
    """The second table (module docstring): ``trace`` has checkpoints; ``services`` are the
    cluster's past jobs' GPU-seconds, where las' levels and gittins start from."""
    cost = PreemptionCost()
    best = ideal(trace, capacity, aging_s, cost).avg_completion_s
    rows = comparison.compare(trace, capacity, aging_s, error, seed, services, cost)
    fifo = rows[0].report.avg_completion_s
    print(f"\npreemption cost: work since the last checkpoint + {cost.restart_s:g} s restart; "
          f"JCT/ideal: over backfill-sjf with perfect estimates; fifo, las and gittins read no "
          f"estimates (one row)")
    print(f"{'estimates':<11} {'policy':<13} {'avg JCT':>9} {'p95 JCT':>9} {'avg wait':>9} "
          f"{'preempt/job':>11} {'GPU-h lost':>10} {'JCT/FIFO':>9} {'JCT/ideal':>9}")
    for row in rows:
        report = row.report
        print(f"{row.estimates:<11} {row.policy:<13} {report.avg_completion_s / 60:8.1f}m"
              f" {report.p95_completion_s / 60:8.1f}m {report.avg_wait_s / 60:8.1f}m"
              f" {report.preemptions / report.jobs:11.2f} {report.lost_gpu_hours:10.1f}"
              f" {report.avg_completion_s / fifo:9.2f} {report.avg_completion_s / best:9.2f}")


def elastic_variant(trace: list[TraceJob], fraction: float, scaling: float,
                    seed: int) -> list[TraceJob]:
    """``trace`` (every job checkpointing) with ``fraction`` of its multi-GPU jobs, drawn with
    ``seed``, elastic: one worker per GPU, down to half of them, at ``scaling``."""
    rng = random.Random(seed)
    return [dataclasses.replace(job, workers=int(job.needs.gpus),
                                min_workers=int(job.needs.gpus) // 2, scaling=scaling)
            if job.needs.gpus >= 2 and job.needs.gpus == int(job.needs.gpus)
            and rng.random() < fraction else job
            for job in trace]


def elasticity(trace: list[TraceJob], capacity: Resources, aging_s: float, fraction: float,
               scaling: float, seed: int) -> None:
    """The third table (module docstring): each policy on ``trace`` (every job checkpointing)
    with fixed gangs, then with elastic jobs; without a preemption cost, then with one."""
    elastic = elastic_variant(trace, fraction, scaling, seed)
    count = sum(job.elasticity.elastic for job in elastic)
    print(f"\nelastic: {count} of {len(trace)} jobs ({fraction:g} of the multi-GPU ones), "
          f"down to half their workers, speed (w/workers)**{scaling:g}; cost: none, or the "
          f"work since the last checkpoint + {PreemptionCost().restart_s:g} s restart per "
          "preemption or resize")
    print(f"{'policy':<13} {'cost':<5} {'avg JCT':>9} {'elastic':>9} {'ratio':>6} {'util':>6} "
          f"{'elastic':>7} {'preempt':>8} {'elastic':>8} {'resizes':>8} {'GPU-h lost':>10}")
    for name in (*POLICIES, "las"):
        for cost in (None, PreemptionCost()):
            fixed, grown = (Report.of(name, simulate(jobs, make_policy(name, aging_s=aging_s),
                                                     capacity, cost=cost), capacity)
                            for jobs in (trace, elastic))
            print(f"{name:<13} {'yes' if cost else 'no':<5} {fixed.avg_completion_s / 60:8.1f}m"
                  f" {grown.avg_completion_s / 60:8.1f}m"
                  f" {grown.avg_completion_s / fixed.avg_completion_s:6.2f}"
                  f" {fixed.utilization:6.2f} {grown.utilization:7.2f}"
                  f" {fixed.preemptions:8d} {grown.preemptions:8d} {grown.resizes:8d}"
                  f" {fixed.lost_gpu_hours:4.0f}/{grown.lost_gpu_hours:<5.0f}")

if __name__ == "__main__":
    main()
