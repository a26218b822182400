"""ASHA against FIFO on the same digits sweep: wall time, trial-iterations, idle slots, start-up.

Both sweeps use the same search space (jobs/sweep_digits.yaml), seed, trial count and per-trial
resources, on a local 2-CPU Ray instance with tracking into an embedded MLflow. Each Tune
iteration trains ``--epochs-per-iteration`` epochs, so an iteration carries enough work that
the benchmark measures scheduling, not trial start-up. For each scheduler it prints what the
sweep itself measures (``SweepResult.slot_usage``): the mean per-trial start-up (from a trial's
start to its first result, minus one iteration) and the fraction of slot-time (wall time of
the tuning loop x concurrent trials) in which no trial held a slot. The machine's load average
is printed with the figures: other processes on the machine slow everything down.

Run: ``.venv/bin/python benchmarks/asha_vs_fifo.py``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CPUS = 2


@dataclass(frozen=True)
class Measured:
    wall_s: float
    trial_iterations: int
    best_score: float
    startup_s: float
    idle_fraction: float


def run(scheduler: str, args: argparse.Namespace, trials: int | None = None) -> Measured:
    """One sweep of the digits job with ``scheduler``."""
    from raydeck.examples.digits import digits_sweep_job
    from raydeck.tune import SearchSpace, SweepConfig, sweep

    space = SearchSpace.from_yaml(REPO / "jobs" / "sweep_digits.yaml")
    space = SearchSpace(space.dimensions,
                        {**space.constants, "epochs_per_iteration": args.epochs_per_iteration})
    config = SweepConfig(
        name=f"bench-{scheduler}-{uuid.uuid4().hex[:6]}", scheduler=scheduler,
        num_samples=trials or args.trials, max_t=args.max_t, grace_period=1,
        reduction_factor=args.reduction_factor, seed=args.seed, preset="cpu-1",
    )
    result = sweep(digits_sweep_job(), space, config)
    usage = result.slot_usage
    assert usage is not None
    return Measured(result.wall_time_s, result.trial_iterations, result.best_score,
                    usage.startup_s, usage.idle_fraction)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--max-t", type=int, default=16)
    parser.add_argument("--reduction-factor", type=float, default=4.0)
    parser.add_argument("--epochs-per-iteration", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import ray

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="raydeck-asha-") as tmp:
        os.environ.update({
            "RAYDECK_DATA_DIR": str(Path(tmp) / "data"),
            "RAYDECK_TRACKING_SYSTEM_METRICS_INTERVAL_S": "0",
            "RAY_AUTH_MODE": "disabled",
        })
        ray.init(address="local", num_cpus=CPUS, include_dashboard=False, log_to_driver=False)
        try:
            run("fifo", args, trials=2)  # warm-up: the tracking proxy and Tune start once
            asha = run("asha", args)
            fifo = run("fifo", args)
        finally:
            ray.shutdown()
    load_after = os.getloadavg()

    print(f"\n{args.trials} trials x {args.max_t} iterations x {args.epochs_per_iteration} "
          f"epochs, {CPUS} CPUs, ASHA grace 1, reduction factor {args.reduction_factor:g}; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
          f"({os.cpu_count()} cores)")
    print(f"{'scheduler':<10} {'wall s':>8} {'trial-iters':>12} {'idle slots':>11} "
          f"{'start-up s/trial':>17} {'best val acc':>13}")
    for name, m in (("ASHA", asha), ("FIFO", fifo)):
        print(f"{name:<10} {m.wall_s:>8.1f} {m.trial_iterations:>12d} "
              f"{100 * m.idle_fraction:>10.1f}% {m.startup_s:>17.2f} {m.best_score:>13.4f}")
    print(f"ASHA/FIFO: wall {asha.wall_s / fifo.wall_s:.2f}, trial-iterations "
          f"{asha.trial_iterations / fifo.trial_iterations:.2f}, best accuracy "
          f"{100 * (asha.best_score - fifo.best_score):+.2f} points")


if __name__ == "__main__":
    main()
