"""The tracking proxy under a long overload with an MLflow outage in the middle.

64 logging processes (Ray actors) log at a fixed total rate above what the MLflow server can
write, for several minutes; MLflow is killed for 60 s in the middle. Every second the benchmark
samples the RSS of each shard and of one logging process and the spool's size. When the load
stops, it waits until every point is in MLflow and then counts, in MLflow's own database, the
points of every key: none may be missing and none repeated.

Prints: peak and per-minute RSS (a worker, each shard), spool size, the backlog when MLflow came
back, the time to drain everything after the load stopped, points lost and duplicated.

Run: ``.venv/bin/python benchmarks/tracking_soak.py [--workers 64 --rate 8000 --duration 300
--outage-at 90 --outage 60]``. Needs about 6 GiB of memory for 64 actors.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures.mlflow_server import MlflowServer  # noqa: E402
from tests.fixtures.tracking import measured_tracking_env  # noqa: E402


def _rss_mb(pid: int) -> float:
    import psutil

    try:
        return float(psutil.Process(pid).memory_info().rss) / 1024**2
    except Exception:
        return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--rate", type=float, default=8000.0, help="total points/s")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    parser.add_argument("--outage-at", type=float, default=90.0)
    parser.add_argument("--outage", type=float, default=60.0)
    args = parser.parse_args()

    import logging

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="raydeck-soak-") as tmp:
        root = Path(tmp)
        os.environ.update(measured_tracking_env(root / "data"))
        import ray

        from raydeck.cluster.connection import connect, job_runtime_env
        from raydeck.config.settings import load_settings

        server = MlflowServer(root / "mlflow").start()
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env=job_runtime_env(load_settings()))
        connect()
        try:
            report = soak(server, args)
        finally:
            ray.shutdown()
            server.stop()
    width = max(len(k) for k in report)
    print()
    for key, value in report.items():
        print(f"{key:<{width}}  {value}")


def soak(server: MlflowServer, args: argparse.Namespace) -> dict[str, str]:
    import ray

    import raydeck
    from raydeck.config.settings import load_settings
    from raydeck.tracking.proxy.actors import find_router, get_shard, stop_proxy

    base = load_settings()
    settings = dataclasses.replace(
        base, ray_namespace=f"raydeck-soak-{uuid.uuid4().hex[:6]}",
        tracking=dataclasses.replace(base.tracking, uri=server.uri, artifact_location=""))
    key = f"soak-{uuid.uuid4().hex[:6]}"
    driver = raydeck.get_tracker(key, run_name="soak", settings=settings)
    per_worker_rate = args.rate / args.workers

    @ray.remote(num_cpus=0)
    class Logger:
        def setup(self, key: str, settings: Any) -> int:
            self.tracker = raydeck.get_tracker(key, settings=settings)
            return os.getpid()

        def run(self, index: int, rate: float, duration: float) -> int:
            """Log at ``rate`` points/s for ``duration`` s; returns the points logged."""
            name = f"w{index:03d}"
            started = time.monotonic()
            step = 0
            while True:
                elapsed = time.monotonic() - started
                if elapsed >= duration:
                    break
                due = int(elapsed * rate) + 1
                while step < due:
                    self.tracker.log_metric(name, float(step), step=step)
                    step += 1
                time.sleep(0.01)
            self.tracker.finish(wait=False)
            return step

        def peak_rss_mb(self) -> float:
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0

    loggers = [Logger.remote() for _ in range(args.workers)]
    pids = ray.get([lg.setup.remote(key, settings) for lg in loggers])
    router = find_router(settings.ray_namespace)
    shards = [get_shard(settings.ray_namespace, i) for i in range(settings.tracking.shards)]
    shard_pids = [int(ray.get(s.stats.remote())["pid"]) for s in shards]

    samples: list[dict[str, float]] = []
    stop_sampling = threading.Event()

    def sample() -> None:
        started = time.monotonic()
        while not stop_sampling.is_set():
            stats = ray.get([s.stats.remote() for s in shards], timeout=60)
            samples.append({
                "t": time.monotonic() - started,
                "worker_rss_mb": _rss_mb(pids[0]),
                **{f"shard{i}_rss_mb": _rss_mb(pid) for i, pid in enumerate(shard_pids)},
                "spool_mb": sum(s["spool_bytes"] for s in stats) / 1024**2,
                "queued": float(sum(s["queued_points"] for s in stats)),
            })
            stop_sampling.wait(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    outage: dict[str, float] = {}

    def make_outage() -> None:
        time.sleep(args.outage_at)
        server.kill()
        outage["down"] = time.monotonic()
        time.sleep(args.outage)
        server.start()
        outage["up"] = time.monotonic()
        stats = ray.get([s.stats.remote() for s in shards], timeout=60)
        outage["backlog"] = float(sum(s["queued_points"] for s in stats))

    outages = threading.Thread(target=make_outage, daemon=True)
    outages.start()
    load_started = time.monotonic()
    logged = ray.get([lg.run.remote(i, per_worker_rate, args.duration)
                      for i, lg in enumerate(loggers)], timeout=args.duration + 600)
    load_stopped = time.monotonic()
    outages.join()
    worker_peak = max(ray.get([lg.peak_rss_mb.remote() for lg in loggers]))
    report = driver.finish(timeout_s=3600)
    drained = time.monotonic()
    stop_sampling.set()
    sampler.join(10)
    run_id = driver.run_id
    counts = _count(server, run_id)
    stop_proxy(settings.ray_namespace, 60)
    del router

    expected = {f"w{i:03d}": n for i, n in enumerate(logged)}
    lost = sum(max(0, n - counts.get(k, (0, 0))[1]) for k, n in expected.items())
    duplicated = sum(total - distinct for total, distinct in counts.values())
    total = sum(expected.values())
    minutes = {}
    for sample_ in samples:
        minutes.setdefault(int(sample_["t"] // 60), []).append(sample_)
    result = {
        "load": f"{args.workers} actors, {args.rate:,.0f} points/s in total for "
                f"{args.duration:.0f} s; MLflow killed at {args.outage_at:.0f} s for "
                f"{args.outage:.0f} s",
        "points logged": f"{total:,}",
        "achieved input rate": f"{total / (load_stopped - load_started):,.0f} points/s",
        "landed (landed flag)": str(report.landed),
        "points lost": f"{lost:,}",
        "points duplicated": f"{duplicated:,}",
        "backlog when MLflow came back": f"{outage.get('backlog', 0):,.0f} points",
        "drain after the load stopped": f"{drained - load_stopped:.1f} s",
        "end-to-end write rate": f"{total / (drained - load_started):,.0f} points/s",
        "peak RSS, one logging actor": f"{worker_peak:.0f} MiB",
        "peak spool size": f"{max(s['spool_mb'] for s in samples):.1f} MiB",
    }
    for i in range(len(shard_pids)):
        result[f"peak RSS, shard {i}"] = f"{max(s[f'shard{i}_rss_mb'] for s in samples):.0f} MiB"
    for minute, group in sorted(minutes.items()):
        shard_rss = " / ".join(f"{max(s[f'shard{i}_rss_mb'] for s in group):.0f}"
                               for i in range(len(shard_pids)))
        result[f"minute {minute}: RSS worker | shards, spool, queued"] = (
            f"{max(s['worker_rss_mb'] for s in group):.0f} | {shard_rss} MiB, "
            f"{max(s['spool_mb'] for s in group):.1f} MiB, "
            f"{max(s['queued'] for s in group):,.0f} points")
    return result


def _count(server: MlflowServer, run_id: str) -> dict[str, tuple[int, int]]:
    """Per key: (points stored, distinct steps), read from the server's own database."""
    db = sqlite3.connect(server.root / "mlflow.db")
    try:
        rows = db.execute("SELECT key, COUNT(*), COUNT(DISTINCT step) FROM metrics "
                          "WHERE run_uuid = ? GROUP BY key", (run_id,)).fetchall()
    finally:
        db.close()
    return {key: (int(total), int(distinct)) for key, total, distinct in rows}


if __name__ == "__main__":
    main()
