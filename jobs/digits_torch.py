"""Train the digits classifier with plain PyTorch on Ray Train, tracked in MLflow.

Locally:          python jobs/digits_torch.py --epochs 5
On a cluster:     ray job submit --runtime-env runtime_envs/cpu.yaml --working-dir . -- \
                      python jobs/digits_torch.py --preset cpu-2 --run-name nightly

The training loop itself is ``raydeck.examples.digits.train_loop_per_worker``: it gets its
tracker with ``raydeck.get_tracker()`` (no run id passed around), restores the latest checkpoint
after a failure, and reports every epoch with ``raydeck.checkpointing.report_epoch`` so each
epoch appears once in MLflow. Copy it as the starting point of your own job.
"""

from __future__ import annotations

import argparse
import logging

from raydeck.examples.digits import DEFAULT_CONFIG, run_digits


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu-2", help="scaling preset (raydeck presets)")
    parser.add_argument("--run-name", default="digits-torch", help="MLflow run name")
    parser.add_argument("--run-id", default=None,
                        help="shared run id: resume or join this run (default RAYDECK_RUN_ID)")
    parser.add_argument("--mode", default=None, choices=["rank_zero", "all_ranks", "per_rank"],
                        help="tracking mode (default RAYDECK_TRACKING_MODE)")
    for name, default in DEFAULT_CONFIG.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    return parser.parse_args()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args()
    config = {name: getattr(args, name) for name in DEFAULT_CONFIG}
    run = run_digits(preset=args.preset, config=config, run_name=args.run_name,
                     run_id=args.run_id, mode=args.mode)
    logging.info("MLflow run %s (%s): val_accuracy %.3f in %.0f s; tracking URI %s",
                 run.run_id, run.run_name, run.val_accuracy, run.wall_time_s, run.tracking_uri)


if __name__ == "__main__":
    main()
