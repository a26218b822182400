"""raydeck serve against `mlflow models serve`: requests/s, p50/p99 latency and errors.

One run, one registered model (the digits MLP with its scaling inside, trained for a few epochs
in this process), one machine. Servers:

- ``mlflow models serve --env-manager local`` (what MLflow users run today) with 1 uvicorn
  worker, and with one per core (``--mlflow-workers``);
- ``raydeck serve`` on a local Ray instance given the machine's cores (and the GPUs Ray
  detects), under each of Ray Serve's ingress options, each in its own Ray instance (Serve reads
  them when its processes start): ``proxy`` (Serve's Python proxy actor, Ray's default),
  ``haproxy`` (``RAY_SERVE_ENABLE_HA_PROXY=1``: an HAProxy process sends HTTP straight to the
  replicas), ``direct`` (``RAY_SERVE_ENABLE_DIRECT_INGRESS=1``: the replica listens itself).
  Replicas come from scaling presets (``--presets``, default ``cpu-1``: 1 replica;
  ``gpu-quarter``: 4 replicas of a quarter GPU each, on one GPU) and, with
  ``--cpu-replicas N``, from a preset ``cpu-N`` of N one-CPU replicas, written to a presets
  file (``RAYDECK_PRESETS_FILE``) as a user adds one. A preset the Ray instance cannot place
  (a GPU preset without a GPU) is skipped with a line saying so. Each with adaptive batching
  (``--max-batch-size 32 --batch-wait-ms 0``: a request that finds the replica idle is
  predicted at once, requests that queue behind a prediction form the next batch) and without
  (``--max-batch-size 1``); under ``proxy`` also with the earlier 5 ms batch wait
  (``--batching`` picks rows).

A client (asyncio + aiohttp, in this process, or split over ``--client-processes`` processes
so that one Python process is not the ceiling on a machine of many cores) keeps ``--clients``
requests in flight for ``--seconds`` per point, each request one raw digits row in MLflow's
``inputs`` form, and counts every answer that is not 200 as an error. The client shares the
machine's cores with the servers, the same for every server. Printed: where the model predicts
(MLflow's pytorch flavor uses CUDA whenever the process sees a GPU; a raydeck replica sees only
the GPUs Ray gave it, and says its device on ``/health``), one row per server and concurrency
(for raydeck serve with where a request's time went: mean time at Serve's proxy, where there is
one, and in the replica, from Serve's own latency histograms), the ratios raydeck/mlflow (1
worker), and Serve's own floor under its default proxy: the p50 of bare deployments that
return at once or only read the request body.

Run: ``.venv/bin/python benchmarks/serving.py`` (about 8 minutes on 2 cores). On a machine of
16 cores and a GPU, about 3 minutes: ``--ingress haproxy --presets gpu-quarter --cpu-replicas 8
--batching adaptive --seconds 5 --client-processes 4`` (half the cores to CPU replicas, the
rest to the client, HAProxy and Ray's own processes). ``mlflow models serve`` is started as
``python -m mlflow`` and finds ``uvicorn`` beside its module, so packages installed with
``pip install --target DIR`` (on ``PYTHONPATH``) work.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

# The cores this process may run on (a container's CPU set, where os.cpu_count() says the
# host's): Ray's CPUs and MLflow's worker per core.
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class Point:
    server: str
    clients: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int


def train_and_register(tracking_uri: str) -> str:
    """A digits MLP trained for 5 epochs in this process, registered as ``bench``."""
    import mlflow
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from raydeck.examples.digits import DigitsMLP, load_split, servable, train_epoch
    from raydeck.models import register_run_model, save_torch_model

    x_train, y_train, _, _ = load_split(0)
    torch.manual_seed(0)
    model = DigitsMLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.003)
    loader = DataLoader(TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
                        batch_size=64, shuffle=True)
    for _ in range(5):
        train_epoch(model, loader, optimizer)
    mlflow.set_tracking_uri(tracking_uri)
    with mlflow.start_run() as run, tempfile.TemporaryDirectory() as tmp:
        served, example = servable(model.eval(), 0)
        mlflow.log_artifacts(str(save_torch_model(served, Path(tmp), example)), "model")
    return register_run_model(tracking_uri, run.info.run_id, "bench").uri


async def load(url: str, clients: int, seconds: float, body: bytes
               ) -> tuple[list[float], int, float]:
    """Keep ``clients`` requests in flight for ``seconds``: the latency of every answer (s),
    the errors, and the seconds it took."""
    import aiohttp

    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=clients)
    headers = {"Content-Type": "application/json"}

    async with aiohttp.ClientSession(connector=connector) as session:
        async def client() -> None:
            nonlocal errors
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                try:
                    async with session.post(url, data=body, headers=headers) as answer:
                        await answer.read()
                        ok = answer.status == 200
                except aiohttp.ClientError:
                    ok = False
                latencies.append(time.perf_counter() - started)
                errors += not ok

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed = time.perf_counter() - started
    return latencies, errors, elapsed


def load_in_process(url: str, clients: int, seconds: float, body: bytes
                    ) -> tuple[list[float], int, float]:
    """:func:`load` in a process of the client's pool."""
    return asyncio.run(load(url, clients, seconds, body))


