"""``raydeck submit`` and ``raydeck jobs``: jobs on a Ray cluster via its job server."""

from __future__ import annotations

import datetime
import logging
import sys
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
    from pathlib import Path

    from raydeck.config.settings import Settings
    from raydeck.jobs.submission import JobRequest, JobServer, JobView, RunLink
    from raydeck.scheduling.queue.job_view import JobView as QueuedJobView

DEFAULT_RUNTIME_ENV = "runtime_envs/local.yaml"
DEFAULT_PRESET = "cpu-2"
EXIT_JOB_FAILED = 1


def submit(
    ctx: typer.Context,
    job_file: str = typer.Argument(..., help="Job file, relative to the working dir "
                                             "(e.g. jobs/digits_torch.py)."),
    preset: str = typer.Option(None, show_default=False,
                               help=f"Scaling preset (`raydeck presets`); the job reads it from "
                                    f"RAYDECK_PRESET. Default: {DEFAULT_PRESET}."),
    runtime_env: str = typer.Option(None, "--runtime-env", show_default=False,
                                    help=f"Runtime env YAML (runtime_envs/*.yaml). Default: "
                                         f"{DEFAULT_RUNTIME_ENV} in this directory if it exists, "
                                         "else the copy installed with raydeck."),
    address: str = typer.Option(None, help="Job server URL, http://host:8265, or a Ray Client "
                                "address ray://host:10001. Default: RAY_API_SERVER_ADDRESS, "
                                "else RAY_ADDRESS or RAYDECK_RAY_ADDRESS in any of Ray's forms "
                                "(a GCS address host:6379 leads to its dashboard), else the "
                                "running stack's, else http://127.0.0.1:8265."),
    run_name: str = typer.Option(None, help="MLflow run name; the job reads it from "
                                 "RAYDECK_RUN_NAME (default: the job file's name)."),
    run_id: str = typer.Option(None, help="Run id to resume or join (default: a new run)."),
    wait: bool = typer.Option(True, help="Stream the job's log until it ends."),
    check: bool = typer.Option(True, help="Run the preflight probe (the cluster's Python can "
                                          "import raydeck; the preset fits the cluster)."),
    cluster_env: bool = typer.Option(False, "--cluster-env",
                                     help="Leave ${NAME} values for the cluster's nodes to fill "
                                          "in (as `ray job submit` does) instead of your shell."),
    register_as: str = typer.Option(None, "--register-as", metavar="NAME",
                                    help="Once the job succeeds, register the model its run "
                                         "logged (artifact `model`) as a new version of NAME."),
    queue: bool = typer.Option(False, "--queue", help="Put the job in the cluster's queue "
                               "(`raydeck queue`) instead of starting it now."),
    team: str = typer.Option("default", help="With --queue: the team it counts against."),
    priority: int = typer.Option(0, help="With --queue: higher starts first (>= 0)."),
    estimate: str = typer.Option(None, help="With --queue: expected duration, e.g. 30m, 2h, "
                                 "for a job never run before (earlier runs of the same job in "
                                 "MLflow predict it otherwise)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the entrypoint and the runtime "
                                 "env the job would get, and submit nothing."),
) -> None:
    """Submit a job file with a preset and a runtime env; stream its log; show its MLflow run.

    The job contract: the cluster runs `python JOB_FILE ARGS...`, where ARGS are the arguments
    after `--`, passed untouched (arguments after the job file that submit does not know are
    passed too, but put the job's own after `--`: submit takes its options wherever they are).
    The job gets its preset, run name and run id in the environment variables RAYDECK_PRESET,
    RAYDECK_RUN_NAME and RAYDECK_RUN_ID, so any script runs; the repository's jobs read them as
    the defaults of their --preset and --run-name. A --preset or --run-name given to submit and
    again after `--` is an error.

    The token for a cluster with token authentication comes from RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH or, for a cluster on this machine only, ~/.ray/auth_token
    (RAY_AUTH_MODE=disabled sends none); it is never printed.
    """
    from raydeck._internal.redaction import redact_text, redact_url
    from raydeck.config.package_data import default_path
    from raydeck.config.settings import RUN_KEY_PATTERN, load_settings
    from raydeck.errors import ConfigError
    from raydeck.jobs.probe import probe
    from raydeck.jobs.runtime_env import load_runtime_env, shell_settings
    from raydeck.jobs.submission import (
        JobRequest,
        JobServer,
        check_job_file,
        contract_conflicts,
        default_run_name,
        find_run,
        new_run_id,
        stream_logs,
        submit_job,
    )
    from raydeck.observability.prometheus import parse_duration
    from raydeck.train.feasibility import check_feasible
    from raydeck.train.presets import get_preset

    settings = load_settings()
    setup_logging(settings.log_level)  # Ray's loggers are quieted once it is imported, below
    args = tuple(ctx.args)
    conflicts = contract_conflicts(args, preset=preset, run_name=run_name)
    if conflicts:
        raise ConfigError("; ".join(conflicts) + " (the job reads submit's from RAYDECK_PRESET "
                          "and RAYDECK_RUN_NAME: give each once)")
    if preset is None and any(a == "--preset" or a.startswith("--preset=") for a in args):
        err_console.print(f"[yellow]--preset after `--` goes to the job untouched; submit checks "
                          f"and queues it as preset {DEFAULT_PRESET} (RAYDECK_PRESET): pass "
                          f"--preset to submit instead[/]", soft_wrap=True)
    chosen = get_preset(preset or DEFAULT_PRESET, settings.presets_file)
    name = run_name or default_run_name(job_file)
    if run_id is not None and not RUN_KEY_PATTERN.match(run_id):
        raise ConfigError(f"--run-id={run_id!r}: may hold 1-128 letters, digits, _ . - only")
    if priority < 0:
        raise ConfigError(f"--priority={priority}: must be >= 0 (higher starts first)")
    estimate_s = parse_duration(estimate) if estimate is not None else None
    if queue and register_as is not None:
        raise ConfigError("--register-as needs the job's end, which a queued submission does "
                          "not wait for; register later with `raydeck models`")
    if register_as is not None:
        from raydeck.models import check_model_name  # imports torch: only when registering

        check_model_name(register_as)
        if not wait:
            raise ConfigError("--register-as registers the run's model once the job succeeds: "
                              "it needs --wait (drop --no-wait)")
    env_file = runtime_env or default_path(DEFAULT_RUNTIME_ENV)
    env = load_runtime_env(env_file, fill=not cluster_env)
    if not cluster_env:  # what the shell sets for raydeck reaches the job, never a secret
        env["env_vars"] = {**shell_settings(), **env["env_vars"]}
    check_job_file(job_file, env)
    request = JobRequest(job_file=job_file, preset=chosen.name, run_name=name,
                         run_id=run_id or new_run_id(name), runtime_env=env, args=args)
    if dry_run:
        _show_request(request, env_file)
        return
    _quiet_logs(settings.log_level)
    server = JobServer.from_env(address)
    client = server.client()
    shown = redact_url(server.address)
    if check:
        with console.status(f"checking the cluster at {shown}..."):
            cluster = probe(client, env)
        feasibility = check_feasible(chosen, node_totals=cluster.node_totals,
                                     node_available=cluster.node_available)
        console.print(f"cluster: {len(cluster.node_totals)} node(s), Python {cluster.python}, "
                      f"raydeck {cluster.raydeck_version}, Ray {cluster.ray_version}",
                      soft_wrap=True)
        if not feasibility.runs_now:
            console.print(f"[yellow]{escape(feasibility.message)}[/]")
    if queue:
        _enqueue(settings, server, request, team, priority, estimate_s)
        return
    submission_id = submit_job(client, request)
    console.print(f"submitted [bold]{submission_id}[/] to {shown}: "
                  f"{escape(redact_text(request.entrypoint))}", soft_wrap=True)
    console.print(f"  run id: {request.run_id}  (logs: `ray job logs {submission_id}`)",
                  soft_wrap=True)
    if not wait:
        return
    status = stream_logs(client, submission_id, _echo)
    run = find_run(settings.tracking.uri, settings.tracking.experiment, request.run_id)
    colour = "green" if status == "SUCCEEDED" else "red"
    console.print(f"\n[bold {colour}]{status}[/] {submission_id}")
    if run.mlflow_run_id:
        console.print(f"  MLflow run: {run.mlflow_run_id} ({run.status})"
                      + (f"  {run.url}" if run.url else ""), soft_wrap=True)
    else:
        console.print(f"  MLflow run: tag raydeck.run_key = {request.run_id} (not found in "
                      f"{redact_url(settings.tracking.uri)})", soft_wrap=True)
    if status != "SUCCEEDED":
        raise typer.Exit(EXIT_JOB_FAILED)
    if register_as is not None:
        if not run.mlflow_run_id:
            raise ConfigError(f"--register-as {register_as!r}: the job succeeded but its MLflow "
                              "run was not found, so there is no model to register")
        # The tracking proxy ends the run once all of its data has landed: until then the
        # metric the version is tagged with may still be on its way.
        with console.status("waiting for the run's last data to land in MLflow..."):
            _wait_for_run_end(settings, request.run_id)
        from raydeck.models import register_run_model
        from raydeck.storage import credentials_in_env

        with credentials_in_env(settings.storage):
            registered = register_run_model(settings.tracking.uri, run.mlflow_run_id,
                                            register_as, "val_accuracy")
        console.print(f"  registered: {registered.uri}  (serve it: raydeck serve "
                      f"{registered.uri})", soft_wrap=True)


