"""``raydeck tracking status|stop``: inspect and stop the tracking proxy actors."""

from __future__ import annotations

import os
from typing import Any

import typer
from rich.table import Table

from raydeck.cli._console import add_columns, console, print_table
from raydeck.config.settings import Settings

app = typer.Typer(help="Inspect or stop the tracking proxy.", no_args_is_help=True)
STATUS_TIMEOUT_S = 30.0


def _router() -> tuple[Any, Settings]:
    """The running proxy's router (or None) and the settings; raises if no cluster answers."""
    from raydeck.cluster.connection import connect_existing
    from raydeck.config.settings import load_settings
    from raydeck.tracking.proxy.actors import find_router

    settings = load_settings()
    connect_existing(settings.ray_address or os.environ.get("RAY_ADDRESS") or "auto")
    return find_router(settings.ray_namespace), settings


@app.command("status")
def status() -> None:
    """Runs the proxy holds, each shard's queue and spool, and values set aside for good."""
    import ray

    from raydeck._internal.redaction import redact_text
    from raydeck.tracking.proxy.actors import get_shard

    router, settings = _router()
    if router is None:
        console.print(f"tracking proxy not running in namespace {settings.ray_namespace!r}")
        return
    info = ray.get(router.status.remote(), timeout=STATUS_TIMEOUT_S)
    for path in sorted({s["write_path"] for s in info["shards"] if s.get("write_path")}):
        console.print(f"writes go {redact_text(path)}")
    runs = Table(title="runs")
    add_columns(runs, "key", "MLflow run", "name", "mode", "processes", "primary", "state",
                whole=("key", "MLflow run"))
    for run in info["runs"]:
        runs.add_row(run["key"], run["run_id"] or "(not created yet)", run["name"], run["mode"],
                     str(run["participants"]), run["primary"], run["state"])
    shards = Table(title="shards")
    add_columns(shards, "shard", "state", "received", "written", "queued", "spool bytes",
                "found at start", "set aside", "errors", "last error")
    queues = Table(title="runs with data pending or set aside")
    add_columns(queues, "shard", "run key", "pending", "set aside", "state", "last error",
                whole=("run key",))
    for s in info["shards"]:
        shards.add_row(str(s.get("index")), str(s.get("state")),
                       str(s.get("points_received", "")), str(s.get("points_written", "")),
                       str(s.get("queued_entities", "")), str(s.get("spool_bytes", "")),
                       str(s.get("replay_backlog", "")), str(s.get("dead_letters", "")),
                       str(s.get("write_errors", "")),
                       redact_text(str(s.get("last_error", "")))[:80])
        for run in s.get("runs", []):
            queues.add_row(str(s["index"]), run["key"], run["pending"] or "-",
                           str(run["dead_letters"]), run["state"],
                           redact_text(run["last_error"])[:80])
    print_table(runs)
    print_table(shards)
    if queues.row_count:
        print_table(queues)
    letters = Table(title="set aside for good (never retried; recorded on the run as the tag "
                    "raydeck.dead_letters and the artifact raydeck/dead_letters.json)")
    add_columns(letters, "run key", "kind", "key", "reason", "bytes kept at",
                whole=("run key", "key", "bytes kept at"))
    for s in info["shards"]:
        if not s.get("dead_letters"):
            continue
        shard = get_shard(settings.ray_namespace, int(s["index"]))
        for letter in ray.get(shard.dead_letters.remote(), timeout=STATUS_TIMEOUT_S):
            letters.add_row(letter.run_key, letter.kind, letter.key,
                            redact_text(letter.reason)[:120], letter.kept_at or "-")
    if letters.row_count:
        print_table(letters)


@app.command("stop")
def stop(
    drain_timeout: float = typer.Option(60.0, help="Seconds to wait for pending data to land."),
) -> None:
    """Write what is pending, then stop the router and shards (undrained data stays spooled)."""
    from raydeck.tracking.proxy.actors import stop_proxy

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
