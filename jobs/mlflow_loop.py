"""A training loop that logs with plain MLflow and imports nothing of raydeck: the code a team
already has. Pointing ``MLFLOW_TRACKING_URI`` at ``raydeck+<their server>`` is the only change.

Locally:       MLFLOW_TRACKING_URI=raydeck+http://mlflow:5000 python jobs/mlflow_loop.py
On a cluster:  ray job submit --working-dir jobs --runtime-env-json \\
                   '{"env_vars": {"MLFLOW_TRACKING_URI": "raydeck+http://mlflow:5000"}}' \\
                   -- python mlflow_loop.py --steps 200

It prints ``RUN <id>`` once the run exists, ``STEP <n>`` after logging each step, ``LOOPED``
after the last one and ``ENDED`` once ``mlflow.end_run()`` returned (the tests read these).
"""

from __future__ import annotations

import argparse
import math
import time

import mlflow

KEYS = ("loss", "accuracy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-time-s", type=float, default=0.0,
                        help="seconds each step's training takes (simulated)")
    parser.add_argument("--run-name", default="mlflow-loop")
    args = parser.parse_args()
    with mlflow.start_run(run_name=args.run_name) as run:
        print("RUN", run.info.run_id, flush=True)
        mlflow.log_params({"steps": args.steps, "lr": 0.1})
        mlflow.set_tag("example", "mlflow_loop")
        for step in range(args.steps):
            time.sleep(args.step_time_s)
            loss = math.exp(-step / 50)
            mlflow.log_metric("loss", loss, step=step)
            mlflow.log_metric("accuracy", 1 - loss, step=step)
            print("STEP", step, flush=True)
        print("LOOPED", flush=True)
    print("ENDED", flush=True)


if __name__ == "__main__":
    main()