def _show_request(request: JobRequest, env_file: str | Path) -> None:
    """What ``--dry-run`` prints: the entrypoint and the runtime env, as they would be sent."""
    import json

    from raydeck._internal.redaction import redact_text
    from raydeck.jobs.submission import submitted_runtime_env

    typer.echo(f"entrypoint: {redact_text(request.entrypoint)}")
    typer.echo(f"runtime env ({env_file}):")
    typer.echo(redact_text(json.dumps(submitted_runtime_env(request), indent=2, sort_keys=True)))


def _enqueue(settings: Settings, server: JobServer, request: JobRequest, team: str,
             priority: int, estimate_s: float | None) -> None:
    from raydeck.jobs.submission import is_local_address
    from raydeck.scheduling.queue.client import enqueue, job_spec

    spec, package = job_spec(request, settings, team, priority, estimate_s,
                             head_is_local=is_local_address(server.address))
    view = enqueue(settings, server, spec, package)
    console.print(f"queued [bold]{view.id}[/] for team {view.team}, priority {view.priority}, "
                  f"expected {format_duration(view.estimate_s)}; see `raydeck queue`",
                  soft_wrap=True)


def _wait_for_run_end(settings: Settings, run_id: str) -> None:
    """Poll the run until MLflow shows it ended (or the tracker's finish timeout passes)."""
    import time

    from raydeck.jobs.submission import find_run

    deadline = time.monotonic() + settings.tracking.finish_timeout_s
    while time.monotonic() < deadline:
        if find_run(settings.tracking.uri, settings.tracking.experiment,
                    run_id).status not in ("RUNNING", "SCHEDULED"):
            return
        time.sleep(0.5)
    logging.getLogger(__name__).warning("run %s still shows RUNNING in MLflow; registering its "
                                        "model as it is", run_id)


