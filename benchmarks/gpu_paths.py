"""Run raydeck's GPU paths on a real GPU and say what each one did.

Why: the test suite runs where CI runs, without GPUs. It checks GPU placement on fake GPUs
(``tests/fixtures/fake_gpu_cluster.py``: Ray schedules GPUs as numbers) and the NVML sampler
without NVML. Neither shows that the paths work on a device: that Ray detects the GPU, that a
preset's Ray Train workers see it through ``CUDA_VISIBLE_DEVICES`` and train on ``cuda``, that
fractional workers share one GPU's memory, that raydeck's NVML sampler reads the GPU and the
memory of the process it labels, and that those readings land in MLflow through the tracking
proxy. This script runs each path once on the machine's GPU(s) and prints what it saw.

Checks (each independent; a failure is recorded with its traceback and the next one runs):

- ``resources``: what Ray detects (GPU count, accelerator type) and raydeck's feasibility answers.
- ``fractional``: four actors of ``num_gpus=0.25`` hold CUDA memory at the same time; each one's
  GPU ids and what raydeck's sampler attributes to its process.
- ``sampler``: raydeck's NVML sampler (node and process view) inside a one-GPU task at work.
- ``train:<preset>[:<backend>]``: a Ray Train ``TorchTrainer`` with the preset's
  ``ScalingConfig`` trains raydeck's digits MLP on digits-shaped random data (prepare_model,
  prepare_data_loader); every worker reports its devices, GPU ids, epoch times and a sampler
  reading. Without a backend, the one ``raydeck.train.trainer.fit`` chooses (gloo for workers that
  share a GPU, else Ray Train's default: NCCL on GPUs).
- ``tracked``: ``raydeck.train.trainer.fit`` with a tracker (tracker -> proxy -> MLflow on a local
  SQLite store), then the system metrics read back from MLflow.

Results: one JSON file (``<out>/gpu_check.json``, rewritten after every check) and a summary on
stdout. Run: ``python benchmarks/gpu_paths.py [--out DIR] [--checks a,b,...]`` with raydeck
importable (installed, or ``PYTHONPATH=platform``). ``--fake-gpus N`` declares N GPUs to Ray on a
machine without CUDA (a dry run of the control flow: workers train on the CPU).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger("gpu_paths")

DEFAULT_CHECKS = (
    "resources", "fractional", "sampler", "train:gpu-1", "train:cpu-1",
    "train:gpu-quarter:gloo", "tracked", "train:gpu-quarter",
)
# Digits' shape: 1,797 8x8 images, 10 classes; random values keep the script download-free.
SAMPLES, FEATURES, CLASSES = 1797, 64, 10
BATCH_SIZE = 64
HOLD_MIB = 1024
BURST_S = 1.0
TRAIN_TIMEOUT_S = 120.0
_MIB = 1024 * 1024
_GIB = 1024**3


# --- helpers that run in Ray workers ------------------------------------------------------------
def _device_view() -> dict[str, Any]:
    """What this process sees of the GPU: Ray's ids, CUDA_VISIBLE_DEVICES and torch's view."""
    import ray
    import torch

    view: dict[str, Any] = {
        "pid": os.getpid(),
        "gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_available": torch.cuda.is_available(),
    }
    if view["cuda_available"]:
        view["device_count"] = torch.cuda.device_count()
        view["current_device"] = torch.cuda.current_device()
        view["device_name"] = torch.cuda.get_device_name(torch.cuda.current_device())
    return view


def _burst(device: Any, seconds: float) -> int:
    """Keep ``device`` busy with matrix products for about ``seconds``; returns the count."""
    import torch

    if device.type != "cuda":
        return 0
    a = torch.randn(4096, 4096, device=device)
    products = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(8):
            a = torch.tanh(a @ a)
        torch.cuda.synchronize(device)
        products += 8
    return products


def _sample(node_view: bool) -> dict[str, Any]:
    """One reading of raydeck's sampler, built the way a tracker builds it (``sampler_for``)."""
    from raydeck.tracking.client.context import detect_process
    from raydeck.tracking.client.system_metrics import assigned_gpus, sampler_for

    sampler = sampler_for(detect_process(), node_view=node_view)
    if sampler is None:
        return {"assigned_gpus": assigned_gpus(), "sampler": None}
    sampler.sample()  # primes the CPU counter and the rates, as the tracker's first sample does
    return {"assigned_gpus": assigned_gpus(), "values": sampler.sample()}


