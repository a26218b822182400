"""``raydeck queue``, ``raydeck cancel`` and ``raydeck reprioritize``: the cluster's job queue.

Each call goes as this process's OS user (raydeck.scheduling.queue.identity); who may do what is the
queue's rule (raydeck.scheduling.queue.access, docs/scheduling.md)."""

from __future__ import annotations

import dataclasses
import datetime
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape
from rich.table import Table

from raydeck.cli._console import (
    add_columns,
    console,
    err_console,
    format_duration,
    print_json_rows,
    print_table,
    setup_logging,
)

if TYPE_CHECKING:
    from raydeck.config.settings import Settings
    from raydeck.jobs.submission import JobServer
    from raydeck.scheduling.queue.listing import Entry


def _context(address: str | None) -> tuple[Settings, JobServer]:
    from raydeck.config.settings import load_settings
    from raydeck.jobs.submission import JobServer

    settings = load_settings()
    setup_logging(settings.log_level)
    return settings, JobServer.from_env(address)


def _clock(at: float | None) -> str:
    if at is None:
        return "-"
    return datetime.datetime.fromtimestamp(at).strftime("%H:%M:%S")


def _seconds(option: str, text: str | None) -> float | None:
    """``text`` (``90s``, ``10m``, ``1h``) in seconds, None when not given.

    Raises:
        ConfigError: not a positive duration, naming ``option``.
    """
    from raydeck.errors import ConfigError
    from raydeck.observability.prometheus import parse_duration

    if text is None:
        return None
    try:
        return parse_duration(text)
    except ConfigError as exc:
        raise ConfigError(f"{option}={text}: {exc}") from None


def queue(
    policy: str = typer.Option(None, help="Switch the policy: fifo, priority, sjf, fairshare, "
                                          "las, gittins, backfill or backfill-<policy>."),
    aging: str = typer.Option(None, help="Aging bound, e.g. 1h: a job waiting this long goes "
                                         "first (the starvation bound)."),
    thresholds: str = typer.Option(None, help="las' levels: attained GPU-time (CPU-time for a "
                                              "job without GPUs), e.g. 1h,10h: a job passes to "
                                              "level 1 after 1 GPU-hour; auto (the default): "
                                              "the 90th and 99th percentiles of the service the "
                                              "jobs that ended attained."),
    min_run: str = typer.Option(None, "--min-run",
                                help="How long a job resumed after a preemption runs before "
                                     "it may be preempted again, e.g. 10m (the default)."),
    teams: Path = typer.Option(None, help="YAML of teams: NAME: {weight: 2, gpus: 4, cpus: 32, "
                                          "members: [USER], max_priority: 5}. Only the admins "
                                          "may change it: queue-admins in the head's data dir."),
    address: str = typer.Option(None, help="Job server URL (as for `raydeck submit`)."),
    json_output: bool = typer.Option(False, "--json", help="Print the queue's jobs as a JSON "
                                     "array (after any change the options make)."),
    show_all: bool = typer.Option(False, "--all", help="Also the jobs that ended in the last "
                                  "7 days: cancelled (queued or running), succeeded, failed "
                                  "(with the exit code and the end of the log), stopped."),
) -> None:
    """Show the queue: position, predicted start, why each job waits and an elastic job's size
    (`workers 1 of 1-4`); change its settings (kept by the queue until changed again)."""
    import yaml

    from raydeck.errors import ConfigError
    from raydeck.scheduling.queue.client import listing
    from raydeck.scheduling.queue.config_change import ConfigChange, parse_thresholds

    settings, server = _context(address)
    team_specs = None
    if teams is not None:
        if not teams.is_file():
            raise ConfigError(f"--teams {teams}: no such file")
        team_specs = yaml.safe_load(teams.read_text()) or {}
        if not isinstance(team_specs, dict):
            raise ConfigError(f"--teams {teams}: must map team names to {{weight, gpus, cpus}}")
    # A bad value fails here, before anything changes (the queue checks it again).
    change = ConfigChange(
        policy, _seconds("--aging", aging), team_specs,
        parse_thresholds(thresholds) if thresholds is not None else None,
        _seconds("--min-run", min_run))
    described, entries = listing(settings, server, change, ended=show_all)
    if json_output:
        print_json_rows([_entry_row(entry) for entry in entries])
        return
    now = time.time()
    table = Table(title=f"queue ({described})")
    # Attained-service policies (las, gittins) rank by the service a job has had, not by
    # its expected duration: show that service and where it ranks the job.
    ranked = any(entry.rank for entry in entries)
    add_columns(table, "#", "job", "team", "by", "prio", "needs", "state", "waited", "expected",
                *(("service", "rank") if ranked else ()), "start", "why", whole=("job",))
    for entry in entries:
        job = entry.job
        needs = f"{job.gpus:g} GPU, {job.cpus:g} CPU" if job.gpus else f"{job.cpus:g} CPU"
        if job.size:  # an elastic job: the size the queue allows it, of its range
            needs += f"; {job.size}"
        waited_until = now if job.started_at is None else job.started_at
        waited = f"{(waited_until - job.submitted_at) / 60:.1f}m"
        table.add_row(str(entry.position or "-"), escape(job.id), job.team,
                      escape(f"{job.user}@{job.host}" if job.user else "-"), str(job.priority),
                      needs, job.state, waited, format_duration(job.estimate_s),
                      *((entry.service or "-", entry.rank or "-") if ranked else ()),
                      _clock(entry.predicted_start_s),
                      escape(entry.why))
    if not entries:
        err_console.print("the queue is empty")
    print_table(table)


def _entry_row(entry: Entry) -> dict[str, Any]:
    """One job of ``raydeck queue --json``: the job's fields (its entrypoint redacted), where
    it is, when it is predicted to start and why it waits."""
    from raydeck._internal.redaction import redact_text

    job = dataclasses.asdict(entry.job)
    job["entrypoint"] = redact_text(entry.job.entrypoint)
    return {**job, "position": entry.position, "predicted_start_s": entry.predicted_start_s,
            "why": entry.why, "service": entry.service, "rank": entry.rank}


def cancel(
    job_id: str = typer.Argument(..., help="Queued job id (`raydeck queue` lists them)."),
    address: str = typer.Option(None, help="Job server URL (as for `raydeck submit`)."),
) -> None:
    """Take a job out of the queue, or stop it if it has started (its submitter, its team's
    members or an admin may)."""
    from raydeck.scheduling.queue.client import cancel as cancel_job

    settings, server = _context(address)
    view = cancel_job(settings, server, job_id)
    console.print(f"cancelled {view.id}")


def reprioritize(
    job_id: str = typer.Argument(..., help="Queued job id (`raydeck queue` lists them)."),
    priority: int = typer.Argument(..., help="Its new priority: higher starts first (>= 0, at "
                                             "most its team's max_priority)."),
    address: str = typer.Option(None, help="Job server URL (as for `raydeck submit`)."),
) -> None:
    """Change a job's priority (its submitter, its team's members or an admin may)."""
    from raydeck.scheduling.queue.client import reprioritize as reprioritize_job

    settings, server = _context(address)
    view = reprioritize_job(settings, server, job_id, priority)
    console.print(f"{view.id}: priority {view.priority}")
