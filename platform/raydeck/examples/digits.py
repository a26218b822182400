"""The digits classifier: raydeck's reference training job, plain PyTorch on Ray Train.

scikit-learn's ``load_digits`` ships inside the package (1,797 8x8 images, 10 classes), so the
job needs no download. :func:`train_loop_per_worker` is the part to copy into your own jobs: it
gets its tracker without arguments, resumes from the latest checkpoint, and reports every epoch
through :func:`raydeck.train.checkpointing.report_epoch` so the run's history holds each epoch once,
also across worker failures. ``raydeck demo``, ``jobs/digits_torch.py`` and the sweeps use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import logging
import os
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from raydeck._internal.atomic_file import atomic_write
from raydeck._internal.redaction import RedactingFilter, redact_url
from raydeck.errors import ConfigError, JobPreemptedError
from raydeck.models import Standardized

if TYPE_CHECKING:
    from raydeck.config.settings import Settings
    from raydeck.tracking import Tracker

logger = logging.getLogger(__name__)

DEFAULT_CONFIG: dict[str, Any] = {
    "epochs": 10,
    "lr": 0.003,
    "hidden": 128,
    "batch_size": 64,
    "dropout": 0.1,
    "seed": 0,
}
VAL_FRACTION = 0.2
PIXEL_MAX = 16.0
MIN_PIXEL_STD = 0.1  # of the pixel range


def raw_split(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits as users have them, 0-16 per pixel as float64 (scikit-learn's own dtype):
    ``(x_train, y_train, x_val, y_val)``.

    The split is stratified and fixed by ``seed``, so every job, test and model sees the same
    validation rows for the same seed. scikit-learn computes it once per machine, seed and
    scikit-learn version; later calls read it from a cache file (:func:`split_cache_path`),
    because importing scikit-learn costs every Ray Train worker about 1.5 s of start-up.
    """
    cache = split_cache_path(seed)
    try:
        with np.load(cache) as saved:
            return saved["x_train"], saved["y_train"], saved["x_val"], saved["y_val"]
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
        pass  # not cached yet (or a torn file from another version): compute it
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x_train, x_val, y_train, y_val = train_test_split(
        data.data, data.target, test_size=VAL_FRACTION, random_state=seed,
        stratify=data.target,
    )
    split = x_train, y_train.astype(np.int64), x_val, y_val.astype(np.int64)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        # Written aside and renamed, as the stack's files are: workers starting together never
        # read half a file.
        with atomic_write(cache, binary=True) as handle:
            np.savez(handle, **dict(zip(("x_train", "y_train", "x_val", "y_val"), split,
                                        strict=True)))
    except OSError as exc:  # a read-only home: every call computes the split, as before
        logger.debug("digits split not cached at %s: %s", cache, exc)
    return split


def split_cache_path(seed: int) -> Path:
    """Where :func:`raw_split` keeps the split for ``seed``: under ``$XDG_CACHE_HOME/raydeck``
    (``~/.cache/raydeck``), named by scikit-learn's version, which defines the split."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "raydeck" / f"digits-sklearn-{importlib.metadata.version('scikit-learn')}-" \
                              f"seed{seed}-val{VAL_FRACTION}.npz"


def pixel_scaling(x_train: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-pixel ``(mean, std)`` of raw training rows, what training standardizes with."""
    # Border pixels are (almost) always 0 in the training split; a floor on their spread keeps
    # the rare validation image with ink there from becoming a huge input.
    return x_train.mean(axis=0), np.maximum(x_train.std(axis=0), MIN_PIXEL_STD * PIXEL_MAX)


