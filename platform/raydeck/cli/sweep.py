"""``raydeck sweep``: a Tune sweep (ASHA, FIFO or PBT) over a raydeck job, tracked, registered."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from raydeck.cli._console import add_columns, console, print_table, run_link_lines, setup_logging

DEFAULT_JOB = "raydeck.examples.digits:digits_sweep_job"
DEFAULT_SPACE = "jobs/sweep_digits.yaml"


def _load_job(spec: str) -> Any:
    from raydeck.errors import ConfigError
    from raydeck.tune import SweepJob

    module_name, _, attribute = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"--job {spec!r}: cannot import it ({exc}); use module:function"
                          ) from None
    job = factory() if callable(factory) and not isinstance(factory, SweepJob) else factory
    if not isinstance(job, SweepJob):
        raise ConfigError(f"--job {spec!r}: must name a SweepJob or a function returning one")
    return job


def sweep(
    space: Path = typer.Option(None, show_default=False,
                               help=f"YAML search space (a resumed sweep keeps its own). Default: "
                                    f"{DEFAULT_SPACE} in this directory if it exists, else the "
                                    "copy installed with raydeck."),
    name: str = typer.Option("digits-sweep", help="Sweep name (MLflow parent run, Tune dir)."),
    job: str = typer.Option(DEFAULT_JOB, help="module:function returning a SweepJob."),
    metric: str = typer.Option("val_accuracy", help="Metric to optimise."),
    mode: str = typer.Option("max", help="max or min."),
    num_samples: int = typer.Option(8, help="Trials to draw."),
    max_t: int = typer.Option(8, help="Most iterations per trial."),
    grace_period: int = typer.Option(1, help="Iterations before ASHA may stop a trial."),
    reduction_factor: float = typer.Option(2.0, help="ASHA keeps 1/factor per rung."),
    scheduler: str = typer.Option("asha", help="asha, fifo or pbt."),
    perturbation_interval: int = typer.Option(
        0, help="PBT: iterations between exploits (0: max_t / 4)."),
    pbt_mutate: list[str] = typer.Option(
        [], help="PBT: a dimension it may change (repeat; default every uniform/loguniform)."),
    preset: str = typer.Option("cpu-1", help="Scaling preset for each trial's resources."),
    max_concurrent: int = typer.Option(0, help="Most trials at once (0: as resources allow)."),
    seed: int = typer.Option(0, help="Seed of the search (and of PBT's choices)."),
    register_as: str = typer.Option("digits-classifier",
                                    help="Registry name for the best model ('' to skip)."),
    resume: bool = typer.Option(False, "--resume",
                                help="Continue the sweep --name as it was started (after its "
                                     "driver died or was stopped), or redo its summary."),
) -> None:
    """Run a hyperparameter sweep: one MLflow child run per trial, the best model registered."""
    from raydeck.cluster.connection import connect
    from raydeck.config.package_data import default_path
    from raydeck.config.settings import load_settings
    from raydeck.tune import SearchSpace, SweepConfig
    from raydeck.tune import sweep as run_sweep

    settings = load_settings()
    setup_logging(settings.log_level)
    config = SweepConfig(
        name=name, metric=metric, mode=mode, num_samples=num_samples, max_t=max_t,
        grace_period=grace_period, reduction_factor=reduction_factor, scheduler=scheduler,
        perturbation_interval=perturbation_interval or None,
        pbt_mutations=tuple(pbt_mutate) or None,
        preset=preset, max_concurrent_trials=max_concurrent or None, seed=seed,
        register_model_as=register_as or None,
    )
    # A resumed sweep keeps the space (and settings) it was started with.
    search_space = None if resume else SearchSpace.from_yaml(space or default_path(DEFAULT_SPACE))
    sweep_job = _load_job(job)
    with console.status(f"sweep {name}: {'resuming' if resume else config.scheduler}..."):
        connect(settings, log_to_driver=False)
        result = run_sweep(sweep_job, search_space, config, settings=settings, resume=resume)
    table = Table(title=f"sweep {name} ({result.wall_time_s:.0f} s, "
                        f"{result.trial_iterations} trial-iterations)")
    # The score column is named as the child runs' metric, so MLflow sorts them the same way.
    add_columns(table, "trial", "status", "iterations", result.best_metric, "MLflow run",
                whole=("trial", "MLflow run"))
    for trial in sorted(result.trials, key=lambda t: t.trial_id):
        score = "-" if trial.best_score is None else f"{trial.best_score:.4f}"
        status = trial.status + (f" (rung {trial.rung})" if trial.rung else "") + (
            f": {trial.error}" if trial.error else "")
        table.add_row(trial.trial_id, status, str(trial.stop_iteration), score, trial.run_id)
    print_table(table)
    counts = ", ".join(f"{result.count(s)} {s}" for s in ("completed", "stopped_early",
                                                         "errored") if result.count(s))
    console.print(f"trials: {counts}", soft_wrap=True)
    if result.slot_usage is not None:
        usage = result.slot_usage
        console.print(f"slots: {usage.slots}, idle {100 * usage.idle_fraction:.0f}% of slot "
                      f"time, trial start-up {usage.startup_s:.2f} s", soft_wrap=True)
    console.print(f"best trial {result.best_trial_id}: {result.best_metric} "
                  f"{result.best_score:.4f} with {result.best_config}", soft_wrap=True)
    console.print(f"sweep run: {result.parent_run_id} ({name}); MLflow ranks its child runs as "
                  f"above by metrics.{result.best_metric}", soft_wrap=True)
    for label, text in run_link_lines(settings.tracking.uri, result.experiment_id,
                                      result.parent_run_id):
        console.print(f"{label} {text}".strip(), soft_wrap=True)
    if result.registered_model_uri:
        console.print(f"registered model: {result.registered_model_uri}", soft_wrap=True)
