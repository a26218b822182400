"""Existing MLflow code with only its tracking URI changed: plain, MLflow's async, raydeck+.

One process runs the same ``mlflow.log_metric`` loop (10 metrics per step, one call per value,
``step=`` given) against a local ``mlflow server`` (SQLite, 1 worker, as the embedded default)
started here, with the tracking URI set to:
  (a) the plain server URI (one REST request per call);
  (b) the plain server URI with MLflow's async logging on (``MLFLOW_ENABLE_ASYNC_LOGGING``);
  (c) ``raydeck+<server URI>``: the raydeck plugin (tracker, proxy, spool);
  (d) the same with ``MLFLOW_REGISTRY_URI`` set, which skips MLflow's own per-call probe for a
      Spark session (a failed ``import pyspark`` on every ``MlflowClient()`` it builds per call).
For each: the caller's cost per call (us, loop time / calls) and the end-to-end rate (points/s,
from the loop's start until ``mlflow.end_run()`` returned, when every point is in MLflow; the
count is checked through the server's REST API). Prints a table and the ratios to (a).

Run: ``.venv/bin/python benchmarks/mlflow_dropin.py`` (raydeck installed, so MLflow finds the
plugin's entry point).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures.mlflow_server import MlflowServer  # noqa: E402
from tests.fixtures.tracking import measured_tracking_env  # noqa: E402

from raydeck._internal.environ import environment  # noqa: E402

METRICS_PER_STEP = 10


@dataclass(frozen=True)
class Result:
    name: str
    calls: int
    caller_us: float
    points_per_s: float


def run_loop(name: str, tracking_uri: str, server_uri: str, steps: int,
             env: dict[str, str]) -> Result:
    """One ``start_run`` / loop / ``end_run`` with ``env`` set; checks every point landed."""
    import mlflow
    from mlflow.tracking import MlflowClient

    with environment(env):
        mlflow.set_tracking_uri(tracking_uri)
        keys = [f"metric_{k}" for k in range(METRICS_PER_STEP)]
        run = mlflow.start_run(run_name=f"dropin-{name}-{uuid.uuid4().hex[:4]}")
        started = time.perf_counter()
        for step in range(steps):
            for key in keys:
                mlflow.log_metric(key, step * 0.5, step=step)
        looped = time.perf_counter() - started
        mlflow.end_run()
        landed = time.perf_counter() - started
    calls = steps * METRICS_PER_STEP
    history = MlflowClient(server_uri).get_metric_history(run.info.run_id, keys[-1])
    if sorted(m.step for m in history) != list(range(steps)):
        raise AssertionError(f"{name}: {len(history)} of {steps} points of {keys[-1]} landed")
    return Result(name, calls, looped / calls * 1e6, calls / landed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plain-steps", type=int, default=40,
                        help="steps of (a) and (b): one REST request per value is slow")
    parser.add_argument("--raydeck-steps", type=int, default=1500, help="steps of (c), (d)")
    args = parser.parse_args()

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="raydeck-bench-") as tmp:
        root = Path(tmp)
        os.environ.update(measured_tracking_env(root / "data"))
        import ray

        from raydeck.cluster.connection import job_runtime_env
        from raydeck.config.settings import load_settings

        server = MlflowServer(root / "mlflow").start()
        try:
            os.environ["RAYDECK_TRACKING_URI"] = server.uri
            ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                     runtime_env=job_runtime_env(load_settings()))
            plugin = f"raydeck+{server.uri}"
            # Warm-up: the proxy's actors start once, as in any job after its first run.
            run_loop("warm-up", plugin, server.uri, 10, {})
            results = [
                run_loop("(a) plain URI", server.uri, server.uri, args.plain_steps, {}),
                run_loop("(b) plain URI, MLflow async", server.uri, server.uri,
                         args.plain_steps, {"MLFLOW_ENABLE_ASYNC_LOGGING": "true"}),
                run_loop("(c) raydeck+ URI", plugin, server.uri, args.raydeck_steps, {}),
                run_loop("(d) raydeck+ URI, MLFLOW_REGISTRY_URI set", plugin, server.uri,
                         args.raydeck_steps, {"MLFLOW_REGISTRY_URI": server.uri}),
            ]
        finally:
            ray.shutdown()
            server.stop()

    plain = results[0]
    width = max(len(r.name) for r in results)
    print(f"\n{'loop (10 metrics/step)':<{width}}  {'calls':>6}  {'caller us/call':>14}  "
          f"{'end-to-end points/s':>19}  ratios to (a)")
    for r in results:
        print(f"{r.name:<{width}}  {r.calls:>6}  {r.caller_us:>14.1f}  {r.points_per_s:>19,.0f}"
              f"  {plain.caller_us / r.caller_us:.1f}x cheaper per call, "
              f"{r.points_per_s / plain.points_per_s:.1f}x the rate")


if __name__ == "__main__":
    main()
