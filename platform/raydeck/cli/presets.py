"""``raydeck presets``: the scaling presets, built-in and from RAYDECK_PRESETS_FILE."""

from __future__ import annotations

from rich.table import Table

from raydeck.cli._console import console


def presets() -> None:
    """List scaling presets: workers, CPUs/GPUs/memory per worker, placement, fault tolerance."""
    from raydeck.config.settings import load_settings
    from raydeck.train.presets import load_presets

    settings = load_settings()
    table = Table(title="scaling presets")
    for column in ("name", "workers", "CPU/worker", "GPU/worker", "memory/worker",
                   "placement", "max failures", "checkpoints kept", "description"):
        table.add_column(column)
    for preset in sorted(load_presets(settings.presets_file).values(), key=lambda p: p.name):
        table.add_row(
            preset.name, preset.workers_label, f"{preset.cpus_per_worker:g}",
            f"{preset.gpus_per_worker:g}",
            f"{preset.memory_per_worker_gb:g} GiB" if preset.memory_per_worker_gb else "-",
            preset.placement_strategy, str(preset.max_failures), str(preset.checkpoints_to_keep),
            preset.description,
        )
    console.print(table)
