"""``raydeck config``: show the effective settings (secrets masked) or the settings reference."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from raydeck.cli._console import add_columns, print_table

app = typer.Typer(help="Show raydeck's settings.", no_args_is_help=False)


@app.callback(invoke_without_command=True)
def show(
    markdown: bool = typer.Option(False, "--markdown",
                                  help="Print the reference table of every RAYDECK_* variable."),
) -> None:
    """Show the effective settings after env, raydeck.toml, the ecosystem's variables
    (MLFLOW_TRACKING_URI), the running stack and defaults (secrets masked), each with the
    source it came from."""
    from raydeck.config.settings import (
        load_settings_with_origins,
        settings_markdown,
        settings_reference,
    )

    if markdown:
        typer.echo(settings_markdown())
        return
    settings, origins = load_settings_with_origins()
    table = Table(title="raydeck settings")
    add_columns(table, "variable", "value", "from", whole=("variable", "value"))
    flat = settings.to_env()
    for var, key, _default, _doc in settings_reference():
        # Only secrets are missing from to_env(); they are never shown, only whether each is set.
        shown = flat[var] if var in flat else "******** (set)" if _setting(settings, key) else ""
        table.add_row(var, shown, origins[var])
    print_table(table)


def _setting(settings: Any, toml_key: str) -> Any:
    """The value of the setting at ``toml_key`` (``[tracking].write_db``, ``ray_address``)."""
    value = settings
    for part in toml_key.split("."):
        value = getattr(value, part.strip("[]"))
    return value