def _quiet_logs(level: str) -> None:
    """raydeck's own log lines only: Ray narrates every packaging step of a submission."""
    # Ray's job SDK sets its own logger to INFO when imported, so import it first.
    from ray.dashboard.modules import dashboard_sdk

    setup_logging(level)
    for name in ("ray", dashboard_sdk.__name__):
        logging.getLogger(name).setLevel(logging.ERROR)


def _echo(chunk: str) -> None:
    from raydeck._internal.redaction import redact_text

    sys.stdout.write(redact_text(chunk))
    sys.stdout.flush()



def jobs(
    address: str = typer.Option(None, help="Job server URL (as for `raydeck submit`)."),
    limit: int = typer.Option(20, min=1, help="How many recent jobs."),
    drivers: bool = typer.Option(False, "--drivers", help="Also list the drivers of scripts "
                                 "that connected with ray.init (`python train.py`, a "
                                 "notebook), as `ray job list` does; raydeck's own commands "
                                 "are never listed."),
    json_output: bool = typer.Option(False, "--json", help="Print the jobs as a JSON array "
                                     "(the queue's jobs that never started with type "
                                     "QUEUED)."),
) -> None:
    """List recent jobs of the cluster: status, duration and MLflow run.

    A job is a submission to the job server (`raydeck submit`, `ray job submit`, the queue's
    jobs): what `ray job logs` and `ray job stop` take. Ray also lists every process that
    connected with ray.init as a job (type DRIVER); --drivers adds those, except the drivers
    of raydeck's own commands (status, queue, jobs...), which are never jobs.
    """
    from raydeck._internal.redaction import redact_text, redact_url
    from raydeck.config.settings import load_settings
    from raydeck.jobs.submission import JobServer, find_run, list_jobs
    from raydeck.scheduling.queue.client import never_started

    settings = load_settings()
    _quiet_logs(settings.log_level)
    server = JobServer.from_env(address)
    views = list_jobs(server.client(), limit, drivers=drivers)
    runs = {view.run_id: find_run(settings.tracking.uri, settings.tracking.experiment,
                                  view.run_id) for view in views if view.run_id}
    if json_output:
        print_json_rows([*(_job_row(view, runs.get(view.run_id)) for view in views),
                         *(_never_started_row(job) for job in never_started(settings))])
        return
    table = Table(title=f"jobs on {redact_url(server.address)}")
    first = ("id", "type") if drivers else ("submission id",)
    add_columns(table, *first, "status", "started", "duration", "entrypoint", "MLflow run",
                whole=(first[0], "MLflow run"))
    for view in views:
        run = runs.get(view.run_id)
        link = "-" if run is None else (run.url or run.mlflow_run_id or f"run id {run.run_id}")
        # Entrypoints are whatever anyone submitted: a command line may hold a credential.
        failed = view.status == "FAILED" and view.exit_code is not None
        status = f"{view.status} (exit {view.exit_code})" if failed else view.status
        table.add_row(escape(view.id), *((view.type,) if drivers else ()), status,
                      _clock(view.started_s), format_duration(view.duration_s),
                      escape(redact_text(view.entrypoint)), escape(link))
    if not views:
        err_console.print("no jobs yet")
    print_table(table)
    queued = never_started(settings)  # the queue's answer may take seconds: after the table
    if queued:
        table = Table(title="queued jobs that never started (refused by the job server, or "
                            "cancelled while queued; `raydeck queue --all`)")
        add_columns(table, "job", "status", "submitted", "entrypoint", "reason", whole=("job",))
        for job in queued:
            table.add_row(escape(job.id), job.state.upper(), _clock(job.submitted_at),
                          escape(redact_text(job.entrypoint)), escape(job.reason))
        print_table(table)


