"""Sweep the digits classifier (ASHA, FIFO or PBT); each trial a child run, the best registered.

Locally:          python jobs/sweep_digits.py --num-samples 16
On a cluster:     ray job submit --runtime-env runtime_envs/cpu.yaml --working-dir . -- \\
                      python jobs/sweep_digits.py --name nightly-sweep
After a crash:    python jobs/sweep_digits.py --name nightly-sweep --resume

The search space is jobs/sweep_digits.yaml; the trial function is
``raydeck.examples.digits.sweep_trial``, which reports each iteration with
``raydeck.tune.report(metrics, model=..., optimizer=...)``.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from raydeck.examples.digits import digits_sweep_job
from raydeck.tune import SearchSpace, SweepConfig, sweep

SPACE = Path(__file__).with_name("sweep_digits.yaml")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # `raydeck submit` passes its preset and run name as RAYDECK_PRESET and RAYDECK_RUN_NAME.
    parser.add_argument("--name", default=os.environ.get("RAYDECK_RUN_NAME") or "digits-sweep")
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--max-t", type=int, default=8)
    parser.add_argument("--grace-period", type=int, default=1)
    parser.add_argument("--reduction-factor", type=float, default=2.0)
    parser.add_argument("--scheduler", default="asha", choices=["asha", "fifo", "pbt"])
    parser.add_argument("--preset", default=os.environ.get("RAYDECK_PRESET") or "cpu-1")
    parser.add_argument("--register-as", default="digits-classifier")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    config = SweepConfig(
        name=args.name, num_samples=args.num_samples, max_t=args.max_t,
        grace_period=args.grace_period, reduction_factor=args.reduction_factor,
        scheduler=args.scheduler, preset=args.preset, register_model_as=args.register_as or None,
    )
    result = sweep(digits_sweep_job(), SearchSpace.from_yaml(SPACE), config, resume=args.resume)
    logging.info("best trial %s: %s %.4f, config %s; sweep run %s; model %s",
                 result.best_trial_id, result.best_metric, result.best_score, result.best_config,
                 result.parent_run_id, result.registered_model_uri)


if __name__ == "__main__":
    main()
