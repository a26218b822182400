"""ASHA against FIFO on the same digits sweep: wall time, trial-iterations, best accuracy.

Both sweeps use the same search space (jobs/sweep_digits.yaml), seed, trial count and per-trial
resources, on a local 2-CPU Ray instance with tracking into an embedded MLflow. Each Tune
iteration trains ``--epochs-per-iteration`` epochs, so an iteration carries enough work that
the benchmark measures scheduling, not trial start-up. Also reports the per-trial start-up
overhead: wall time x concurrency, minus the time trials spent iterating, per trial.

Run: ``.venv/bin/python benchmarks/asha_vs_fifo.py``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CPUS = 2


def run(scheduler: str, args: argparse.Namespace, trials: int | None = None
        ) -> tuple[float, int, float, float]:
    """Wall time, trial-iterations, best score and per-trial start-up overhead of one sweep."""
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
    iterating_s = sum(t.time_total_s for t in result.trials)
    overhead_s = max(0.0, result.wall_time_s * CPUS - iterating_s) / len(result.trials)
    return result.wall_time_s, result.trial_iterations, result.best_score, overhead_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--max-t", type=int, default=16)
    parser.add_argument("--reduction-factor", type=float, default=4.0)
    parser.add_argument("--epochs-per-iteration", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import ray

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

    rows = [("ASHA", *asha), ("FIFO", *fifo)]
    print(f"\n{args.trials} trials x {args.max_t} iterations x {args.epochs_per_iteration} "
          f"epochs, {CPUS} CPUs, ASHA grace 1, reduction factor {args.reduction_factor:g}")
    print(f"{'scheduler':<10} {'wall s':>8} {'trial-iters':>12} {'best val acc':>13} "
          f"{'start-up s/trial':>17}")
    for name, wall, iterations, best, overhead in rows:
        print(f"{name:<10} {wall:>8.1f} {iterations:>12d} {best:>13.4f} {overhead:>17.2f}")
    print(f"ASHA/FIFO: wall {asha[0] / fifo[0]:.2f}, trial-iterations {asha[1] / fifo[1]:.2f}, "
          f"best accuracy {100 * (asha[2] - fifo[2]):+.2f} points")


if __name__ == "__main__":
    main()