def _train_worker(config: dict[str, Any]) -> None:
    """Train raydeck's digits MLP on random digits-shaped data; write what this rank saw."""
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from raydeck.examples.digits import DigitsMLP, train_epoch

    context = ray.train.get_context()
    rank = context.get_world_rank()
    info: dict[str, Any] = {"rank": rank, "local_rank": context.get_local_rank(),
                            "world_size": context.get_world_size(), **_device_view()}
    try:
        on_gpu = torch.cuda.is_available() and bool(info["gpu_ids"])
        device = ray.train.torch.get_device() if on_gpu else torch.device("cpu")
        info["train_device"] = str(device)
        info["backend"] = dist.get_backend() if dist.is_initialized() else None
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(SAMPLES, FEATURES, generator=generator)
        y = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)
        loader = ray.train.torch.prepare_data_loader(
            DataLoader(TensorDataset(x, y), batch_size=BATCH_SIZE, shuffle=True),
            move_to_device=on_gpu)
        torch.manual_seed(0)
        model = ray.train.torch.prepare_model(DigitsMLP(), move_to_device=device)
        info["model_device"] = str(next(model.parameters()).device)
        info["model_wrapped"] = type(model).__name__
        optimizer = torch.optim.Adam(model.parameters(), lr=0.003)
        epoch_times, losses = [], []
        for epoch in range(int(config["epochs"])):
            if isinstance(loader.sampler, DistributedSampler):
                loader.sampler.set_epoch(epoch)
            started = time.perf_counter()
            loss, _samples = train_epoch(model, loader, optimizer)
            if on_gpu:
                torch.cuda.synchronize(device)
            epoch_times.append(time.perf_counter() - started)
            losses.append(loss)
        info.update(epoch_time_s=epoch_times, train_loss=losses)
        if on_gpu:
            info["current_device_after_training"] = torch.cuda.current_device()
            info["memory_allocated_bytes"] = torch.cuda.memory_allocated(device)
            hold = torch.ones(64 * _MIB // 4, device=device)
            info["burst_products"] = _burst(device, BURST_S)
            info["sampler"] = _sample(node_view=False)
            del hold
    except Exception:
        info["error"] = traceback.format_exc()
    Path(config["out"], f"rank_{rank}.json").write_text(json.dumps(info))
    if "error" in info:
        raise RuntimeError(f"rank {rank}: {info['error'].splitlines()[-1]}")


def _tracked_worker(config: dict[str, Any]) -> None:
    """Log a few epochs through raydeck's tracker while holding CUDA memory and working."""
    import ray.train
    import ray.train.torch
    import torch

    import raydeck

    with raydeck.get_tracker() as tracker:
        on_gpu = torch.cuda.is_available() and bool(ray.get_gpu_ids())
        device = ray.train.torch.get_device() if on_gpu else torch.device("cpu")
        hold = torch.ones(HOLD_MIB * _MIB // 4, device=device)
        for epoch in range(int(config["epochs"])):
            started = time.perf_counter()
            products = _burst(device, float(config["burst_s"]))
            if not on_gpu:
                time.sleep(float(config["burst_s"]))
            tracker.log_metrics({"epoch_time_s": time.perf_counter() - started,
                                 "products": float(products)}, step=epoch)
        del hold


# --- checks (driver side) -----------------------------------------------------------------------
def check_resources() -> dict[str, Any]:
    """What Ray detected on this machine, and raydeck's feasibility answers for GPU presets."""
    import ray
    import torch

    from raydeck.errors import InfeasibleResourcesError
    from raydeck.train.feasibility import check_feasible, cluster_resources
    from raydeck.train.presets import get_preset

    value: dict[str, Any] = {
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "cluster_resources": ray.cluster_resources(),
        "nodes": [{"resources": node["Resources"], "labels": node.get("Labels", {})}
                  for node in ray.nodes() if node["Alive"]],
    }
    value["accelerator_types"] = sorted(
        name.split(":", 1)[1] for name in value["cluster_resources"]
        if name.startswith("accelerator_type:"))
    try:
        import pynvml

        pynvml.nvmlInit()
        value["nvml_driver"] = pynvml.nvmlSystemGetDriverVersion()
        value["nvml_devices"] = [
            pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception as exc:
        value["nvml_error"] = repr(exc)
    value["raydeck_node_totals"] = cluster_resources()[0]
    feasible: dict[str, Any] = {}
    for name in ("gpu-1", "gpu-half", "gpu-quarter", "gpu-2"):
        try:
            feasible[name] = check_feasible(get_preset(name)).message
        except InfeasibleResourcesError as exc:
            feasible[name] = f"infeasible: {exc}"
    value["feasibility"] = feasible
    return value


def check_fractional() -> dict[str, Any]:
    """Four quarter-GPU actors allocate CUDA memory and hold it together."""
    import ray

    @ray.remote(num_cpus=1, num_gpus=0.25)
    class Holder:
        def __init__(self) -> None:
            self.buffer: Any = None

        def hold(self, mib: int) -> dict[str, Any]:
            import torch

            view = _device_view()
            if view["cuda_available"]:
                self.buffer = torch.ones(mib * _MIB // 4, device="cuda")
                torch.cuda.synchronize()
                view["memory_allocated_bytes"] = torch.cuda.memory_allocated()
                view["buffer_device"] = str(self.buffer.device)
            return view

        def sample(self) -> dict[str, Any]:
            return _sample(node_view=False)

    holders = [Holder.remote() for _ in range(4)]  # type: ignore[attr-defined]
    try:
        views = ray.get([h.hold.remote(HOLD_MIB) for h in holders], timeout=120)
        # All four hold their buffer now: each sampler reading sees the others' memory too.
        samples = ray.get([h.sample.remote() for h in holders], timeout=60)
        node = _sample_node()
    finally:
        for holder in holders:
            ray.kill(holder)
    for view, sample in zip(views, samples, strict=True):
        view["sampler"] = sample
    return {"actors": views, "node_view_while_holding": node,
            "distinct_pids": len({v["pid"] for v in views}),
            "gpu_ids": sorted({gpu for v in views for gpu in v["gpu_ids"]})}


def _sample_node() -> dict[str, float]:
    """The driver's node-view reading (every GPU of the node)."""
    import ray

    from raydeck.tracking.client.system_metrics import SystemSampler

    sampler = SystemSampler(ray.util.get_node_ip_address())
    sampler.sample()
    return sampler.sample()


def check_sampler() -> dict[str, Any]:
    """raydeck's sampler in a one-GPU task while the task holds memory and keeps the GPU busy."""
    import ray

    @ray.remote(num_cpus=1, num_gpus=1)
    def work_and_sample() -> dict[str, Any]:
        import torch

        view = _device_view()
        if not view["cuda_available"]:
            view["idle_sample"] = _sample(node_view=True)
            return view
        device = torch.device("cuda")
        hold = torch.ones(2 * 1024 * _MIB // 4, device=device)
        view["idle_sample"] = _sample(node_view=True)
        readings: list[dict[str, Any]] = []
        stop = threading.Event()

        def sample_while_busy() -> None:
            while not stop.wait(0.5):
                readings.append(_sample(node_view=True))

        thread = threading.Thread(target=sample_while_busy)
        thread.start()
        view["burst_products"] = _burst(device, 3.0)
        stop.set()
        thread.join()
        view["busy_samples"] = readings
        view["torch_memory_reserved_bytes"] = torch.cuda.memory_reserved(device)
        del hold
        return view

    view = ray.get(work_and_sample.remote(), timeout=180)
    keys = set(view["idle_sample"].get("values", {}))
    for reading in view.get("busy_samples", []):
        keys.update(reading.get("values", {}))
    view["metric_keys"] = sorted(keys)
    return view


def check_train(preset_name: str, backend: str | None, storage: Path, epochs: int,
                timeout_s: float) -> dict[str, Any]:
    """One TorchTrainer with ``preset_name``'s ScalingConfig; every rank's report."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from raydeck.train.presets import get_preset
    from raydeck.train.trainer import torch_config

    preset = get_preset(preset_name)
    name = f"{preset_name}-{backend or 'default'}-{int(time.time())}"
    out = storage / name
    out.mkdir(parents=True)
    # Without a backend: the one raydeck.train.trainer.fit chooses for these workers.
    config = TorchConfig(backend=backend) if backend else torch_config(preset.scaling_config())
    trainer = TorchTrainer(
        _train_worker, train_loop_config={"out": str(out), "epochs": epochs},
        scaling_config=preset.scaling_config(),
        run_config=ray.train.RunConfig(name=name, storage_path=str(storage),
                                       failure_config=ray.train.FailureConfig(max_failures=0)),
        torch_config=config,
    )
    value: dict[str, Any] = {"preset": preset_name, "backend": config.backend or "ray default",
                             "resources_per_worker": preset.resources_per_worker()}
    started = time.perf_counter()
    outcome = _with_timeout(trainer.fit, timeout_s)
    value["fit_s"] = time.perf_counter() - started
    value["workers"] = [json.loads(path.read_text()) for path in sorted(out.glob("rank_*.json"))]
    value.update(outcome)
    value.update(_leftovers())
    return value


def _with_timeout(call: Callable[[], Any], timeout_s: float) -> dict[str, Any]:
    """Run ``call`` (a ``fit``) in this thread; past ``timeout_s`` it gets SIGINT, which Ray
    Train's driver handler turns into an abort of the run (its workers and resources go)."""
    outcome: dict[str, Any] = {}
    fired = threading.Event()

    def interrupt() -> None:
        fired.set()
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Timer(timeout_s, interrupt)
    timer.start()
    try:
        call()
    except BaseException as exc:  # KeyboardInterrupt too: the timeout's SIGINT
        outcome["fit_error"] = f"{type(exc).__name__}: {exc}"
    finally:
        timer.cancel()
    if fired.is_set():
        outcome["fit_error"] = (f"aborted after {timeout_s:.0f} s (timeout); "
                                f"{outcome.get('fit_error', 'fit returned')}")
    return outcome


def _leftovers(wait_s: float = 15.0) -> dict[str, Any]:
    """Wait for a finished check's resources to come back; remove placement groups it left."""
    import ray
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    totals = ray.cluster_resources()
    deadline = time.monotonic() + wait_s
    available = ray.available_resources()
    while time.monotonic() < deadline:
        available = ray.available_resources()
        if all(available.get(k, 0.0) + 1e-6 >= totals.get(k, 0.0) for k in ("CPU", "GPU")):
            return {}
        time.sleep(0.5)
    removed = []
    for pg_id, entry in ray.util.placement_group_table().items():
        if entry.get("state") in ("CREATED", "PENDING", "RESCHEDULING"):
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
            removed.append({"id": pg_id, "state": entry.get("state"),
                            "bundles": entry.get("bundles")})
    return {"resources_held_after_check": {k: totals.get(k, 0.0) - available.get(k, 0.0)
                                           for k in ("CPU", "GPU")},
            "removed_placement_groups": removed}


def check_tracked(preset_name: str, epochs: int, timeout_s: float) -> dict[str, Any]:
    """raydeck.train.trainer.fit with a tracker; system metrics read back from MLflow."""
    from mlflow import MlflowClient

    from raydeck.cluster.connection import connect
    from raydeck.config.settings import load_settings
    from raydeck.tracking import get_tracker
    from raydeck.train.presets import get_preset
    from raydeck.train.trainer import fit

    settings = connect(load_settings())
    preset = get_preset(preset_name)
    started = time.perf_counter()
    with get_tracker(run_name="gpu-paths", settings=settings,
                     params={"preset": preset.name}) as tracker:
        outcome = _with_timeout(lambda: fit(
            _tracked_worker, tracker=tracker, settings=settings,
            train_loop_config={"epochs": epochs, "burst_s": BURST_S},
            scaling_config=preset.scaling_config(), max_failures=0, checkpoints_to_keep=1),
            timeout_s)
    value: dict[str, Any] = {"preset": preset_name, "fit_and_finish_s":
                             time.perf_counter() - started, "tracking_uri": settings.tracking.uri,
                             "run_id": tracker.run_id, **outcome, **_leftovers()}
    client = MlflowClient(settings.tracking.uri)
    metrics: dict[str, float] = {}
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline:
        metrics = client.get_run(tracker.run_id).data.metrics
        if any("/gpu_" in key for key in metrics):
            break
        time.sleep(1.0)
    value["metric_keys"] = sorted(metrics)
    value["latest_system_metrics"] = {k: v for k, v in sorted(metrics.items())
                                      if k.startswith("system/")}
    value["process_gpu_history"] = {
        key: [(m.step, m.value) for m in sorted(client.get_metric_history(tracker.run_id, key),
                                                key=lambda m: m.step)]
        for key in metrics if "/rank_" in key and key.endswith(
            ("process_memory_used_gb", "utilization_percent", "nvml_index"))
    }
    return value


# --- driver -------------------------------------------------------------------------------------
def run_check(name: str, args: argparse.Namespace, storage: Path) -> dict[str, Any]:
    if name == "resources":
        return check_resources()
    if name == "fractional":
        return check_fractional()
    if name == "sampler":
        return check_sampler()
    if name == "tracked":
        return check_tracked(args.tracked_preset, args.epochs, args.train_timeout)
    if name.startswith("train:"):
        _, preset, *backend = name.split(":")
        return check_train(preset, backend[0] if backend else None, storage, args.epochs,
                           args.train_timeout)
    raise ValueError(f"unknown check {name!r}; known: {', '.join(DEFAULT_CHECKS)}")


def _failed(value: dict[str, Any]) -> bool:
    return "fit_error" in value or any("error" in w for w in value.get("workers", []))


def summarize(results: dict[str, Any]) -> list[str]:
    """One line or a few per check, for people."""
    lines = []
    for name, entry in results["checks"].items():
        if "value" not in entry:
            lines.append(f"{name}: FAILED after {entry['seconds']:.1f} s: "
                         f"{entry['error'].strip().splitlines()[-1]}")
            continue
        value = entry["value"]
        head = f"{name} ({entry['seconds']:.1f} s{'' if entry['ok'] else ', FAILED'})"
        if name == "resources":
            lines.append(f"{head}: GPU={value['cluster_resources'].get('GPU')} "
                         f"accelerator_types={value['accelerator_types']} "
                         f"devices={value['cuda_devices']}")
        elif name == "fractional":
            for actor in value["actors"]:
                memory = actor.get("sampler", {}).get("values", {})
                process = {k.rsplit("/", 1)[1]: round(v, 3) for k, v in memory.items()
                           if k.endswith(("process_memory_used_gb", "nvml_index"))}
                lines.append(f"{head}: pid {actor['pid']} gpu_ids={actor['gpu_ids']} "
                             f"CUDA_VISIBLE_DEVICES={actor['cuda_visible_devices']} "
                             f"allocated={actor.get('memory_allocated_bytes')} {process}")
        elif name == "sampler":
            lines.append(f"{head}: keys={value['metric_keys']}")
            for reading in value.get("busy_samples", [])[-1:]:
                lines.append(f"{head}: busy reading {reading.get('values')}")
        elif name.startswith("train:"):
            status = f"error: {value['fit_error']}" if "fit_error" in value else "ok"
            lines.append(f"{head}: fit {value['fit_s']:.1f} s, {status}")
            for worker in value["workers"]:
                times = ", ".join(f"{t * 1000:.0f}" for t in worker.get("epoch_time_s", []))
                lines.append(
                    f"  rank {worker['rank']}: CUDA_VISIBLE_DEVICES="
                    f"{worker['cuda_visible_devices']} gpu_ids={worker['gpu_ids']} "
                    f"current_device={worker.get('current_device')} "
                    f"device={worker.get('train_device')} backend={worker.get('backend')} "
                    f"epoch ms=[{times}]"
                    + (f" ERROR {worker['error'].strip().splitlines()[-1]}"
                       if "error" in worker else ""))
        elif name == "tracked":
            lines.append(f"{head}: run {value['run_id']}, "
                         f"{len(value['latest_system_metrics'])} system metrics")
            for key, points in value["process_gpu_history"].items():
                lines.append(f"  {key}: {points}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for gpu_check.json (default: temp)")
    parser.add_argument("--checks", default=",".join(DEFAULT_CHECKS),
                        help="comma-separated checks, run in this order")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--num-cpus", type=int, default=8)
    parser.add_argument("--tracked-preset", default="gpu-1")
    parser.add_argument("--train-timeout", type=float, default=TRAIN_TIMEOUT_S,
                        help="seconds before a Ray Train run is aborted")
    parser.add_argument("--fake-gpus", type=int, default=None,
                        help="declare this many GPUs to Ray (dry run without CUDA)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu-paths-"))
    out.mkdir(parents=True, exist_ok=True)
    storage = Path(tempfile.mkdtemp(prefix="gpu-paths-train-"))
    # Ray workers inherit the driver's environment: they log to this data dir's SQLite MLflow
    # and sample system metrics often enough for a short run.
    os.environ.setdefault("RAYDECK_DATA_DIR", str(storage / "raydeck"))
    os.environ.setdefault("RAYDECK_TRACKING_SYSTEM_METRICS_INTERVAL_S", "0.5")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    import ray

    started = time.perf_counter()
    # A new local instance even where another Ray runs on this machine (a session's cluster).
    ray.init(address="local", num_cpus=args.num_cpus, num_gpus=args.fake_gpus,
             include_dashboard=False,
             logging_level=logging.WARNING)
    results: dict[str, Any] = {"python": sys.version, "ray": ray.__version__,
                               "ray_init_s": time.perf_counter() - started, "checks": {}}
    path = out / "gpu_check.json"
    try:
        for name in [c.strip() for c in args.checks.split(",") if c.strip()]:
            logger.info("check %s", name)
            started = time.perf_counter()
            entry: dict[str, Any]
            try:
                value = run_check(name, args, storage)
                entry = {"ok": not _failed(value), "value": value}
            except Exception:
                entry = {"ok": False, "error": traceback.format_exc()}
                logger.error("check %s failed:\n%s", name, entry["error"])
            entry["seconds"] = time.perf_counter() - started
            if not entry["ok"] and "value" in entry:
                entry["error"] = entry["value"].get("fit_error") or next(
                    w["error"] for w in entry["value"]["workers"] if "error" in w)
            results["checks"][name] = entry
            path.write_text(json.dumps(results, indent=1, default=str))
            for line in summarize({"checks": {name: entry}}):
                print(line, flush=True)
    finally:
        ray.shutdown()
    print(f"results: {path}", flush=True)
    return 0 if all(e["ok"] for e in results["checks"].values()) else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # A check that hung leaves a thread behind in Ray Train; don't wait for it.
    os._exit(code)
