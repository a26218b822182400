"""The tracking proxy at scale: N virtual ranks on several Ray nodes, all attaching at once.

Each Ray node (a ``ray start`` head and ``ray start --address`` worker nodes on this machine,
as several machines would be) runs rank-host actors; each host holds many virtual ranks, each a
real raydeck :class:`~raydeck.tracking.client.tracker.Tracker` attached through raydeck's own attach
path (its own ``ProcessInfo``: rank, world size, the host actor as its Ray actor), so every
rank has its own buffer, flusher, router membership and shard batches, exactly as a Ray Train
worker's tracker has (the host process's one heartbeat call names all of its ranks). The ranks
of one run (``--ranks-per-run``) log in ``all_ranks`` mode, so every rank's points reach the
proxy. All ranks attach at once (a job start), then log ``--metrics`` metrics per step every
``--step-interval`` seconds.

Reported: attach time (p50/p99/max), the router's and shards' CPU and calls/s, end-to-end
points/s and delivery latency (log call to the row in MLflow's database, sampled by polling
it), the head's memory, runs that ended KILLED or ranks the router dropped while nothing died
(must be 0), where the CPU went (per process kind), and the same load logged with the MLflow
client as users do today (a synchronous ``log_batch`` per rank and step, on the same hosts and
server) with the ratios.

Every logged step is recorded by its host in a progress file (one line per rank and step,
written as the log call starts), so the counts hold when a node is removed while its ranks
log (``--until-stopped``: the ranks log until a line ``stop`` arrives on stdin): a dead rank's
landed points are a prefix of its steps, the rest went down with its process, and its run ends
KILLED (``tests/tracking/test_tracking_scale.py``).

Run: ``.venv/bin/python benchmarks/tracking_scale.py [--ranks 256 --worker-nodes 2
--ranks-per-host 32 --ranks-per-run 64 --metrics 10 --step-interval 1 --steps 60]``, or against
a running cluster and MLflow server with ``--address``, ``--mlflow-uri`` and ``--mlflow-db``
(``--json`` prints the report as one JSON line).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures.mlflow_server import MlflowServer  # noqa: E402
from tests.fixtures.processes import wait_until  # noqa: E402
from tests.fixtures.ray_head import (  # noqa: E402
    MARKER_ENV,
    SLOW_MACHINE_ENV,
    RayHead,
    head_env,
)
from tests.fixtures.tracking import measured_tracking_env  # noqa: E402

POLL_INTERVAL_S = 0.2
LANDED_TIMEOUT_S = 600.0
ENDED_TIMEOUT_S = 120.0
LOGGING_LINE = "logging"
STOP_LINE = "stop"
HEAD_ATTEMPTS = 4  # each is RayHead's own three tries


@dataclasses.dataclass(frozen=True)
class Load:
    """What the virtual ranks do. ``steps`` 0: log until stopped."""

    ranks: int = 256
    ranks_per_host: int = 32
    ranks_per_run: int = 64
    metrics: int = 10
    step_interval_s: float = 1.0
    steps: int = 60

    def __post_init__(self) -> None:
        for name in ("ranks", "ranks_per_host", "ranks_per_run", "metrics"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.ranks % self.ranks_per_host or self.ranks % self.ranks_per_run:
            raise ValueError(f"ranks={self.ranks}: must be a multiple of ranks_per_host "
                             f"({self.ranks_per_host}) and ranks_per_run ({self.ranks_per_run})")

    @property
    def hosts(self) -> int:
        return self.ranks // self.ranks_per_host

    def slots(self, host: int, run_keys: list[str]) -> list[tuple[str, int]]:
        """(run key, rank in that run) of each virtual rank of ``host``."""
        first = host * self.ranks_per_host
        return [(run_keys[g // self.ranks_per_run], g % self.ranks_per_run)
                for g in range(first, first + self.ranks_per_host)]


class RankHost:
    """One process hosting many virtual ranks (a Ray actor), each a real tracker."""

    def __init__(self, settings: Any, progress_path: str, stop_path: str) -> None:
        self.settings = settings
        self.progress_path = progress_path
        self.stop_path = stop_path
        self.trackers: list[Any] = []

    def attach(self, slots: list[tuple[str, int]], world_size: int) -> list[float]:
        """Attach every rank at once, one thread each; returns each attach's seconds."""
        import socket

        import ray

        from raydeck.tracking.client.attach import _attach_new
        from raydeck.tracking.messages import ProcessInfo

        runtime = ray.get_runtime_context()
        job_id, actor_id = runtime.get_job_id(), runtime.get_actor_id()
        node_ip = ray.util.get_node_ip_address()

        def one(slot: tuple[str, int]) -> tuple[Any, float]:
            run_key, rank = slot
            process = ProcessInfo(
                role="train_worker", role_key=f"scale:{run_key}:{rank}", job_id=job_id,
                node_ip=node_ip, hostname=socket.gethostname(), pid=os.getpid(),
                world_rank=rank, local_rank=rank, node_rank=0, world_size=world_size,
                actor_id=actor_id)
            started = time.perf_counter()
            tracker = _attach_new(self.settings, process, run_key, run_key,
                                  self.settings.tracking.experiment, "all_ranks", None)
            return tracker, time.perf_counter() - started

        with concurrent.futures.ThreadPoolExecutor(max_workers=len(slots)) as pool:
            done = list(pool.map(one, slots))
        self.trackers = [tracker for tracker, _ in done]
        return [seconds for _, seconds in done]

    def log(self, load: Load, start_at: float) -> dict[str, float]:
        """Log every rank's step each ``step_interval_s`` from ``start_at`` (wall clock)."""
        names = [f"m{i}" for i in range(load.metrics)]
        call_s = 0.0
        step = 0
        with open(self.progress_path, "a", buffering=1) as progress:
            while (step < load.steps if load.steps else not os.path.exists(self.stop_path)):
                due = start_at + step * load.step_interval_s
                time.sleep(max(0.0, due - time.time()))
                started = time.perf_counter()
                for index, tracker in enumerate(self.trackers):
                    # Recorded before the call: a process killed inside it counts the step as
                    # logged (and lost), so landed never exceeds logged.
                    progress.write(f"{index} {step}\n")
                    tracker.log_metrics({name: float(step) for name in names}, step=step)
                call_s += time.perf_counter() - started
                step += 1
        batches = sum(t._open_delivery._seq for t in self.trackers)  # ingest calls sent
        return {"steps": step, "call_s": call_s, "batches": batches}

    def finish(self) -> None:
        """Every rank leaves, rank 0 last (its finish ends the run once the others left)."""
        others = [t for t in self.trackers if t.rank != 0]
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(others))) as pool:
            list(pool.map(lambda t: t.finish(wait=False), others))
        for tracker in self.trackers:
            if tracker.rank == 0:
                tracker.finish(wait=False)

    def log_plain(self, uri: str, run_ids: list[str], load: Load, start_at: float
                  ) -> list[tuple[float, str]]:
        """The same load with MLflow's client as users log today: each rank a thread calling
        ``log_batch`` synchronously per step. Returns every call's seconds and its error ("" if
        it succeeded): an overloaded server refuses calls (SQLAlchemy's pool runs out at 64
        ranks on SQLite), and in a user's loop that error is the training step's."""
        from mlflow.entities import Metric
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        client = MlflowClient(uri)
        names = [f"m{i}" for i in range(load.metrics)]

        def rank_loop(index: int) -> list[tuple[float, str]]:
            run_id, rank = run_ids[index], index % load.ranks_per_run
            calls = []
            for step in range(load.steps):
                due = start_at + step * load.step_interval_s
                time.sleep(max(0.0, due - time.time()))
                stamp = int(time.time() * 1000)
                started = time.perf_counter()
                error = ""
                try:
                    client.log_batch(run_id, metrics=[Metric(f"{name}/rank_{rank}", float(step),
                                                             stamp, step) for name in names])
                except MlflowException as exc:
                    error = str(exc).splitlines()[0][:200]
                calls.append((time.perf_counter() - started, error))
            return calls

        with concurrent.futures.ThreadPoolExecutor(max_workers=len(run_ids)) as pool:
            return [s for part in pool.map(rank_loop, range(len(run_ids))) for s in part]


