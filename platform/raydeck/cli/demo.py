"""``raydeck demo``: the main job on the embedded default, with a live progress display."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from raydeck.cli._console import console, run_link_lines, setup_logging

if TYPE_CHECKING:
    from raydeck.tracking import Tracker

POLL_INTERVAL_S = 0.5
TARGET_ACCURACY = 0.90


def _progress_watcher(epochs: int) -> Callable[[Tracker, threading.Event], None]:
    """A ``watch`` callback for run_digits: one progress bar, updated from the proxy."""

    def watch(tracker: Tracker, done: threading.Event) -> None:
        with Progress(
            TextColumn("[bold]training[/]"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[summary]}"), TimeElapsedColumn(), console=console,
        ) as progress:
            task = progress.add_task("epochs", total=epochs, summary="starting Ray workers...")
            while not done.wait(POLL_INTERVAL_S):
                try:
                    latest = tracker.latest()
                except Exception:
                    continue
                if "val_accuracy" in latest:
                    accuracy, epoch = latest["val_accuracy"]
                    loss = latest.get("train_loss", (float("nan"), 0))[0]
                    progress.update(task, completed=epoch + 1,
                                    summary=f"loss {loss:.3f}  val acc {accuracy:.3f}")
            progress.update(task, completed=epochs)

    return watch


def demo(
    epochs: int = typer.Option(10, min=1, help="Training epochs."),
    preset: str = typer.Option("cpu-2", help="Scaling preset (`raydeck presets` lists them)."),
    run_name: str = typer.Option("digits-demo", help="MLflow run name."),
    register_as: str = typer.Option(None, "--register-as", metavar="NAME",
                                    help="Register the trained model as a new version of NAME."),
) -> None:
    """Train a digits classifier on a local Ray cluster with 2 workers, tracked in MLflow."""
    from raydeck.config.settings import load_settings
    from raydeck.examples.digits import run_digits
    from raydeck.train.presets import get_preset

    settings = load_settings()
    setup_logging(settings.log_level)
    get_preset(preset, settings.presets_file)
    console.print(f"[bold]raydeck demo[/]: digits classifier, preset {preset}, {epochs} epochs")
    with console.status("starting Ray and the tracking proxy..."):
        from raydeck.cluster.connection import connect

        connect(settings, log_to_driver=False)
    run = run_digits(preset=preset, config={"epochs": epochs}, run_name=run_name,
                     settings=settings, watch=_progress_watcher(epochs),
                     register_as=register_as)
    console.print(f"\n[bold green]done[/] in {run.wall_time_s:.0f} s")
    console.print(f"  MLflow run:          {run.run_id} ({run.run_name})")
    console.print(f"  validation accuracy: {run.val_accuracy:.3f}")
    console.print(f"  data:                {settings.data_dir}", soft_wrap=True)
    console.print(f"  latest checkpoint:   {run.checkpoint_path}", soft_wrap=True)
    if run.registered_model_uri:
        console.print(f"  registered model:    {run.registered_model_uri}  (serve it: raydeck "
                      f"serve {run.registered_model_uri})", soft_wrap=True)
    for label, text in run_link_lines(run.tracking_uri, run.experiment_id, run.run_id):
        console.print(f"  {label:<21}{text}", soft_wrap=True)
    if run.val_accuracy < TARGET_ACCURACY:
        console.print(f"[yellow]accuracy below {TARGET_ACCURACY}; try more --epochs[/]")
        raise typer.Exit(1)
