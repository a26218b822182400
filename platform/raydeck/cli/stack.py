"""``raydeck up`` / ``down`` / ``ps`` / ``logs``: the whole platform as local processes.

The library (:mod:`raydeck.stack`) does the work; this module draws progress and tables. No
credential is ever printed: ``up`` says which file holds them, and ``logs`` masks them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape
from rich.table import Table

from raydeck.cli._console import (
    EXIT_USER_ERROR,
    add_columns,
    console,
    err_console,
    format_duration,
    print_table,
    setup_logging,
)

if TYPE_CHECKING:
    from raydeck.stack.supervisor import ServiceStatus, Stack

FOLLOW_INTERVAL_S = 0.5
MIB = 1024 * 1024


def _stack(events: bool = False) -> Stack:
    from raydeck.config.settings import load_settings
    from raydeck.stack.supervisor import Stack

    settings = load_settings()
    setup_logging(settings.log_level)

    def show(service: str, message: str) -> None:
        console.print(f"  {service:<11} {escape(message)}", soft_wrap=True)

    return Stack(settings, events=show if events else None)


def _parse_ports(values: list[str]) -> dict[str, int]:
    from raydeck.errors import ConfigError

    ports = {}
    for value in values:
        name, _, number = value.partition("=")
        if not number.isdigit():
            raise ConfigError(f"--port {value!r}: expected NAME=PORT, e.g. mlflow=5001")
        ports[name.strip()] = int(number)
    return ports



def _table(rows: Iterable[ServiceStatus]) -> Table:
    colours = {"running": "green", "unhealthy": "yellow", "crashed": "red", "stopped": "dim"}
    table = Table(title="raydeck stack")
    add_columns(table, "service", "state", "pid", "port", "url", "memory", "up",
                whole=("service", "url"))
    for row in rows:
        colour = colours.get(row.state, "white")
        table.add_row(row.name, f"[{colour}]{row.state}[/]", str(row.pid or "-"),
                      ", ".join(str(p) for p in row.ports.values()) or "-",
                      escape(next(iter(row.urls.values()), "-")),
                      f"{row.memory_bytes / MIB:.0f} MiB" if row.memory_bytes else "-",
                      format_duration(row.uptime_s))
    return table


def _postgres_data_line(stack: Stack) -> str:
    """Where PostgreSQL's data lives, and why when it is outside the state directory."""
    pgdata = stack.postgres_data()
    if pgdata.is_relative_to(stack.paths.root):
        return f"PostgreSQL data: {pgdata}"
    return (f"PostgreSQL data: {pgdata} (its user cannot reach {stack.paths.root}; "
            "`raydeck down --purge` deletes it too)")


def up(
    port: list[str] = typer.Option([], "--port", help="NAME=PORT for a port not chosen yet "
                                   "(postgres, s3, mlflow, ray, ray-dashboard, ray-client, "
                                   "prometheus, jupyter); repeatable."),
    free_ports: bool = typer.Option(False, "--free-ports",
                                    help="Free ports instead of the defaults for ports not "
                                         "chosen yet."),
    postgres_bin: Path = typer.Option(None, "--postgres-bin", show_default=False,
                                      help="PostgreSQL's bin directory (default: PATH, then "
                                           "/usr/lib/postgresql/<version>/bin)."),
    num_cpus: int = typer.Option(None, "--num-cpus", show_default=False,
                                 help="CPUs the Ray head offers (default: all)."),
) -> None:
    """Start the whole platform on this machine: PostgreSQL, S3, MLflow, Ray, Prometheus,
    JupyterLab. Idempotent; afterwards every raydeck command here uses it."""
    stack = _stack(events=True)
    console.print(f"[bold]raydeck up[/]: {stack.paths.root}", soft_wrap=True)
    report = stack.up(ports=_parse_ports(port), free_ports=free_ports,
                      postgres_bin=postgres_bin, num_cpus=num_cpus)
    print_table(_table(report.services))
    urls = {name: url for row in report.services for name, url in row.urls.items()}
    console.print(f"[bold green]stack up[/] in {report.wall_time_s:.1f} s "
                  f"({len(report.started)} started); idle memory "
                  f"{sum(r.memory_bytes for r in report.services) / MIB:.0f} MiB")
    console.print(f"  MLflow       {urls['mlflow']}\n"
                  f"  Ray          {urls['ray-dashboard']} (dashboard, jobs), {urls['ray']}\n"
                  f"  Prometheus   {urls['prometheus']}\n"
                  f"  JupyterLab   {urls['jupyter']} (token: JUPYTER_TOKEN in "
                  f"{report.credentials_file})\n"
                  f"  S3           {urls['s3']}\n  PostgreSQL   {urls['postgres']}",
                  soft_wrap=True, highlight=False)
    console.print(_postgres_data_line(stack), soft_wrap=True, highlight=False)
    if report.connection_file:
        console.print(f"raydeck commands and jobs on this machine now use it (connection file "
                      f"{report.connection_file}); credentials: {report.credentials_file}",
                      soft_wrap=True)
    for name in stack.overridden():
        err_console.print(f"[yellow]note: {escape(name)} is set in your environment or "
                          "raydeck.toml and wins over the stack's value[/]", soft_wrap=True)


def down(
    purge: bool = typer.Option(False, "--purge",
                               help="Also delete the stack's data: runs, artifacts, "
                                    "checkpoints, credentials."),
) -> None:
    """Stop every service of the stack (what `raydeck up` started, nothing else)."""
    stack = _stack(events=True)
    report = stack.down(purge=purge)
    if report.stopped:
        console.print(f"stopped {', '.join(report.stopped)}")
    else:
        console.print(f"nothing was running ({stack.paths.root})", soft_wrap=True)
    for path in report.deleted:
        console.print(f"deleted {path}", soft_wrap=True)


def ps() -> None:
    """Each service's state, PID, port, URL, memory and uptime; exit 2 if one crashed."""
    stack = _stack()
    rows = stack.status()
    print_table(_table(rows))
    console.print(_postgres_data_line(stack), soft_wrap=True, highlight=False)
    total = sum(row.memory_bytes for row in rows)
    if total:
        console.print(f"memory (RSS, all processes of the stack): {total / MIB:.0f} MiB")
    bad = [row for row in rows if row.state in ("crashed", "unhealthy")]
    for row in bad:
        detail = f": {row.detail}" if row.detail else ""
        err_console.print(f"[bold red]error:[/] {row.name} {row.state}{escape(detail)}; see "
                          f"`raydeck logs {row.name}`, `raydeck up` restarts it", soft_wrap=True)
    if bad:
        raise typer.Exit(EXIT_USER_ERROR)


def logs(
    service: str = typer.Argument(..., help="postgres, s3, mlflow, ray-head, prometheus or "
                                            "jupyter."),
    lines: int = typer.Option(100, "--lines", "-n", min=0, help="Lines from the end."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
) -> None:
    """A service's log (credentials masked)."""
    stack = _stack()
    path = stack.log_file(service)
    if not path.exists():
        err_console.print(f"no log yet: {path}")
        return
    with path.open("r", errors="replace") as handle:
        tail = handle.readlines()[-lines:] if lines else []
        sys.stdout.write(stack.mask("".join(tail)))
        sys.stdout.flush()
        while follow:
            chunk = handle.read()
            if chunk:
                sys.stdout.write(stack.mask(chunk))
                sys.stdout.flush()
            else:
                time.sleep(FOLLOW_INTERVAL_S)