def load_split(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Standardized digits as float32 ``(x_train, y_train, x_val, y_val)``, split by ``seed``."""
    x_train, y_train, x_val, y_val = raw_split(seed)
    mean, std = pixel_scaling(x_train)
    return (((x_train - mean) / std).astype(np.float32), y_train,
            ((x_val - mean) / std).astype(np.float32), y_val)


def servable(model: nn.Module, seed: int = 0) -> tuple[Standardized, np.ndarray]:
    """The trained model as users call it: raw pixels in (the job's scaling inside), CPU.

    Returns the model and an input example (two raw validation rows) for its signature.
    """
    x_train, _, x_val, _ = raw_split(seed)
    # DDP wraps the trained module; the registered model is the plain one.
    inner = getattr(model, "module", model)
    plain = inner if isinstance(inner, nn.Module) else model
    return Standardized(plain.cpu(), *pixel_scaling(x_train)), x_val[:2]


class DigitsMLP(nn.Module):
    """A small MLP: 64 pixels -> hidden -> hidden -> 10 classes."""

    def __init__(self, hidden: int = 128, dropout: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on ``(x, y)``."""
    model.eval()
    with torch.no_grad():
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y).item()
        accuracy = (logits.argmax(dim=1) == y).float().mean().item()
    model.train()
    return loss, accuracy


def train_epoch(model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer
                ) -> tuple[float, int]:
    """One pass over ``loader``; returns mean training loss and samples seen."""
    total_loss, samples = 0.0, 0
    for xb, yb in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        total_loss += loss.item() * len(xb)
        samples += len(xb)
    return total_loss / max(samples, 1), samples


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Train the digits MLP on one Ray Train worker; every worker runs this."""
    import ray.train
    import ray.train.torch

    import raydeck
    from raydeck.models import save_torch_model
    from raydeck.train.checkpointing import report_epoch, restore

    config = {**DEFAULT_CONFIG, **config}
    # No run id is passed: the tracker finds the run this Ray Train job belongs to.
    with raydeck.get_tracker() as tracker:
        tracker.log_params({k: config[k] for k in DEFAULT_CONFIG})
        torch.manual_seed(config["seed"])
        x_train, y_train, x_val, y_val = load_split(config["seed"])
        loader = DataLoader(
            TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
            batch_size=config["batch_size"], shuffle=True,
        )
        # prepare_* add the DistributedSampler and DDP wrapper (and move to GPU when there is one).
        loader = ray.train.torch.prepare_data_loader(loader)
        model = ray.train.torch.prepare_model(DigitsMLP(config["hidden"], config["dropout"]))
        optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
        device = ray.train.torch.get_device()
        x_val_t, y_val_t = torch.from_numpy(x_val).to(device), torch.from_numpy(y_val).to(device)

        state = restore(tracker, model=model, optimizer=optimizer)
        first_epoch = state.epoch + 1 if state else 0
        for epoch in range(first_epoch, config["epochs"]):
            if isinstance(loader.sampler, DistributedSampler):
                loader.sampler.set_epoch(epoch)
            started = time.perf_counter()
            train_loss, samples = train_epoch(model, loader, optimizer)
            elapsed = time.perf_counter() - started
            val_loss, val_accuracy = evaluate(model, x_val_t, y_val_t)
            preempted = report_epoch(
                tracker,
                {"train_loss": train_loss, "val_loss": val_loss, "val_accuracy": val_accuracy,
                 "samples_per_s": samples / elapsed, "epoch_time_s": elapsed},
                epoch=epoch, model=model, optimizer=optimizer,
            )
            if preempted:
                return  # the queue resumes the job from this epoch's checkpoint
        if ray.train.get_context().get_world_rank() == 0:
            with tempfile.TemporaryDirectory() as tmp:
                served, example = servable(model, config["seed"])
                tracker.log_artifact(save_torch_model(served, Path(tmp), example))


@dataclass(frozen=True)
class DigitsRun:
    """What a finished digits job tells its caller."""

    run_id: str
    run_name: str
    experiment_id: str
    val_accuracy: float
    checkpoint_path: str
    tracking_uri: str
    wall_time_s: float
    registered_model_uri: str | None = None


def run_digits(
    *,
    preset: str = "cpu-2",
    config: dict[str, Any] | None = None,
    run_name: str = "digits",
    run_id: str | None = None,
    mode: str | None = None,
    settings: Settings | None = None,
    watch: Callable[[Tracker, threading.Event], None] | None = None,
    train_fn: Callable[[dict[str, Any]], None] = train_loop_per_worker,
    register_as: str | None = None,
) -> DigitsRun:
    """Train the digits classifier on Ray Train, tracked in MLflow; the driver side of the job.

    Validates the preset and the cluster's capacity before starting anything. With ``watch``,
    training runs in a background thread while ``watch(tracker, done)`` runs in the caller's
    thread (the CLI draws its progress display there) until ``done`` is set. ``train_fn`` is the
    per-worker loop: plain PyTorch (:func:`train_loop_per_worker`, the default) or Lightning
    (:func:`raydeck.examples.digits_lightning.train_loop_per_worker`).

    With ``run_id`` (or ``RAYDECK_RUN_ID``) naming a run whose driver died, training resumes in
    that run from its latest committed checkpoint: Ray Train's storage folder is named by the
    run id, and the tracker attaches to the existing MLflow run.

    With ``register_as``, the run's model (raw pixels in, the job's scaling inside) becomes a
    new version of that registered model once the run has ended, tagged with the run, its git
    commit and its ``val_accuracy``.

    Raises:
        PresetError: unknown or invalid preset.
        InfeasibleResourcesError: the cluster can never run the preset.
    """
    from raydeck.cluster.connection import connect
    from raydeck.config.settings import load_settings
    from raydeck.tracking import get_tracker
    from raydeck.train.feasibility import check_feasible
    from raydeck.train.presets import get_preset
    from raydeck.train.trainer import fit

    started = time.perf_counter()
    settings = settings or load_settings()
    chosen = get_preset(preset, settings.presets_file)
    config = {**DEFAULT_CONFIG, **(config or {})}
    if int(config["epochs"]) < 1:
        raise ConfigError(f"epochs={config['epochs']}: must be >= 1")
    if register_as is not None:
        from raydeck.models import check_model_name

        check_model_name(register_as)
    connect(settings, log_to_driver=watch is None)
    feasibility = check_feasible(chosen)
    if not feasibility.runs_now:
        logger.warning(feasibility.message)
    params = {"preset": chosen.name, "num_workers": chosen.workers_label}
    with get_tracker(run_id, run_name=run_name, mode=mode, settings=settings,
                     params=params) as tracker:
        outcome: dict[str, Any] = {}

        def train() -> None:
            try:
                outcome["result"] = fit(
                    train_fn, tracker=tracker, settings=settings,
                    train_loop_config=config, scaling_config=chosen.scaling_config(),
                    max_failures=chosen.max_failures,
                    checkpoints_to_keep=chosen.checkpoints_to_keep,
                )
            except BaseException as exc:
                outcome["error"] = exc
            finally:
                done.set()

        done = threading.Event()
        if watch is None:
            train()
        else:
            thread = threading.Thread(target=train, name="raydeck-digits-fit", daemon=True)
            thread.start()
            watch(tracker, done)
            thread.join()
        if "error" in outcome:
            raise outcome["error"]
        result = outcome["result"]
        run = DigitsRun(
            run_id=tracker.run_id, run_name=tracker.run_name,
            experiment_id=tracker.experiment_id,
            val_accuracy=float(result.metrics["val_accuracy"]),
            checkpoint_path=result.checkpoint.path if result.checkpoint else "",
            tracking_uri=settings.tracking.uri, wall_time_s=0.0,
        )
    registered = None
    if register_as:
        from raydeck.models import register_run_model
        from raydeck.storage import credentials_in_env

        with credentials_in_env(settings.storage):
            registered = register_run_model(settings.tracking.uri, run.run_id, register_as,
                                            "val_accuracy").uri
    return dataclasses.replace(run, wall_time_s=time.perf_counter() - started,
                               registered_model_uri=registered)


SWEEP_REPORTS = ("val_accuracy", "val_loss", "train_loss", "trial_setup_s")
DISTRIBUTED_SWEEP_REPORTS = ("train_loss", "val_loss", "val_accuracy", "samples_per_s",
                             "epoch_time_s")


def load_sweep_data(seed: int = 0) -> dict[str, np.ndarray]:
    """The digits split as arrays, loaded once on the sweep's driver (then in the object store)."""
    x_train, y_train, x_val, y_val = load_split(seed)
    return {"x_train": x_train, "y_train": y_train, "x_val": x_val, "y_val": y_val}


