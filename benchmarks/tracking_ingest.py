"""How fast metric points reach MLflow: raydeck's proxy against the naive ways, in one run.

Measures, against one local ``mlflow server`` (SQLite, 1 worker) started here:
  (a) one REST ``runs/log-metric`` POST per point (the usual workaround from Ray workers);
  (b) ``MlflowClient.log_batch`` with 1,000 metrics per call straight to the server (the ceiling);
  (c) raydeck end to end: 2 and 4 Ray workers logging as fast as they can, timed until every
      point is in MLflow (``finish()`` returned);
  (d) the caller-side cost of one ``log_metrics`` call with one value, against one
      fire-and-forget Ray actor call.
Prints a table and every ratio. Run: ``.venv/bin/python benchmarks/tracking_ingest.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures.mlflow_server import MlflowServer  # noqa: E402

REST_POINTS = 300
BATCH_CALLS = 20
BATCH_SIZE = 1000
CALL_COST_SAMPLES = 200_000
ACTOR_CALL_SAMPLES = 2_000


def rest_per_point(uri: str, run_id: str) -> float:
    import requests

    session = requests.Session()
    started = time.perf_counter()
    for step in range(REST_POINTS):
        answer = session.post(f"{uri}/api/2.0/mlflow/runs/log-metric", json={
            "run_id": run_id, "key": "rest", "value": float(step),
            "timestamp": int(time.time() * 1000), "step": step,
        }, timeout=30)
        answer.raise_for_status()
    return REST_POINTS / (time.perf_counter() - started)


def log_batch_ceiling(uri: str, run_id: str) -> float:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    now = int(time.time() * 1000)
    started = time.perf_counter()
    for call in range(BATCH_CALLS):
        client.log_batch(run_id, metrics=[
            Metric("batch", float(i), now, call * BATCH_SIZE + i) for i in range(BATCH_SIZE)
        ], synchronous=True)
    return BATCH_CALLS * BATCH_SIZE / (time.perf_counter() - started)


def raydeck_end_to_end(workers: int, points_per_worker: int) -> tuple[float, float]:
    """Points/s until landed, and the mean caller-side microseconds per log call in workers."""
    import ray

    import raydeck

    key = f"bench-{workers}w-{uuid.uuid4().hex[:6]}"
    driver = raydeck.get_tracker(key, run_name=f"ingest-{workers}-workers")

    @ray.remote(num_cpus=0)
    class Worker:
        def setup(self, key: str) -> None:
            self.tracker = raydeck.get_tracker(key)

        def log(self, index: int, points: int) -> float:
            name = f"w{index}/x"
            started = time.perf_counter()
            for step in range(points):
                self.tracker.log_metrics({name: float(step)}, step=step)
            per_call_us = (time.perf_counter() - started) / points * 1e6
            self.tracker.finish()
            return per_call_us

    actors = [Worker.remote() for _ in range(workers)]
    ray.get([a.setup.remote(key) for a in actors])
    started = time.perf_counter()
    costs = ray.get([a.log.remote(i, points_per_worker) for i, a in enumerate(actors)])
    driver.finish()
    elapsed = time.perf_counter() - started
    for actor in actors:
        ray.kill(actor)
    return workers * points_per_worker / elapsed, sum(costs) / len(costs)


def call_costs() -> tuple[float, float]:
    """Microseconds per call: tracker.log_metrics (one value) and a fire-and-forget actor call."""
    import ray

    import raydeck

    tracker = raydeck.get_tracker(run_name="call-cost")
    started = time.perf_counter()
    for step in range(CALL_COST_SAMPLES):
        tracker.log_metrics({"cost": 0.5}, step=step)
    log_us = (time.perf_counter() - started) / CALL_COST_SAMPLES * 1e6
    tracker.finish()

    @ray.remote(num_cpus=0)
    class Sink:
        def put(self, key: str, value: float, step: int) -> None:
            return None

        def ready(self) -> bool:
            return True

    sink = Sink.remote()
    ray.get(sink.ready.remote())
    started = time.perf_counter()
    refs = [sink.put.remote("cost", 0.5, step) for step in range(ACTOR_CALL_SAMPLES)]
    actor_us = (time.perf_counter() - started) / ACTOR_CALL_SAMPLES * 1e6
    ray.get(refs)
    ray.kill(sink)
    return log_us, actor_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points-per-worker", type=int, default=25_000)
    args = parser.parse_args()

    import logging

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="raydeck-bench-") as tmp:
        server = MlflowServer(Path(tmp) / "mlflow").start()
        os.environ.update({
            "RAYDECK_TRACKING_URI": server.uri,
            "RAYDECK_DATA_DIR": str(Path(tmp) / "data"),
            "RAYDECK_RAY_NAMESPACE": f"raydeck-bench-{uuid.uuid4().hex[:6]}",
            "RAYDECK_TRACKING_SYSTEM_METRICS_INTERVAL_S": "0",
            "RAYDECK_TRACKING_CAPTURE_LOGS": "false",
            "RAY_AUTH_MODE": "disabled",
        })
        try:
            import ray
            from mlflow.tracking import MlflowClient

            from raydeck.cluster import connect

            client = MlflowClient(server.uri)
            experiment = client.create_experiment("bench-baselines")
            run_id = client.create_run(experiment).info.run_id
            rest = rest_per_point(server.uri, run_id)
            ceiling = log_batch_ceiling(server.uri, run_id)
            ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {k: v for k, v in os.environ.items()
                                               if k.startswith("RAYDECK_")}})
            connect()
            raydeck_end_to_end(1, 1000)  # warm-up: the proxy's actors start once
            results = {w: raydeck_end_to_end(w, args.points_per_worker) for w in (2, 4)}
            log_us, actor_us = call_costs()
        finally:
            ray.shutdown()
            server.stop()

    rows = [
        ("(a) REST POST per point", f"{rest:,.0f} points/s", ""),
        ("(b) log_batch x1000, direct (ceiling)", f"{ceiling:,.0f} points/s",
         f"{ceiling / rest:.0f}x (a)"),
    ]
    for workers, (rate, worker_us) in results.items():
        rows.append((f"(c) raydeck, {workers} Ray workers", f"{rate:,.0f} points/s",
                     f"{rate / ceiling:.0%} of (b), {rate / rest:.0f}x (a); "
                     f"{worker_us:.1f} us/call in workers"))
    rows.append(("(d) log_metrics, 1 value, caller side", f"{log_us:.2f} us/call",
                 f"{actor_us / log_us:.0f}x cheaper than an actor call"))
    rows.append(("(d) fire-and-forget actor call", f"{actor_us:.1f} us/call", ""))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'measure':<{width}}  {'result':>18}  ratio")
    for name, value, ratio in rows:
        print(f"{name:<{width}}  {value:>18}  {ratio}")


if __name__ == "__main__":
    main()
