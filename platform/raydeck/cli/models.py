"""``raydeck models``: registered models, their versions, and MLflow aliases to promote with."""

from __future__ import annotations

import datetime

import typer
from rich.markup import escape
from rich.table import Table

from raydeck.cli._console import add_columns, console, err_console, print_table, setup_logging

app = typer.Typer(help="Registered models: list, show versions, promote with an alias.",
                  no_args_is_help=True)


def _tracking_uri() -> str:
    from raydeck.config.settings import load_settings

    settings = load_settings()
    setup_logging(settings.log_level)
    return settings.tracking.uri


def _when(millis: int | None) -> str:
    if not millis:
        return "-"
    return datetime.datetime.fromtimestamp(millis / 1000).strftime("%Y-%m-%d %H:%M:%S")


@app.command("list")
def list_models() -> None:
    """Every registered model: latest version and aliases."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(_tracking_uri())
    models = client.search_registered_models()
    if not models:
        err_console.print("no registered models yet (train with --register-as NAME)")
        return
    table = Table(title="registered models")
    add_columns(table, "name", "latest version", "aliases", "updated",
                whole=("name", "latest version"))
    for model in models:
        latest = max((int(v.version) for v in model.latest_versions or []), default=None)
        aliases = ", ".join(f"@{a} -> {v}" for a, v in sorted((model.aliases or {}).items()))
        table.add_row(escape(model.name), str(latest or "-"), aliases or "-",
                      _when(model.last_updated_timestamp))
    print_table(table)


@app.command("show")
def show(name: str = typer.Argument(..., help="Registered model name.")) -> None:
    """Versions of one model: the run, git commit and metric each came from, and aliases."""
    from mlflow.tracking import MlflowClient

    from raydeck.errors import ConfigError
    from raydeck.models import COMMIT_TAG, METRIC_TAG_PREFIX, RUN_TAG

    client = MlflowClient(_tracking_uri())
    versions = client.search_model_versions(f"name = '{name}'")
    if not versions:
        raise ConfigError(f"no registered model named {name!r}; `raydeck models list` shows "
                          "them")
    aliases: dict[str, list[str]] = {}
    for alias, version in (client.get_registered_model(name).aliases or {}).items():
        aliases.setdefault(str(version), []).append(f"@{alias}")
    table = Table(title=f"model {escape(name)}")
    add_columns(table, "version", "aliases", "run", "git commit", "metric", "created",
                whole=("version", "run", "git commit"))
    for version in sorted(versions, key=lambda v: int(v.version), reverse=True):
        tags = version.tags or {}
        metrics = ", ".join(f"{k.removeprefix(METRIC_TAG_PREFIX)} {v}"
                            for k, v in sorted(tags.items()) if k.startswith(METRIC_TAG_PREFIX))
        table.add_row(str(version.version), " ".join(aliases.get(str(version.version), [])) or "-",
                      tags.get(RUN_TAG, version.run_id or "-"), tags.get(COMMIT_TAG, "-")[:12],
                      metrics or "-", _when(version.creation_timestamp))
    print_table(table)


@app.command("promote")
def promote(
    name: str = typer.Argument(..., help="Registered model name."),
    version: str = typer.Argument(..., help="Version to promote."),
    alias: str = typer.Option("champion", help="MLflow alias to point at the version."),
) -> None:
    """Point an alias at a version; servers following models:/NAME@ALIAS switch to it."""
    from raydeck import models

    uri = _tracking_uri()
    models.promote(uri, name, version, alias)
    console.print(f"models:/{name}@{alias} -> version {version}")