def _clock(at_s: float | None) -> str:
    return (datetime.datetime.fromtimestamp(at_s).strftime("%Y-%m-%d %H:%M:%S")
            if at_s is not None else "-")


def _job_row(view: JobView, run: RunLink | None) -> dict[str, Any]:
    """One job of ``raydeck jobs --json``."""
    from raydeck._internal.redaction import redact_text

    return {"id": view.id, "type": view.type, "submission_id": view.submission_id,
            "job_id": view.job_id, "status": view.status, "started_s": view.started_s,
            "duration_s": view.duration_s, "entrypoint": redact_text(view.entrypoint),
            "message": redact_text(view.message), "run_id": view.run_id,
            "mlflow_run_id": run.mlflow_run_id if run else "",
            "mlflow_run_url": run.url if run else "", "exit_code": view.exit_code}


def _never_started_row(job: QueuedJobView) -> dict[str, Any]:
    """A queued job that never started, as ``raydeck jobs --json`` lists it."""
    from raydeck._internal.redaction import redact_text

    return {"id": job.id, "type": "QUEUED", "submission_id": job.submission_id, "job_id": "",
            "status": job.state.upper(), "started_s": None, "duration_s": None,
            "entrypoint": redact_text(job.entrypoint), "message": redact_text(job.reason),
            "run_id": "", "mlflow_run_id": "", "mlflow_run_url": "", "exit_code": None}