def sweep_trial(config: dict[str, Any], data: dict[str, np.ndarray]) -> None:
    """One single-process Tune trial of the digits MLP.

    Each Tune iteration trains ``epochs_per_iteration`` epochs, so an iteration carries enough
    work for early stopping to save real time. Tune stops the trial (max_t, or ASHA) from
    inside :func:`raydeck.tune.report`.
    """
    import itertools

    import raydeck.tune

    started = time.perf_counter()
    config = {**DEFAULT_CONFIG, "epochs_per_iteration": 1, **config}
    torch.manual_seed(int(config["seed"]))
    model = DigitsMLP(int(config["hidden"]), float(config["dropout"]))
    optimizer = torch.optim.Adam(model.parameters(), lr=float(config["lr"]))
    loader = DataLoader(
        TensorDataset(torch.from_numpy(data["x_train"]), torch.from_numpy(data["y_train"])),
        batch_size=int(config["batch_size"]), shuffle=True,
    )
    x_val, y_val = torch.from_numpy(data["x_val"]), torch.from_numpy(data["y_val"])
    done = raydeck.tune.restore(model, optimizer)
    # Under PBT the restored optimizer state may come from another trial: this trial's lr wins.
    for group in optimizer.param_groups:
        group["lr"] = float(config["lr"])
    setup_s = time.perf_counter() - started
    for _ in itertools.count(done + 1):
        for _epoch in range(int(config["epochs_per_iteration"])):
            train_loss, _samples = train_epoch(model, loader, optimizer)
        val_loss, val_accuracy = evaluate(model, x_val, y_val)
        raydeck.tune.report(
            {"val_accuracy": val_accuracy, "val_loss": val_loss, "train_loss": train_loss,
             "trial_setup_s": setup_s},
            model=model, optimizer=optimizer,
        )


