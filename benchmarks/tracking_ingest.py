"""How fast metric points reach MLflow: raydeck's proxy against the naive ways, in one run.

For each backend (MLflow on SQLite with 1 server worker, as the embedded default; MLflow on
PostgreSQL with 4 server workers, as production runs it), against a local ``mlflow server``
started here:
  (a) one REST ``runs/log-metric`` POST per point (the usual workaround from Ray workers);
  (b) ``MlflowClient.log_batch`` with 1,000 metrics per call from one client;
  (c) the same from N concurrent client processes: the server's real ceiling;
  (d) raydeck end to end: 2 and 4 Ray workers logging to one run as fast as they can, timed
      until every point is in MLflow (``finish()`` returned), through the server;
  (f) ``log_batch`` x1000 from one client through MLflow's own SQL store (no server);
  (h) the same through raydeck's bulk write into that store (what a direct shard's writer
      calls, ``raydeck.tracking.proxy.sql_batch``), with its CPU per point;
  (g) the same as (d) on the direct path: the shards write the server's database through
      MLflow's SQL store (``RAYDECK_TRACKING_WRITE_DB``), the server keeps reads and files.
And once: (e) the caller-side cost of one ``log_metrics`` call with one value, against one
fire-and-forget Ray actor call. Prints a table and every ratio.

Run: ``.venv/bin/python benchmarks/tracking_ingest.py [--backend sqlite|postgres|both]
[--points-per-worker N] [--skip-call-costs]``.
PostgreSQL needs Debian's ``postgresql`` package (README's first command installs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures.mlflow_server import MlflowServer  # noqa: E402
from tests.fixtures.postgres import PostgresServer  # noqa: E402
from tests.fixtures.tracking import measured_tracking_env  # noqa: E402

REST_POINTS = 300
BATCH_CALLS = 20
BATCH_SIZE = 1000
CONCURRENT_CLIENTS = 4
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


def _log_batches(uri: str, run_id: str, key: str, calls: int, bulk: bool = False) -> None:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from raydeck.tracking.proxy.sql_batch import SqlBatchWriter

    client: Any = SqlBatchWriter.for_uri(uri) if bulk else MlflowClient(uri)
    now = int(time.time() * 1000)
    for call in range(calls):
        client.log_batch(run_id, metrics=[
            Metric(key, float(i), now, call * BATCH_SIZE + i) for i in range(BATCH_SIZE)
        ], synchronous=True)


def log_batch_rate(uri: str, run_id: str, clients: int) -> float:
    """Points/s of ``clients`` processes each sending BATCH_CALLS x BATCH_SIZE points."""
    if clients == 1:
        started = time.perf_counter()
        _log_batches(uri, run_id, "batch", BATCH_CALLS)
        return BATCH_CALLS * BATCH_SIZE / (time.perf_counter() - started)
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_log_batches, args=(uri, run_id, f"batch{i}", BATCH_CALLS))
                 for i in range(clients)]
    started = time.perf_counter()
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    return clients * BATCH_CALLS * BATCH_SIZE / (time.perf_counter() - started)


def bulk_rate(uri: str, run_id: str) -> tuple[float, float]:
    """Points/s and CPU microseconds per point of one client's BATCH_CALLS x BATCH_SIZE points
    through raydeck's bulk write (this process; the store opened before the clock starts)."""
    from raydeck.tracking.proxy.sql_batch import SqlBatchWriter

    SqlBatchWriter.for_uri(uri)
    started, cpu = time.perf_counter(), time.process_time()
    _log_batches(uri, run_id, "bulk", BATCH_CALLS, bulk=True)
    points = BATCH_CALLS * BATCH_SIZE
    return (points / (time.perf_counter() - started),
            (time.process_time() - cpu) / points * 1e6)