# --- the driver's side ---------------------------------------------------------------------------
class LandedSampler:
    """Polls MLflow's database for new metric rows: delivery latency = when a row was first
    seen minus its timestamp (the log call's time); resolution ``POLL_INTERVAL_S``."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.latencies_s: list[float] = []
        self.last_seen = 0.0
        self._rowid = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> LandedSampler:
        self._rowid = self._max_rowid()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _max_rowid(self) -> int:
        with contextlib.closing(sqlite3.connect(self.db, timeout=30)) as db:
            return int(db.execute("SELECT COALESCE(MAX(rowid), 0) FROM metrics").fetchone()[0])

    def _poll(self) -> None:
        while not self._stop.wait(POLL_INTERVAL_S):
            try:
                with contextlib.closing(sqlite3.connect(self.db, timeout=30)) as db:
                    rows = db.execute("SELECT rowid, timestamp FROM metrics WHERE rowid > ? "
                                      "AND key LIKE '%/rank_%'", (self._rowid,)).fetchall()
            except sqlite3.OperationalError:
                continue  # the server holds the write lock; next poll
            if rows:
                now = time.time()
                self._rowid = max(r[0] for r in rows)
                self.latencies_s.extend(now - r[1] / 1000 for r in rows)
                self.last_seen = now


class CpuMeter:
    """CPU seconds and peak RSS of this machine's processes, grouped by what they are."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        import psutil

        self.procs = {name: [psutil.Process(pid) for pid in pids]
                      for name, pids in groups.items()}
        self.start = self._cpu()
        self.peak_rss_mb: dict[str, float] = dict.fromkeys(groups, 0.0)

    def _cpu(self) -> dict[str, float]:
        total = {}
        for name, procs in self.procs.items():
            seconds = 0.0
            for proc in procs:
                with contextlib.suppress(Exception):
                    times = proc.cpu_times()
                    seconds += times.user + times.system
            total[name] = seconds
        return total

    def sample_rss(self) -> None:
        for name, procs in self.procs.items():
            rss = 0.0
            for proc in procs:
                with contextlib.suppress(Exception):
                    rss += proc.memory_info().rss / 1024**2
            self.peak_rss_mb[name] = max(self.peak_rss_mb[name], rss)

    def used(self) -> dict[str, float]:
        now = self._cpu()
        return {name: now[name] - self.start[name] for name in now}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _process_groups(head_pids: dict[str, list[int]]) -> dict[str, list[int]]:
    """The proxy's, hosts' and Ray's processes of this cluster, by kind."""
    import psutil
    from ray.util.state import list_actors

    groups: dict[str, list[int]] = {**head_pids}
    for actor in list_actors(filters=[("state", "=", "ALIVE")], limit=10000):
        kind = {"Router": "router", "Shard": "shards", "RankHost": "rank hosts"}.get(
            actor.class_name)
        if kind and actor.pid:
            groups.setdefault(kind, []).append(int(actor.pid))
    for proc in psutil.process_iter(["name", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            name = proc.info["name"] or ""
            if name in ("gcs_server", "raylet") and _ours(proc):
                groups.setdefault("GCS" if name == "gcs_server" else "raylets", []).append(
                    proc.pid)
    return groups


def _ours(proc: Any) -> bool:
    """A process of the cluster this driver measures (its marker, see ``RayHead``)."""
    try:
        return bool(proc.environ().get(MARKER_ENV) == os.environ.get(MARKER_ENV))
    except Exception:
        return False


def _marks(values: list[str]) -> str:
    """SQL placeholders for ``values``."""
    return ",".join("?" * len(values))


def _run_rows(db: Path, run_keys: list[str]) -> dict[str, tuple[str, str]]:
    """Run key -> (MLflow run id, status), from MLflow's own database."""
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as conn:
        rows = conn.execute(
            "SELECT t.value, r.run_uuid, r.status FROM tags t JOIN runs r ON r.run_uuid = "
            f"t.run_uuid WHERE t.key = 'raydeck.run_key' AND t.value IN ({_marks(run_keys)})",
            run_keys).fetchall()
    return {key: (run_id, status) for key, run_id, status in rows}


def _landed_steps(db: Path, run_ids: list[str]) -> dict[tuple[str, str], list[int]]:
    """(run id, metric key) -> the steps stored, for the ranks' own keys."""
    found: dict[tuple[str, str], list[int]] = {}
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as conn:
        for run_id, key, step in conn.execute(
                "SELECT run_uuid, key, step FROM metrics WHERE key LIKE '%/rank_%' AND run_uuid "
                f"IN ({_marks(run_ids)})", run_ids):
            found.setdefault((run_id, key), []).append(int(step))
    return found


def _progress(path: Path) -> dict[int, int]:
    """Rank index in its host -> steps whose log call started."""
    logged: dict[int, int] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:
                index, step = int(parts[0]), int(parts[1])
                logged[index] = max(logged.get(index, 0), step + 1)
    return logged


def run_scale(load: Load, settings: Any, mlflow_db: Path, work_dir: Path,
              head_pids: dict[str, list[int]] | None = None, baseline: bool = True,
              announce: bool = False) -> dict[str, Any]:
    """Run ``load`` on the connected cluster; returns the report (see the module docstring).

    ``announce``: print ``LOGGING_LINE`` once every rank logged a step, and with
    ``load.steps == 0`` log until ``STOP_LINE`` arrives on stdin.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raydeck.tracking.proxy.actors import find_router, stop_proxy, wait_runs_landed

    work_dir.mkdir(parents=True, exist_ok=True)
    stop_path = work_dir / "stop"
    tag = uuid.uuid4().hex[:6]
    runs = load.ranks // load.ranks_per_run
    run_keys = [f"scale-{tag}-job{j}" for j in range(runs)]
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    host_actor = ray.remote(num_cpus=0, max_concurrency=2)(RankHost)
    hosts = [host_actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        nodes[h % len(nodes)], soft=False)).remote(
            settings, str(work_dir / f"progress-{h}.txt"), str(stop_path))
        for h in range(load.hosts)]
    host_node = {h: nodes[h % len(nodes)] for h in range(load.hosts)}
    ray.get([host.__ray_ready__.remote() for host in hosts], timeout=600)
    groups = _process_groups(head_pids or {})

    # The attach storm: every rank of every host at once.
    attach_started = time.perf_counter()
    attach_s = [s for part in ray.get([
        host.attach.remote(load.slots(h, run_keys), load.ranks_per_run)
        for h, host in enumerate(hosts)], timeout=900) for s in part]
    attach_wall_s = time.perf_counter() - attach_started
    groups = _process_groups(head_pids or {})
    meter = CpuMeter(groups)
    router = find_router(settings.ray_namespace)
    assert router is not None, "the attaches started the proxy"

    start_at = time.time() + 1.0
    with LandedSampler(mlflow_db) as sampler:
        logging_refs = [host.log.remote(load, start_at) for host in hosts]
        stop_rss = threading.Event()

        def rss_forever() -> None:
            while not stop_rss.wait(1.0):
                meter.sample_rss()

        threading.Thread(target=rss_forever, daemon=True).start()
        if announce:
            wait_until(lambda: all(len(_progress(work_dir / f"progress-{h}.txt"))
                                   == load.ranks_per_host for h in range(load.hosts)),
                       120, "every rank's first step")
            head_node = next(n["NodeID"] for n in ray.nodes()
                             if n["Alive"] and "node:__internal_head__" in n["Resources"])
            print(LOGGING_LINE, json.dumps(
                {"hosts_on_head": [h for h, n in host_node.items() if n == head_node]}),
                flush=True)
            if not load.steps:
                for line in sys.stdin:
                    if line.strip() == STOP_LINE:
                        break
                stop_path.touch()
        results: dict[int, dict[str, float]] = {}
        dead_hosts: list[int] = []
        for h, ref in enumerate(logging_refs):
            try:
                results[h] = ray.get(ref, timeout=load.steps * load.step_interval_s + 600)
            except ray.exceptions.RayActorError:
                dead_hosts.append(h)
        load_stopped = time.time()
        participants = {run["key"]: run["participants"] for run in
                        ray.get(router.status.remote(), timeout=60)["runs"]}
        live = [h for h in range(load.hosts) if h not in dead_hosts]
        ray.get([hosts[h].finish.remote() for h in live], timeout=600)
        landed = wait_runs_landed(settings.ray_namespace, run_keys, LANDED_TIMEOUT_S)
        drained_at = time.time()
        cpu = meter.used()
        stop_rss.set()
        wait_until(lambda: all(status in ("FINISHED", "KILLED", "FAILED") for _, status in
                               _run_rows(mlflow_db, run_keys).values())
                   and len(_run_rows(mlflow_db, run_keys)) == runs,
                   ENDED_TIMEOUT_S, "every run to end")
    rows = _run_rows(mlflow_db, run_keys)

    # Counts: every rank's steps in MLflow against what its host says it logged.
    stored = _landed_steps(mlflow_db, [run_id for run_id, _ in rows.values()])
    logged_points = landed_points = holes = 0
    lost_with_process = 0
    for h in range(load.hosts):
        progress = _progress(work_dir / f"progress-{h}.txt")
        for index, (run_key, rank) in enumerate(load.slots(h, run_keys)):
            logged = progress.get(index, 0)
            run_id = rows[run_key][0]
            for m in range(load.metrics):
                steps = sorted(set(stored.get((run_id, f"m{m}/rank_{rank}"), [])))
                logged_points += logged
                landed_points += len(steps)
                if steps != list(range(len(steps))):
                    holes += 1  # a gap, never allowed: data lost silently
                if h in dead_hosts:
                    lost_with_process += max(0, logged - len(steps))
    dead_runs = sorted({run_key for h in dead_hosts for run_key, _ in load.slots(h, run_keys)})
    live_runs = [k for k in run_keys if k not in dead_runs]
    calls = sum(r["batches"] for r in results.values())
    logging_s = load_stopped - start_at
    report: dict[str, Any] = {
        "load": dataclasses.asdict(load),
        "load_avg_1m": os.getloadavg()[0],  # the machine's, at the end of the logging
        "cpu_count": os.cpu_count(),
        "nodes": len(nodes),
        "hosts": load.hosts,
        "dead_hosts": dead_hosts,
        "attach_p50_s": _pct(attach_s, 0.5),
        "attach_p99_s": _pct(attach_s, 0.99),
        "attach_max_s": max(attach_s),
        "attach_all_s": attach_wall_s,
        "logged_points": logged_points,
        "landed_points": landed_points,
        "lost_with_process_points": lost_with_process,
        "keys_with_holes": holes,
        "landed_flag": landed,
        "points_per_s": landed_points / max(1e-9, drained_at - start_at),
        "logging_s": logging_s,
        "drain_after_load_s": drained_at - load_stopped,
        "delivery_p50_s": _pct(sampler.latencies_s, 0.5),
        "delivery_p99_s": _pct(sampler.latencies_s, 0.99),
        "log_call_us_per_rank_step": 1e6 * sum(r["call_s"] for r in results.values())
        / max(1, sum(r["steps"] for r in results.values()) * load.ranks_per_host),
        "ingest_calls_per_s": calls / max(1e-9, logging_s),
        "heartbeats_per_s": load.hosts / 5.0,  # one call a process (client/heartbeats.py)
        "participants_at_load_end": participants,
        "run_status": {k: rows[k][1] for k in run_keys},
        "false_killed_runs": sum(1 for k in live_runs if rows[k][1] != "FINISHED"),
        "false_dropped_ranks": sum(load.ranks_per_run - participants.get(k, 0)
                                   for k in live_runs),
        "dead_runs_killed": sum(1 for k in dead_runs if rows[k][1] == "KILLED"),
        "dead_runs": len(dead_runs),
        "cpu_s": cpu,
        "cpu_share_of_one_core": {k: v / max(1e-9, drained_at - start_at)
                                  for k, v in cpu.items()},
        "peak_rss_mb": meter.peak_rss_mb,
    }
    stop_proxy(settings.ray_namespace, 60)
    if baseline and not dead_hosts:
        report["plain_mlflow"] = _plain_baseline(settings.tracking.uri, hosts, load, mlflow_db,
                                                 tag)
    for host in hosts:
        ray.kill(host)
    return report


def _plain_baseline(uri: str, hosts: list[Any], load: Load, mlflow_db: Path, tag: str
                    ) -> dict[str, Any]:
    """The same load through MLflow's client, one synchronous ``log_batch`` per rank-step."""
    import ray
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.create_experiment(f"scale-plain-{tag}")
    run_ids = [client.create_run(experiment, run_name=f"plain-job{j}").info.run_id
               for j in range(load.ranks // load.ranks_per_run)]
    start_at = time.time() + 1.0
    calls = [c for part in ray.get([
        host.log_plain.remote(uri, [run_ids[(h * load.ranks_per_host + i) // load.ranks_per_run]
                                    for i in range(load.ranks_per_host)], load, start_at)
        for h, host in enumerate(hosts)], timeout=3600) for c in part]
    seconds = [s for s, _ in calls]
    errors = [e for _, e in calls if e]
    done = time.time()
    with contextlib.closing(sqlite3.connect(mlflow_db, timeout=30)) as conn:
        points = int(conn.execute(f"SELECT COUNT(*) FROM metrics WHERE run_uuid IN "
                                  f"({_marks(run_ids)})", run_ids).fetchone()[0])
    return {
        "points": points,
        "points_per_s": points / max(1e-9, done - start_at),
        "wall_s": done - start_at,
        "call_p50_s": _pct(seconds, 0.5),
        "call_p99_s": _pct(seconds, 0.99),
        "log_call_us_per_rank_step": 1e6 * statistics.fmean(seconds),
        "calls_failed": len(errors),
        "calls": len(calls),
        "first_error": errors[0] if errors else "",
    }


# --- the benchmark's own cluster --------------------------------------------------------------
@contextlib.contextmanager
def cluster(root: Path, worker_nodes: int, node_cpus: int) -> Iterator[tuple[RayHead,
                                                                          MlflowServer]]:
    """An MLflow server and a Ray head with ``worker_nodes`` extra nodes, stopped after."""
    server = MlflowServer(root / "mlflow")
    measured = {k: v for k, v in measured_tracking_env(root / "data").items()
                if k != "RAY_AUTH_MODE"}  # RayHead pins token auth
    head = RayHead(root / "ray", head_env(server.uri, root / "data", **measured,
                                          **SLOW_MACHINE_ENV), num_cpus=node_cpus)
    try:
        server.start()
        for attempt in range(1, HEAD_ATTEMPTS + 1):
            # Ray reads its auth mode once, when first imported (RayHead's start imports it).
            os.environ.update({**head.client_env, MARKER_ENV: head.marker})
            try:
                head.start()
                break
            except TimeoutError:
                # Ray's fixed 30 s raylet deadline fails on a machine this busy; a new head
                # (new ports, new temp dir) usually comes up.
                if attempt == HEAD_ATTEMPTS:
                    raise
                head = RayHead(root / f"ray-{attempt}", head.env, num_cpus=node_cpus)
        for _ in range(worker_nodes):
            head.add_worker_node(num_cpus=node_cpus)
        yield head, server
    finally:
        head.stop()
        server.stop()


def scale_settings(mlflow_uri: str, data_dir: Path, write_db: str = "") -> Any:
    """The proxy's settings; ``write_db``: the server's database, written directly (MLflow's
    SQL store, docs/tracking-contract.md "The direct write path") instead of through it."""
    from raydeck.config.secrets import Secret
    from raydeck.config.settings import load_settings

    base = load_settings()
    return dataclasses.replace(
        base, ray_namespace=f"raydeck-scale-{uuid.uuid4().hex[:6]}", data_dir=data_dir,
        tracking=dataclasses.replace(base.tracking, uri=mlflow_uri, artifact_location="",
                                     mode="all_ranks", experiment="scale",
                                     write_db=Secret(write_db)))


def connect(address: str, settings: Any) -> None:
    import ray

    from raydeck.cluster.connection import job_runtime_env

    ray.init(address=address, include_dashboard=False, log_to_driver=False,
             runtime_env=job_runtime_env(settings))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Load()
    parser.add_argument("--ranks", default=str(defaults.ranks),
                        help="virtual ranks; a comma list runs each on the same cluster")
    parser.add_argument("--ranks-per-host", type=int, default=defaults.ranks_per_host)
    parser.add_argument("--ranks-per-run", type=int, default=defaults.ranks_per_run)
    parser.add_argument("--metrics", type=int, default=defaults.metrics)
    parser.add_argument("--step-interval", type=float, default=defaults.step_interval_s)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--until-stopped", action="store_true",
                        help="log until a line 'stop' arrives on stdin")
    parser.add_argument("--worker-nodes", type=int, default=2)
    parser.add_argument("--node-cpus", type=int, default=2)
    parser.add_argument("--address", help="a running cluster's GCS address")
    parser.add_argument("--mlflow-uri")
    parser.add_argument("--mlflow-db", type=Path, help="the server's SQLite database")
    parser.add_argument("--work-dir", type=Path)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--direct", action="store_true",
                        help="the proxy writes to the server's SQLite database directly")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    loads = [Load(int(n), min(int(n), args.ranks_per_host), min(int(n), args.ranks_per_run),
                  args.metrics, args.step_interval, 0 if args.until_stopped else args.steps)
             for n in args.ranks.split(",")]
    logging.basicConfig(level=logging.WARNING)
    # A SIGTERM (``timeout``, a test's clean-up) unwinds, so the cluster started here stops.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="raydeck-scale-") as tmp:
        root = Path(tmp)
        # The cluster's own auth (token) comes from the caller or from ``cluster``.
        os.environ.update({k: v for k, v in measured_tracking_env(root / "data").items()
                           if k != "RAY_AUTH_MODE"})
        if args.address:
            direct = f"sqlite:///{args.mlflow_db}" if args.direct else ""
            settings = scale_settings(args.mlflow_uri, root / "data", direct)
            connect(args.address, settings)
            _print(run_scale(loads[0], settings, args.mlflow_db, args.work_dir or root / "work",
                             baseline=not args.no_baseline, announce=True), args.json)
            return
        with cluster(root, args.worker_nodes, args.node_cpus) as (head, server):
            connect(head.gcs_address, scale_settings(server.uri, root / "data"))
            for load in loads:
                # Each N on a proxy of its own (a namespace of its own), started by its attaches.
                direct = f"sqlite:///{server.root / 'mlflow.db'}" if args.direct else ""
                settings = scale_settings(server.uri, root / "data", direct)
                _print(run_scale(load, settings, server.root / "mlflow.db",
                                 root / f"work-{load.ranks}",
                                 head_pids={"MLflow server": _tree(server)},
                                 baseline=not args.no_baseline), args.json)


def _print(report: dict[str, Any], one_line: bool) -> None:
    print(json.dumps(report) if one_line else json.dumps(report, indent=1), flush=True)


def _tree(server: MlflowServer) -> list[int]:
    import psutil

    assert server.process is not None and server.process.proc is not None
    root = psutil.Process(server.process.proc.pid)
    return [root.pid, *(child.pid for child in root.children(recursive=True))]


if __name__ == "__main__":
    main()