def run_point(url: str, clients: int, seconds: float, body: bytes,
              pool: tuple[Executor, int] | None) -> Point:
    """One concurrency level: the clients split over the pool's processes (as evenly as they
    go), or in this process without a pool; requests/s over the slowest process's time."""
    if pool is None:
        results = [load_in_process(url, clients, seconds, body)]
    else:
        executor, processes = pool
        processes = min(clients, processes)
        shares = [clients // processes + (i < clients % processes) for i in range(processes)]
        futures = [executor.submit(load_in_process, url, share, seconds, body)
                   for share in shares]
        results = [future.result() for future in futures]
    ms = np.concatenate([np.asarray(latencies) for latencies, _, _ in results]) * 1000
    elapsed = max(seconds_taken for _, _, seconds_taken in results)
    return Point("", clients, len(ms) / elapsed, float(np.percentile(ms, 50)),
                 float(np.percentile(ms, 99)), sum(errors for _, errors, _ in results))


def client_pool(args: argparse.Namespace) -> tuple[Executor, int] | None:
    """The client's processes and their count (spawned: the parent may hold CUDA and Ray's
    threads); None for a client in this process."""
    if args.client_processes <= 1:
        return None
    return (ProcessPoolExecutor(args.client_processes, mp_context=get_context("spawn")),
            args.client_processes)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, server: subprocess.Popen[bytes], timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before answering")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer in {timeout_s:.0f} s")


def measure(name: str, url: str, args: argparse.Namespace, body: bytes,
            metrics_port: int | None = None) -> list[Point]:
    """Every concurrency level against one server; with ``metrics_port`` (Serve), also the
    mean time a request spent at Serve's proxy (where there is one) and in the replica."""
    points = []
    pool = client_pool(args)
    try:
        # Warm-up: connections, first batches, JIT and CUDA paths, the pool's processes.
        run_point(url, 4, 2.0, body, pool)
        for clients in args.clients:
            before = histogram_totals(metrics_port) if metrics_port else {}
            point = run_point(url, clients, args.seconds, body, pool)
            points.append(Point(name, clients, point.requests_per_s, point.p50_ms,
                                point.p99_ms, point.errors))
            line = (f"  {name:<56} {clients:>3} clients  {point.requests_per_s:8.0f} req/s  "
                    f"p50 {point.p50_ms:7.1f} ms  p99 {point.p99_ms:7.1f} ms  "
                    f"errors {point.errors}")
            if metrics_port:
                sent = point.requests_per_s * args.seconds
                after = exported(metrics_port, before["replica"][1] + sent * 0.99)
                means = {key: (after[key][0] - before[key][0]) / (after[key][1] - before[key][1])
                         for key in HISTOGRAMS if after[key][1] > before[key][1]}
                line += "  | " + ", ".join(f"{key} {ms:6.1f} ms" for key, ms in means.items())
            print(line, flush=True)
    finally:
        if pool is not None:
            pool[0].shutdown()
    return points


HISTOGRAMS = {"proxy": "ray_serve_http_request_latency_ms",
              "replica": "ray_serve_deployment_processing_latency_ms"}


def histogram_totals(metrics_port: int) -> dict[str, tuple[float, float]]:
    """``(sum, count)`` of Serve's latency histograms, read from Ray's metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as page:
        text = page.read().decode()
    totals = {}
    for key, name in HISTOGRAMS.items():
        total = count = 0.0
        for line in text.splitlines():
            if line.startswith(f"{name}_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith(f"{name}_count"):
                count += float(line.rsplit(" ", 1)[1])
        totals[key] = (total, count)
    return totals


def exported(metrics_port: int, requests: float) -> dict[str, tuple[float, float]]:
    """Histogram totals once the replica's count has reached ``requests`` (exports lag)."""
    deadline = time.time() + 30
    while True:
        totals = histogram_totals(metrics_port)
        if totals["replica"][1] >= requests or time.time() > deadline:
            return totals
        time.sleep(0.5)


