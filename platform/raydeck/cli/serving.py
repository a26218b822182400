"""``raydeck serve``: a registered model on Ray Serve, behind MLflow's scoring protocol."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape
from rich.table import Table

from raydeck.cli._console import add_columns, console, err_console, print_table, setup_logging
from raydeck.errors import ConfigError

if TYPE_CHECKING:
    from raydeck.serving import ServeOptions

STATUS = "status"


def serve(
    target: str = typer.Argument(
        None, help="Model URI: models:/NAME@ALIAS (followed when the alias moves), "
                   "models:/NAME/VERSION or runs:/RUN_ID/model; or `status`."),
    name: str = typer.Option("", help="Serve application name (default: the model's name)."),
    preset: str = typer.Option("cpu-1", help="Scaling preset: replicas and resources each "
                                             "(`raydeck presets`; gpu-quarter packs four "
                                             "replicas on one GPU)."),
    autoscale: str = typer.Option(None, help="Serve autoscaling between MIN:MAX replicas."),
    target_ongoing_requests: float = typer.Option(8.0, help="Autoscaling's target of "
                                                            "in-flight requests per replica."),
    max_batch_size: int = typer.Option(32, help="Requests predicted together (1: no "
                                                "batching)."),
    batch_wait_ms: float = typer.Option(0.0, help="How long a batch waits to fill (0: a "
                                                  "lone request is predicted at once; batches "
                                                  "form from requests that queue behind one)."),
    max_ongoing_requests: int = typer.Option(64, help="Requests one replica holds at once."),
    poll_interval: float = typer.Option(10.0, help="Seconds between alias checks."),
    max_request_bytes: int = typer.Option(8 * 1024 * 1024, help="Larger bodies get a 400."),
    route_prefix: str = typer.Option("/", help="HTTP path of the application."),
    host: str = typer.Option("127.0.0.1", help="Serve's HTTP host (0.0.0.0 on a cluster)."),
    port: int = typer.Option(8000, help="Serve's HTTP port."),
    config_out: Path = typer.Option(None, "--config-out", help="Write a Serve config for "
                                    "`serve deploy` instead of deploying."),
    stop: bool = typer.Option(False, "--stop", help="Delete the application named by "
                              "--name or the model URI (all raydeck's, with neither)."),
    detach: bool = typer.Option(None, "--detach/--foreground", help="Return once deployed "
                                "(default when the cluster outlives this command) or serve "
                                "until Ctrl-C (default with a local Ray started here)."),
) -> None:
    """Serve a registered model on Ray Serve: POST /invocations as `mlflow models serve`
    takes it, batched, following an alias; `raydeck serve status` shows what runs."""
    from raydeck.config.settings import load_settings
    from raydeck.serving import ServeOptions

    settings = load_settings()
    setup_logging(settings.log_level)
    if target == STATUS:
        _status(settings.ray_address)
        return
    if stop:
        _stop(settings.ray_address, name or (ServeOptions(target).name if target else None))
        return
    if not target:
        raise ConfigError("give a model URI (models:/NAME@ALIAS, models:/NAME/VERSION or "
                          "runs:/RUN_ID/model), `status`, or --stop")
    low, high = _bounds(autoscale)
    options = ServeOptions(
        target, name=name, preset=preset, min_replicas=low, max_replicas=high,
        target_ongoing_requests=target_ongoing_requests, max_batch_size=max_batch_size,
        batch_wait_timeout_s=batch_wait_ms / 1000, max_ongoing_requests=max_ongoing_requests,
        poll_interval_s=poll_interval, max_request_bytes=max_request_bytes,
        route_prefix=route_prefix, host=host, port=port,
    )
    options.deployment_options(settings)  # an unknown preset fails before MLflow or Ray
    if config_out is not None:
        _write_config(options, config_out)
        return
    _deploy(options, detach)


def _bounds(autoscale: str | None) -> tuple[int | None, int | None]:
    if autoscale is None:
        return None, None
    low, sep, high = autoscale.partition(":")
    if not (sep and low.isdigit() and high.isdigit()):
        raise ConfigError(f"--autoscale {autoscale!r}: give MIN:MAX replicas, e.g. 1:4")
    return int(low), int(high)


def _write_config(options: ServeOptions, path: Path) -> None:
    import yaml

    from raydeck.config.settings import load_settings
    from raydeck.models import resolve_model_uri
    from raydeck.serving import serve_config
    from raydeck.storage import credentials_in_env

    settings = load_settings()
    with credentials_in_env(settings.storage):
        resolve_model_uri(options.model_uri, settings.tracking.uri)
    path.write_text(yaml.safe_dump(serve_config(options, settings), sort_keys=False))
    console.print(f"wrote {path}: deploy it with `serve deploy {path}` (the cluster's nodes "
                  "need raydeck installed and RAYDECK_TRACKING_URI set)", soft_wrap=True)


def _deploy(options: ServeOptions, detach: bool | None) -> None:
    from ray import serve as ray_serve

    from raydeck.config.settings import load_settings
    from raydeck.serving import deploy

    settings = load_settings()
    with console.status(f"deploying {options.model_uri} on Ray Serve..."):
        ref = deploy(options, settings)
    version = f"version {ref.version}" if ref.version else ref.uri
    follows = f", following @{ref.alias}" if ref.alias else ""
    console.print(f"[bold green]serving[/] {escape(options.model_uri)} ({version}{follows}) as "
                  f"application {options.name!r} at {options.url}/invocations", soft_wrap=True)
    console.print(f"  try: curl -s {options.url}/invocations -H 'Content-Type: "
                  "application/json' -d '{\"inputs\": [[0, 0, 5, 13, ...]]}'", soft_wrap=True)
    if detach if detach is not None else not _started_ray_here():
        console.print(f"  stop: raydeck serve --stop --name {options.name}")
        return
    console.print("  serving until Ctrl-C (Ray was started by this command)")
    stopped = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopped.set())
    stopped.wait()
    ray_serve.shutdown()


def _started_ray_here() -> bool:
    """Whether this process started the Ray instance it is connected to (it ends with it)."""
    import ray

    node = ray._private.worker._global_node  # Ray's own record of the node this driver runs
    return bool(node is not None and node.head and not os.environ.get("RAY_ADDRESS"))


def _quiet_serve() -> None:
    """Keep Ray Serve's own INFO lines (``Started <...SharedRouterLongPollClient ...>``) out of
    a command that prints its own answer: importing Serve sets its logger to INFO."""
    import ray.serve  # noqa: F401  (configures the "ray.serve" logger on import)

    logging.getLogger("ray.serve").setLevel(logging.WARNING)


def _status(address: str) -> None:
    from raydeck.cluster.connection import connect_running
    from raydeck.serving import status

    connect_running(address)
    _quiet_serve()
    rows = status()
    if not rows:
        err_console.print("no Serve applications are running")
        return
    table = Table(title="Serve applications")
    add_columns(table, "application", "status", "replicas", "model", "version", "rejected",
                whole=("application", "model", "version"))
    for row in rows:
        replicas = ", ".join(f"{n} {s.lower()}" for s, n in row.get("replicas", {}).items())
        rejected = "; ".join(f"v{v}: {why}" for v, why in row.get("rejected", {}).items())
        table.add_row(row["name"], row["status"], replicas or "-",
                      escape(str(row.get("model_uri", row.get("error", "-")))),
                      str(row.get("version") or "-"), escape(rejected) or "-")
    print_table(table)


def _stop(address: str, name: str | None) -> None:
    from raydeck.cluster.connection import connect_running
    from raydeck.serving import stop

    connect_running(address)
    _quiet_serve()
    with console.status(f"stopping {name or 'every application'} (Serve shuts down, its HAProxy "
                        "listener too, when nothing is left serving)..."):
        deleted = stop(name)
    console.print(f"deleted {', '.join(deleted)}" if deleted else "nothing was running")
