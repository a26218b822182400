"""``raydeck presets``: the scaling presets, built-in and from RAYDECK_PRESETS_FILE."""

from __future__ import annotations

import dataclasses

import typer
from rich.table import Table

from raydeck.cli._console import add_columns, print_json_rows, print_table


def presets(
    json_output: bool = typer.Option(False, "--json", help="Print the presets as a JSON array, "
                                     "each with the fields of a presets file."),
) -> None:
    """List scaling presets: workers, CPUs/GPUs/memory per worker, placement, fault tolerance."""
    from raydeck.config.settings import load_settings
    from raydeck.train.presets import load_presets

    settings = load_settings()
    ordered = sorted(load_presets(settings.presets_file).values(), key=lambda p: p.name)
    if json_output:
        print_json_rows([dataclasses.asdict(preset) for preset in ordered])
        return
    table = Table(title="scaling presets")
    # Headers with spaces wrap: a terminal of 110 columns shows the table.
    add_columns(table, "name", "workers", "CPU / worker", "GPU / worker", "memory / worker",
                "placement", "max failures", "checkpoints kept", "description",
                whole=("name", "placement"))
    for preset in ordered:
        table.add_row(
            preset.name, preset.workers_label, f"{preset.cpus_per_worker:g}",
            f"{preset.gpus_per_worker:g}",
            f"{preset.memory_per_worker_gb:g} GiB" if preset.memory_per_worker_gb else "-",
            preset.placement_strategy, str(preset.max_failures), str(preset.checkpoints_to_keep),
            preset.description,
        )
    print_table(table)