def serve_floor(port: int, body: bytes, requests: int = 300) -> dict[str, float]:
    """p50 ms of Ray Serve's own request path: deployments that return at once, and that
    only read the request body (Serve's replica fetches it from the proxy with a Ray call)."""
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    @serve.deployment
    class ReturnAtOnce:
        async def __call__(self, request: Request) -> Response:
            return Response(b"{}")

    @serve.deployment
    class ReadBody:
        async def __call__(self, request: Request) -> Response:
            await request.body()
            return Response(b"{}")

    floors = {}
    deployments: tuple[tuple[str, Any], ...] = (("return at once", ReturnAtOnce),
                                                 ("read the body", ReadBody))
    for name, deployment in deployments:
        route = "/floor-" + name.replace(" ", "-")
        serve.run(deployment.bind(), name=route.strip("/"), route_prefix=route)
        latencies = []
        for _ in range(requests):
            started = time.perf_counter()
            request = urllib.request.Request(f"http://127.0.0.1:{port}{route}", data=body)
            with urllib.request.urlopen(request, timeout=30) as answer:
                answer.read()
            latencies.append(time.perf_counter() - started)
        floors[name] = float(np.percentile(np.asarray(latencies[requests // 10:]) * 1000, 50))
        serve.delete(route.strip("/"))
    return floors


# Ray Serve's ingress options, as the environment of the Ray instance that runs Serve (each
# says RAY_SERVE_ENABLE_HA_PROXY: HAProxy is what raydeck gives the Rays it starts).
INGRESS = {
    "proxy": {"RAY_SERVE_ENABLE_HA_PROXY": "0"},
    "haproxy": {"RAY_SERVE_ENABLE_HA_PROXY": "1"},
    "direct": {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"},
}
# --batching key: (label, --max-batch-size, --batch-wait-ms); wait-5ms only under the proxy.
BATCHING = {"adaptive": ("adaptive batching", 32, 0.0), "none": ("no batching", 1, 0.0),
            "wait-5ms": ("batching, 5 ms wait", 32, 5.0)}


def replica_devices(url: str, replicas: int, timeout_s: float = 60) -> dict[str, str]:
    """Each replica that answers ``/health`` through the ingress, and the device its model
    predicts on; asked until all ``replicas`` have answered (HAProxy learns of new replicas a
    moment after Serve reports them running) or ``timeout_s`` passed."""
    devices: dict[str, str] = {}
    deadline = time.time() + timeout_s
    while len(devices) < replicas and time.time() < deadline:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as answer:
            health = json.loads(answer.read())
        devices[health["replica"]] = str(health.get("device"))
        time.sleep(0.05)
    return devices


def raydeck_points(ingress: str, model_uri: str, args: argparse.Namespace,
                   body: bytes) -> None:
    """In a child process whose environment picked the ingress: each preset and batching
    setting, printed as ``POINT <json>`` lines for the parent (and Serve's floor under the
    default proxy)."""
    import ray
    from ray import serve

    from raydeck.config.settings import load_settings
    from raydeck.errors import InfeasibleResourcesError
    from raydeck.serving import ServeOptions, deploy
    from raydeck.train.feasibility import check_feasible
    from raydeck.train.presets import get_preset

    metrics_port = free_port()
    # The machine's cores and the GPUs Ray detects. Exports every second instead of 10, so
    # each point's histograms are read right after it.
    ray.init(num_cpus=CORES, _metrics_export_port=metrics_port, log_to_driver=False,
             _system_config={"metrics_report_interval_ms": 1000})
    resources = ray.cluster_resources()
    print(f"  Ray under {ingress}: {resources.get('CPU', 0):g} CPUs, "
          f"{resources.get('GPU', 0):g} GPUs", flush=True)
    serve_port = free_port()
    settings = load_settings()
    try:
        for preset_name in args.presets:
            preset = get_preset(preset_name, settings.presets_file)
            try:
                check_feasible(preset)
            except InfeasibleResourcesError as exc:
                print(f"  raydeck serve, {ingress}, {preset_name}: skipped, "
                      f"{str(exc).splitlines()[0]}", flush=True)
                continue
            for key in args.batching:
                label, batch, wait_ms = BATCHING[key]
                if wait_ms and ingress != "proxy":
                    continue
                options = ServeOptions(model_uri, name=f"bench-{preset_name}-{key}",
                                       preset=preset_name, max_batch_size=batch,
                                       batch_wait_timeout_s=wait_ms / 1000, port=serve_port)
                deploy(options, settings)
                devices = replica_devices(options.url, preset.max_workers)
                print(f"  raydeck serve, {ingress}, {preset_name}: {len(devices)} of "
                      f"{preset.max_workers} replica(s) answered /health, predicting on "
                      f"{', '.join(sorted(set(devices.values())))}", flush=True)
                for point in measure(f"raydeck serve, {ingress}, {preset_name}, {label}",
                                     f"{options.url}/invocations", args, body, metrics_port):
                    print("POINT " + json.dumps(point.__dict__), flush=True)
                serve.delete(options.name)
        if ingress == "proxy":
            print("FLOOR " + json.dumps(serve_floor(serve_port, body)), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()


def uvicorn_path() -> str:
    """``PATH`` for ``mlflow models serve``, which starts ``uvicorn --workers N`` from ``PATH``:
    this interpreter's directory (a venv's console scripts) and, for packages installed with
    ``pip install --target DIR``, ``DIR/bin``, where pip puts their console scripts."""
    spec = importlib.util.find_spec("uvicorn")
    if spec is None or spec.origin is None:
        raise RuntimeError("uvicorn is not installed: `mlflow models serve` needs it")
    scripts = Path(spec.origin).parents[1] / "bin"
    entries = [str(Path(sys.executable).parent)] + ([str(scripts)] if scripts.is_dir() else [])
    return os.pathsep.join([*entries, os.environ.get("PATH", "")])


WORKER_STARTED = "Application startup complete."


def mlflow_points(model_uri: str, workers: int, args: argparse.Namespace, body: bytes,
                  workdir: Path) -> list[Point]:
    port = free_port()
    log = workdir / f"mlflow-serve-{workers}.log"
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri,
         "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port),
         "--workers", str(workers)],
        stdout=subprocess.DEVNULL, stderr=log.open("w"),
        env={**os.environ, "PATH": uvicorn_path()})
    try:
        wait_ready(f"http://127.0.0.1:{port}/ping", server)
        # Each uvicorn worker takes connections once it has loaded the model: wait for all of
        # them, or the first points measure fewer workers.
        deadline = time.time() + 180
        while log.read_text().count(WORKER_STARTED) < workers and time.time() < deadline:
            time.sleep(0.5)
        return measure(f"mlflow models serve, {workers} worker(s)",
                       f"http://127.0.0.1:{port}/invocations", args, body)
    finally:
        server.terminate()
        server.wait(timeout=30)


def cpu_replicas_preset(replicas: int, workdir: Path) -> str:
    """A preset of ``replicas`` one-CPU workers, added as a user adds one: in a presets file
    that ``RAYDECK_PRESETS_FILE`` names (replicas = the preset's workers). Its name."""
    name = f"cpu-{replicas}"
    path = workdir / "presets.toml"
    path.write_text(f'[{name}]\nnum_workers = {replicas}\ncpus_per_worker = 1\n'
                    f'description = "{replicas} one-CPU replicas"\n')
    os.environ["RAYDECK_PRESETS_FILE"] = str(path)
    return name


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--seconds", type=float, default=10.0, help="per point")
    parser.add_argument("--ingress", nargs="+", choices=sorted(INGRESS), default=list(INGRESS))
    parser.add_argument("--presets", nargs="+", default=["cpu-1"],
                        help="scaling presets raydeck serve's replicas come from (gpu-quarter: "
                             "4 replicas on one GPU)")
    parser.add_argument("--cpu-replicas", type=int, default=0, metavar="N",
                        help="also a preset of N one-CPU replicas (e.g. half the cores)")
    parser.add_argument("--batching", nargs="+", choices=list(BATCHING), default=list(BATCHING),
                        help="raydeck serve's batching rows (wait-5ms: under proxy only)")
    parser.add_argument("--mlflow-workers", type=int, nargs="*",
                        default=sorted({1, CORES}),
                        help="uvicorn workers of each mlflow models serve (none: skip it)")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="processes the client's requests are split over")
    parser.add_argument("--child-model-uri", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from sklearn.datasets import load_digits

    body = json.dumps({"inputs": [load_digits().data[0].tolist()]}).encode()
    if args.child_model_uri:
        raydeck_points(args.ingress[0], args.child_model_uri, args, body)
        return
    workdir = Path(tempfile.mkdtemp(prefix="raydeck-bench-serving-"))
    tracking_uri = f"sqlite:///{workdir / 'mlflow.db'}"
    os.environ.update({"RAYDECK_TRACKING_URI": tracking_uri,
                       "RAYDECK_DATA_DIR": str(workdir / "data"), "RAY_AUTH_MODE": "disabled",
                       "MLFLOW_TRACKING_URI": tracking_uri, "RAY_USAGE_STATS_ENABLED": "0"})
    if args.cpu_replicas:
        args.presets.append(cpu_replicas_preset(args.cpu_replicas, workdir))
    model_uri = train_and_register(tracking_uri)
    print(f"model {model_uri}; {CORES} cores; load average {os.getloadavg()[0]:.2f}; "
          f"{args.seconds:g} s per point; client in {max(1, args.client_processes)} "
          "process(es)")

    import mlflow.pyfunc

    from raydeck.serving.server import model_device

    model = mlflow.pyfunc.load_model(model_uri)
    row = np.asarray([load_digits().data[0]])
    model.predict(row)  # first call: CUDA's kernels, where it is on a GPU
    started = time.perf_counter()
    for _ in range(200):
        model.predict(row)
    predict_ms = (time.perf_counter() - started) / 200 * 1000
    print(f"the model predicts on {model_device(model)} in this process, as in each "
          "`mlflow models serve` worker (MLflow's pytorch flavor takes CUDA whenever it sees a "
          "GPU)", flush=True)

    points: list[Point] = []
    for workers in args.mlflow_workers:
        points += mlflow_points(model_uri, workers, args, body, workdir)
    floors: dict[str, float] = {}
    for ingress in args.ingress:
        floors.update(run_child(ingress, model_uri, args, points, workdir))

    baseline = {p.clients: p for p in points if p.server == "mlflow models serve, 1 worker(s)"}
    if baseline:
        print("\nratios against mlflow models serve with 1 worker (throughput: higher is "
              "better; p50 and p99: lower is better)")
    for point in points:
        base = baseline.get(point.clients)
        if base is None or point is base:
            continue
        print(f"  {point.server:<60} {point.clients:>3} clients  throughput x"
              f"{point.requests_per_s / base.requests_per_s:5.2f}  p50 x"
              f"{point.p50_ms / base.p50_ms:5.2f}  p99 x{point.p99_ms / base.p99_ms:5.2f}")
    print(f"\nwhere the time goes: the model alone predicts one row in {predict_ms:.2f} ms (in "
          "process)" + ("; Ray Serve's own request path under its default proxy, one client, "
                        "p50: " + ", ".join(f"a deployment that {k} {v:.1f} ms"
                                           for k, v in floors.items()) if floors else ""))


def run_child(ingress: str, model_uri: str, args: argparse.Namespace, points: list[Point],
              workdir: Path) -> dict[str, float]:
    """raydeck serve under one ingress, in a child process whose environment picks it; its
    lines are printed as they come, its points added to ``points``. Serve's floor, if it
    measured one."""
    stderr = workdir / f"raydeck-{ingress}.log"
    floors: dict[str, float] = {}
    with stderr.open("w") as log:
        child = subprocess.Popen(
            [sys.executable, __file__, "--child-model-uri", model_uri, "--ingress", ingress,
             "--seconds", str(args.seconds), "--clients", *map(str, args.clients),
             "--presets", *args.presets, "--batching", *args.batching,
             "--client-processes", str(args.client_processes)],
            env={**os.environ, **INGRESS[ingress]}, stdout=subprocess.PIPE, stderr=log,
            text=True)
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith("POINT "):
                points.append(Point(**json.loads(line[len("POINT "):])))
            elif line.startswith("FLOOR "):
                floors = json.loads(line[len("FLOOR "):])
            else:
                print(line, end="", flush=True)
        child.wait()
    if child.returncode:
        print(f"  raydeck serve under {ingress}: exited {child.returncode}: "
              f"{stderr.read_text()[-2000:]}", flush=True)
    return floors


if __name__ == "__main__":
    main()