def _sweep_model(config: dict[str, Any]) -> DigitsMLP:
    """The trial's model; what the space leaves out has the job's default, as in training."""
    config = {**DEFAULT_CONFIG, **config}
    return DigitsMLP(int(config["hidden"]), float(config["dropout"]))


def _sweep_servable(model: DigitsMLP, config: dict[str, Any]) -> tuple[Standardized, np.ndarray]:
    """A trial's model as users call it, scaled with its own split's statistics."""
    return servable(model, int({**DEFAULT_CONFIG, **config}["seed"]))


def digits_sweep_job() -> Any:
    """The digits classifier as a :class:`raydeck.tune.SweepJob` of single-process trials."""
    from raydeck.tune import SweepJob

    return SweepJob(train_fn=sweep_trial, reports=SWEEP_REPORTS, load_data=load_sweep_data,
                    model_factory=_sweep_model, serving_model=_sweep_servable)


def digits_distributed_sweep_job() -> Any:
    """The digits classifier as a :class:`raydeck.tune.SweepJob` whose trials each run
    :func:`train_loop_per_worker` on the preset's Ray Train workers (one epoch per iteration;
    set ``epochs`` in the space to at least ``max_t``)."""
    from raydeck.tune import SweepJob

    return SweepJob(train_fn=train_loop_per_worker, reports=DISTRIBUTED_SWEEP_REPORTS,
                    model_factory=_sweep_model, serving_model=_sweep_servable,
                    distributed=True)


def job_arguments(description: str, run_name: str) -> argparse.ArgumentParser:
    """The command line of the digits jobs (``jobs/digits_*.py``): preset, run and config.

    Every key of :data:`DEFAULT_CONFIG` is an option (``--batch-size 32``). ``--preset`` and
    ``--run-name`` default to ``RAYDECK_PRESET`` and ``RAYDECK_RUN_NAME``, which ``raydeck
    submit`` sets (its job contract), then to ``cpu-2`` and ``run_name``.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--preset", default=os.environ.get("RAYDECK_PRESET") or "cpu-2",
                        help="scaling preset (raydeck presets; default RAYDECK_PRESET, else "
                             "cpu-2)")
    parser.add_argument("--run-name", default=os.environ.get("RAYDECK_RUN_NAME") or run_name,
                        help=f"MLflow run name (default RAYDECK_RUN_NAME, else {run_name})")
    parser.add_argument("--run-id", default=None,
                        help="shared run id: resume or join this run (default RAYDECK_RUN_ID)")
    parser.add_argument("--mode", default=None, choices=["rank_zero", "all_ranks", "per_rank"],
                        help="tracking mode (default RAYDECK_TRACKING_MODE)")
    parser.add_argument("--register-as", default=None, metavar="NAME",
                        help="register the run's model as a new version of NAME")
    for name, default in DEFAULT_CONFIG.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    return parser


def run_job(train_fn: Callable[[dict[str, Any]], None], *, description: str, run_name: str,
            argv: list[str] | None = None) -> DigitsRun:
    """The ``main`` of a digits job: parse its command line, train, log where the run is."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())
    args = job_arguments(description, run_name).parse_args(argv)
    try:
        run = run_digits(
            preset=args.preset, config={name: getattr(args, name) for name in DEFAULT_CONFIG},
            run_name=args.run_name, run_id=args.run_id, mode=args.mode, train_fn=train_fn,
            register_as=args.register_as,
        )
    except JobPreemptedError as exc:
        from raydeck._internal.contract import PREEMPTED_EXIT_CODE

        logger.warning("%s", exc)
        raise SystemExit(PREEMPTED_EXIT_CODE) from None
    logger.info("MLflow run %s (%s): val_accuracy %.3f in %.0f s; tracking URI %s",
                run.run_id, run.run_name, run.val_accuracy, run.wall_time_s,
                redact_url(run.tracking_uri))
    if run.registered_model_uri:
        logger.info("registered %s (serve it: raydeck serve %s)", run.registered_model_uri,
                    run.registered_model_uri)
    return run
