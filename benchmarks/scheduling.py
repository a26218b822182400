"""Scheduling policies on a heavy-tailed trace: completion time, waits, utilization, fairness.

Replays one trace (a seeded synthetic one, or ``--trace`` your own cluster's CSV, format in
``raydeck.scheduling.simulator``) through every policy with the simulator, which drives the
same policy objects the queue uses, and prints per policy: average and p95 job completion time
(JCT), average queueing delay, the longest wait, GPU utilization over the replay, Jain's
fairness index across teams (of their mean slowdown), the top priority's average wait, the
preemptions, and average JCT as a ratio of FIFO's. FIFO with head-of-line blocking is what a
shared Ray cluster does today (its job server starts jobs in submission order as resources
allow). The last row replays priority again with every job checkpointing each
``--checkpoint-minutes`` of work, so the policy preempts lower priorities for a waiting job.

Run: ``.venv/bin/python benchmarks/scheduling.py`` (seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from raydeck.scheduling import Report, Resources, generate_trace, make_policy, read_trace, simulate

POLICIES = ("fifo", "priority", "fairshare", "sjf", "backfill", "backfill-sjf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, help="a trace CSV (default: a generated one)")
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpus", type=float, default=16)
    parser.add_argument("--cpus", type=float, default=128)
    parser.add_argument("--load", type=float, default=0.9, help="offered GPU load")
    parser.add_argument("--aging-hours", type=float, default=4.0)
    parser.add_argument("--checkpoint-minutes", type=float, default=10.0,
                        help="work between checkpoints in the preempting replay")
    args = parser.parse_args()

    capacity = Resources(cpus=args.cpus, gpus=args.gpus)
    trace = (read_trace(args.trace) if args.trace else
             generate_trace(args.jobs, seed=args.seed, gpus=args.gpus, load=args.load))
    source = args.trace or f"generated: {args.jobs} jobs, seed {args.seed}, load {args.load}"
    print(f"trace {source}; cluster {args.gpus:g} GPU, {args.cpus:g} CPU; aging bound "
          f"{args.aging_hours:g} h")
    print(f"{'policy':<16} {'avg JCT':>9} {'p95 JCT':>9} {'avg wait':>9} {'longest':>9} "
          f"{'util':>6} {'Jain':>6} {'top wait':>9} {'preempt':>8} {'JCT/FIFO':>9} "
          f"{'replay':>7}")
    checkpointed = [job if job.checkpoint_s else
                    dataclasses.replace(job, checkpoint_s=args.checkpoint_minutes * 60)
                    for job in trace]
    fifo = None
    for name, jobs in [*((name, trace) for name in POLICIES),
                       ("priority+preempt", checkpointed)]:
        started = time.perf_counter()
        schedule = simulate(jobs, make_policy(name.removesuffix("+preempt"),
                                              aging_s=args.aging_hours * 3600), capacity)
        elapsed = time.perf_counter() - started
        report = Report.of(name, schedule, capacity)
        fifo = fifo or report
        print(f"{name:<16} {report.avg_completion_s / 60:8.1f}m"
              f" {report.p95_completion_s / 60:8.1f}m {report.avg_wait_s / 60:8.1f}m"
              f" {report.longest_wait_s / 3600:8.1f}h"
              f" {report.utilization:6.2f} {report.fairness:6.3f}"
              f" {report.top_priority_wait_s / 60:8.1f}m {report.preemptions:8d}"
              f" {report.avg_completion_s / fifo.avg_completion_s:9.2f} {elapsed:6.2f}s")


if __name__ == "__main__":
    main()