def raydeck_end_to_end(settings: Any, workers: int, points_per_worker: int
                       ) -> tuple[float, float]:
    """Points/s until landed, and the mean caller-side microseconds per log call in workers."""
    import ray

    import raydeck

    key = f"bench-{workers}w-{uuid.uuid4().hex[:6]}"
    driver = raydeck.get_tracker(key, run_name=f"ingest-{workers}-workers", settings=settings)

    @ray.remote(num_cpus=0)
    class Worker:
        def setup(self, key: str, settings: Any) -> None:
            self.tracker = raydeck.get_tracker(key, settings=settings)

        def log(self, index: int, points: int) -> float:
            name = f"w{index}/x"
            started = time.perf_counter()
            for step in range(points):
                self.tracker.log_metrics({name: float(step)}, step=step)
            per_call_us = (time.perf_counter() - started) / points * 1e6
            self.tracker.finish()
            return per_call_us

    actors = [Worker.remote() for _ in range(workers)]
    ray.get([a.setup.remote(key, settings) for a in actors])
    started = time.perf_counter()
    costs = ray.get([a.log.remote(i, points_per_worker) for i, a in enumerate(actors)])
    driver.finish(timeout_s=600)
    elapsed = time.perf_counter() - started
    for actor in actors:
        ray.kill(actor)
    return workers * points_per_worker / elapsed, sum(costs) / len(costs)


def call_costs(settings: Any) -> tuple[float, float]:
    """Microseconds per call: tracker.log_metrics (one value) and a fire-and-forget actor call."""
    import ray

    import raydeck

    tracker = raydeck.get_tracker(run_name="call-cost", settings=settings)
    started = time.perf_counter()
    for step in range(CALL_COST_SAMPLES):
        tracker.log_metrics({"cost": 0.5}, step=step)
    log_us = (time.perf_counter() - started) / CALL_COST_SAMPLES * 1e6
    tracker.finish(timeout_s=600)

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


def bench_backend(name: str, server: MlflowServer, root: Path, points: int, db_uri: str
                  ) -> list[tuple[str, str, str]]:
    """Rows (a)-(g) for one backend; ``db_uri``: the server's database, password included."""
    from mlflow.tracking import MlflowClient

    from raydeck.config.secrets import Secret
    from raydeck.config.settings import load_settings
    from raydeck.tracking.proxy.actors import stop_proxy

    client = MlflowClient(server.uri)
    run_id = client.create_run(client.create_experiment(f"bench-{name}")).info.run_id
    rest = rest_per_point(server.uri, run_id)
    single = log_batch_rate(server.uri, run_id, 1)
    ceiling = log_batch_rate(server.uri, run_id, CONCURRENT_CLIENTS)
    base = load_settings()
    settings = dataclasses.replace(
        base, ray_namespace=f"raydeck-bench-{uuid.uuid4().hex[:6]}", data_dir=root / "data",
        tracking=dataclasses.replace(base.tracking, uri=server.uri, artifact_location=""))
    raydeck_end_to_end(settings, 1, 1000)  # warm-up: the proxy's actors start once
    results = {w: raydeck_end_to_end(settings, w, points) for w in (2, 4)}
    stop_proxy(settings.ray_namespace, 60)
    direct_single = log_batch_rate(db_uri, run_id, 1)
    bulk_single, bulk_cpu_us = bulk_rate(db_uri, run_id)
    direct = dataclasses.replace(
        settings, ray_namespace=f"raydeck-bench-{uuid.uuid4().hex[:6]}",
        data_dir=root / "data-direct",
        tracking=dataclasses.replace(settings.tracking, write_db=Secret(db_uri)))
    raydeck_end_to_end(direct, 1, 1000)
    direct_results = {w: raydeck_end_to_end(direct, w, points) for w in (2, 4)}
    stop_proxy(direct.ray_namespace, 60)
    rows = [
        (f"[{name}] (a) REST POST per point", f"{rest:,.0f} points/s", ""),
        (f"[{name}] (b) log_batch x1000, 1 client", f"{single:,.0f} points/s",
         f"{single / rest:.0f}x (a)"),
        (f"[{name}] (c) log_batch x1000, {CONCURRENT_CLIENTS} clients (ceiling)",
         f"{ceiling:,.0f} points/s", f"{ceiling / single:.2f}x (b)"),
    ]
    for workers, (rate, worker_us) in results.items():
        rows.append((f"[{name}] (d) raydeck, {workers} Ray workers", f"{rate:,.0f} points/s",
                     f"{rate / ceiling:.2f}x (c), {rate / single:.2f}x (b), "
                     f"{rate / rest:.0f}x (a); {worker_us:.1f} us/call in workers"))
    rows.append((f"[{name}] (f) log_batch x1000, 1 client, MLflow's SQL store",
                 f"{direct_single:,.0f} points/s", f"{direct_single / single:.2f}x (b)"))
    rows.append((f"[{name}] (h) the same, raydeck's bulk write", f"{bulk_single:,.0f} points/s",
                 f"{bulk_single / direct_single:.2f}x (f); {bulk_cpu_us:.1f} us CPU/point"))
    for workers, (rate, worker_us) in direct_results.items():
        rows.append((f"[{name}] (g) raydeck direct, {workers} Ray workers",
                     f"{rate:,.0f} points/s",
                     f"{rate / ceiling:.2f}x (c), {rate / results[workers][0]:.2f}x (d); "
                     f"{worker_us:.1f} us/call in workers"))
    return rows


