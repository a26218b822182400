"""``raydeck status``: is everything raydeck is configured to use reachable?

Checks the Ray cluster (nodes, resources, the tracking proxy), the MLflow tracking backend and
object storage, prints one table, and exits 2 when something configured cannot be reached.
"""

from __future__ import annotations

import os

import typer
from rich.markup import escape
from rich.table import Table

from raydeck.cli._console import EXIT_USER_ERROR, add_columns, console, err_console, print_table


def _ray_rows(address: str, namespace: str) -> tuple[list[tuple[str, str, str]], str | None]:
    """Rows about Ray, and an error line if a configured cluster is unreachable."""
    import ray

    from raydeck.cluster.connection import connect_existing, nodes
    from raydeck.errors import ClusterUnavailableError
    from raydeck.tracking.proxy.actors import find_router

    if address == "local":
        return [("Ray", "local", "a new local instance per process; nothing to inspect")], None
    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        connect_existing(target)
    except ClusterUnavailableError as exc:
        if target == "auto":
            return [("Ray", "auto", "no cluster running (`raydeck demo` starts a local one)")], None
        return [("Ray", target, "[red]unreachable[/]")], str(exc)
    rows = []
    try:
        for node in nodes():
            res = node.resources
            detail = (f"{'head' if node.is_head else 'worker'}, {res.get('CPU', 0):g} CPU, "
                      f"{res.get('GPU', 0):g} GPU, "
                      f"{res.get('memory', 0) / 1024**3:.1f} GiB memory")
            state = "alive" if node.alive else "[red]dead[/]"
            rows.append((f"Ray node {node.address}", state, detail))
        available = ray.available_resources()
        rows.append(("Ray free", "", f"{available.get('CPU', 0):g} CPU, "
                                     f"{available.get('GPU', 0):g} GPU"))
        router = find_router(namespace)
        if router is None:
            rows.append(("tracking proxy", "not running", "starts with the first tracked run"))
        else:
            info = ray.get(router.status.remote(), timeout=15)
            active = sum(1 for run in info["runs"] if run["state"] == "active")
            queued = sum(s.get("queued_points", 0) for s in info["shards"])
            shards = len(info["shards"])
            rows.append(("tracking proxy", "running",
                         f"{shards} shard{'s' if shards != 1 else ''}, {active} active runs, "
                         f"{queued} points queued"))
            # The running proxy's own path (fixed by the process that made it).
            paths = {s["write_path"] for s in info["shards"] if s.get("write_path")}
            rows += [("tracking writes", "proxy", path) for path in sorted(paths)]
    finally:
        ray.shutdown()
    return rows, None


def _mlflow_row(uri: str) -> tuple[tuple[str, str, str], str | None]:
    from raydeck._internal.redaction import redact_text as _redact

    shown = _redact(uri)
    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///"):]
        state = "exists" if os.path.exists(path) else "created on first run"
        return ("MLflow", shown, f"embedded SQLite, {state}"), None
    if uri.startswith(("http://", "https://")):
        import requests

        try:
            answer = requests.get(f"{uri.rstrip('/')}/health", timeout=5)
            answer.raise_for_status()
        except requests.RequestException as exc:
            return ("MLflow", shown, f"[red]unreachable[/]: {type(exc).__name__}"), (
                f"MLflow tracking server {shown} is unreachable; start it or fix "
                "RAYDECK_TRACKING_URI"
            )
        return ("MLflow", shown, "reachable"), None
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(uri).search_experiments(max_results=1)
    except Exception as exc:
        return ("MLflow", shown, f"[red]unreachable[/]: {type(exc).__name__}"), (
            f"MLflow backend {shown} is unreachable ({type(exc).__name__}); fix "
            "RAYDECK_TRACKING_URI"
        )
    return ("MLflow", shown, "reachable"), None


def status() -> None:
    """Show the Ray cluster, tracking proxy, MLflow and storage; exit 2 if any is unreachable."""
    from raydeck._internal.redaction import redact_text
    from raydeck.config.settings import load_settings
    from raydeck.storage import health

    settings = load_settings()
    problems: list[str] = []
    table = Table(title="raydeck status")
    add_columns(table, "component", "target/state", "detail", whole=("target/state",))
    with console.status("checking..."):
        ray_rows, ray_problem = _ray_rows(settings.ray_address, settings.ray_namespace)
        mlflow_row, mlflow_problem = _mlflow_row(settings.tracking.uri)
        storage_rows, storage_problem = health(settings.storage)
    if not any(row[0] == "tracking writes" for row in ray_rows):
        from raydeck.tracking.proxy.direct_store import describe_write_path

        ray_rows.append(("tracking writes", "configured", describe_write_path(
            settings.tracking.uri, settings.tracking.write_db.reveal())))
    for row in [*ray_rows, mlflow_row, *storage_rows]:
        # Every cell may quote an address: none may show its user-info.
        table.add_row(*(redact_text(cell) for cell in row))
    print_table(table)
    problems = [p for p in (ray_problem, mlflow_problem, storage_problem) if p]
    for problem in problems:
        err_console.print(f"[bold red]error:[/] {escape(redact_text(problem))}",
                          soft_wrap=True)
    if problems:
        raise typer.Exit(EXIT_USER_ERROR)
