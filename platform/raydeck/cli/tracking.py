"""``raydeck tracking status|stop``: inspect and stop the tracking proxy actors."""

from __future__ import annotations

import os
from typing import Any

import typer
from rich.table import Table

from raydeck.cli._console import console
from raydeck.config import Settings

app = typer.Typer(help="Inspect or stop the tracking proxy.", no_args_is_help=True)
STATUS_TIMEOUT_S = 30.0


def _router() -> tuple[Any, Settings]:
    """The running proxy's router (or None) and the settings; raises if no cluster answers."""
    from raydeck.cluster import connect_existing
    from raydeck.config import load_settings
    from raydeck.tracking.proxy import find_router

    settings = load_settings()
    connect_existing(settings.ray_address or os.environ.get("RAY_ADDRESS") or "auto")
    return find_router(settings.ray_namespace), settings


@app.command("status")
def status() -> None:
    """Runs the proxy holds and each shard's queue, spool and errors."""
    import ray

    from raydeck.redaction import redact_text

    router, settings = _router()
    if router is None:
        console.print(f"tracking proxy not running in namespace {settings.ray_namespace!r}")
        return
    info = ray.get(router.status.remote(), timeout=STATUS_TIMEOUT_S)
    runs = Table(title="runs")
    for column in ("key", "MLflow run", "name", "mode", "processes", "primary", "state"):
        runs.add_column(column)
    for run in info["runs"]:
        runs.add_row(run["key"], run["run_id"], run["name"], run["mode"],
                     str(run["participants"]), run["primary"], run["state"])
    shards = Table(title="shards")
    for column in ("shard", "state", "received", "written", "queued", "spool bytes",
                   "replay backlog", "errors", "last error"):
        shards.add_column(column)
    for s in info["shards"]:
        shards.add_row(str(s.get("index")), str(s.get("state")),
                       str(s.get("points_received", "")), str(s.get("points_written", "")),
                       str(s.get("queued_points", "")), str(s.get("spool_bytes", "")),
                       str(s.get("replay_backlog", "")), str(s.get("write_errors", "")),
                       redact_text(str(s.get("last_error", "")))[:80])
    console.print(runs)
    console.print(shards)


@app.command("stop")
def stop(
    drain_timeout: float = typer.Option(60.0, help="Seconds to wait for pending data to land."),
) -> None:
    """Write what is pending, then stop the router and shards (undrained data stays spooled)."""
    from raydeck.tracking.proxy import stop_proxy

    router, settings = _router()
    if router is None:
        console.print(f"tracking proxy not running in namespace {settings.ray_namespace!r}")
        return
    drained = stop_proxy(settings.ray_namespace, drain_timeout)
    if drained:
        console.print("tracking proxy stopped; everything was written")
    else:
        console.print("[yellow]tracking proxy stopped with data pending; it stays in the spool "
                      "and is written by the next proxy[/]")