def postgres_uri(postgres: PostgresServer) -> str:
    """The database's URI with its password (the direct path's ``write_db``)."""
    from raydeck.stack.services import LOOPBACK, POSTGRES_DB, POSTGRES_USER

    return (f"postgresql://{POSTGRES_USER}:{postgres.password.reveal()}@{LOOPBACK}:"
            f"{postgres.port}/{POSTGRES_DB}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points-per-worker", type=int, default=25_000)
    parser.add_argument("--backend", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--skip-call-costs", action="store_true", help="leave out (e)")
    args = parser.parse_args()

    import logging

    logging.basicConfig(level=logging.WARNING)
    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="raydeck-bench-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)  # PostgreSQL runs as the postgres user under root: it must get in
        os.environ.update(measured_tracking_env(root / "data"))
        import ray

        from raydeck.cluster.connection import connect, job_runtime_env
        from raydeck.config.settings import load_settings

        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env=job_runtime_env(load_settings()))
        connect()
        postgres: PostgresServer | None = None
        try:
            if args.backend in ("sqlite", "both"):
                server = MlflowServer(root / "mlflow-sqlite").start()
                try:
                    rows += bench_backend("sqlite, 1 worker", server, root / "sqlite",
                                          args.points_per_worker, server.backend_store_uri)
                finally:
                    server.stop()
            if args.backend in ("postgres", "both"):
                postgres = PostgresServer(root / "postgres").start()
                server = MlflowServer(root / "mlflow-pg", backend_store_uri=postgres.uri,
                                      workers=4, env=postgres.env).start()
                try:
                    rows += bench_backend("postgres, 4 workers", server, root / "pg",
                                          args.points_per_worker, postgres_uri(postgres))
                finally:
                    server.stop()
            if not args.skip_call_costs:
                cost_server = MlflowServer(root / "mlflow-cost").start()
                try:
                    base = load_settings()
                    settings = dataclasses.replace(
                        base, ray_namespace=f"raydeck-cost-{uuid.uuid4().hex[:6]}",
                        tracking=dataclasses.replace(base.tracking, uri=cost_server.uri,
                                                     artifact_location=""))
                    log_us, actor_us = call_costs(settings)
                finally:
                    cost_server.stop()
        finally:
            ray.shutdown()
            if postgres is not None:
                postgres.stop()

    if not args.skip_call_costs:
        rows.append(("(e) log_metrics, 1 value, caller side", f"{log_us:.2f} us/call",
                     f"{actor_us / log_us:.0f}x cheaper than an actor call"))
        rows.append(("(e) fire-and-forget actor call", f"{actor_us:.1f} us/call", ""))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'measure':<{width}}  {'result':>18}  ratio")
    for name, value, ratio in rows:
        print(f"{name:<{width}}  {value:>18}  {ratio}")


if __name__ == "__main__":
    main()
