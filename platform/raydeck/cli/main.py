"""The ``raydeck`` command: one Typer app, one module per command group.

Every command loads and validates settings before touching Ray or MLflow, so bad configuration
fails with exit code 2 and nothing half-created.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import traceback

import typer
from rich.markup import escape

from raydeck._internal.redaction import redact_text
from raydeck.cli import (
    dashboards,
    demo,
    jobs,
    k8s,
    models,
    monitoring,
    presets,
    queue,
    serving,
    stack,
    status,
    storage,
    sweep,
    tracking,
)
from raydeck.cli import settings as settings_cmd
from raydeck.cli._console import EXIT_USER_ERROR, err_console
from raydeck.cluster.connection import leave_as_command_driver
from raydeck.errors import RaydeckError

EXIT_BUG = 1
EXIT_INTERRUPTED = 130

app = typer.Typer(
    name="raydeck",
    help="Ray-native training platform: tracked training, sweeps, storage and dashboards.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        from raydeck._version import __version__

        typer.echo(f"raydeck {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
) -> None:
    """raydeck: tracked Ray training with nothing to set up on one machine."""


app.command("demo")(demo.demo)
app.command("status")(status.status)
app.command("presets")(presets.presets)
app.command("submit", context_settings={"allow_extra_args": True,
                                        "ignore_unknown_options": True})(jobs.submit)
app.command("jobs")(jobs.jobs)
app.command("queue")(queue.queue)
app.command("cancel")(queue.cancel)
app.command("reprioritize")(queue.reprioritize)
app.command("sweep")(sweep.sweep)
app.command("serve")(serving.serve)
app.add_typer(models.app, name="models")
app.add_typer(tracking.app, name="tracking")
app.add_typer(settings_cmd.app, name="config")
app.add_typer(storage.app, name="storage")
app.add_typer(dashboards.app, name="dashboards")
app.add_typer(monitoring.app, name="monitoring")
app.add_typer(k8s.app, name="k8s")
app.command("up")(stack.up)
app.command("down")(stack.down)
app.command("ps")(stack.ps)
app.command("logs")(stack.logs)


class _Leaving:
    """How a ``raydeck`` process ends once Python's exit hooks have run.

    A process that imported Ray ends with ``os._exit`` after every other exit hook (this one is
    registered before Ray is imported, so it runs last): C++'s static destructors never run,
    where OpenCensus's harvester thread raced them and a finished command died with SIGSEGV
    (``raydeck submit --queue`` printed its job, then exited -11). The exit code is kept.
    """

    code = 0

    @classmethod
    def after_python_teardown(cls) -> None:
        if "ray" not in sys.modules:
            return
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(cls.code)


def main() -> None:
    """Entry point: run the app, mapping raydeck's errors to one line and exit code 2.

    Anything else is a bug: its traceback is shown (exit code 1), redacted like every other
    output, because exceptions of other libraries quote URLs with their credentials. A command
    that connected to a running cluster leaves without Ray's teardown
    (:func:`raydeck.cluster.connection.leave_as_command_driver`); see :class:`_Leaving`.
    """
    atexit.register(_Leaving.after_python_teardown)
    _Leaving.code = _run("--debug" in sys.argv)
    leave_as_command_driver()
    sys.exit(_Leaving.code)


def _run(debug: bool) -> int:
    """The app's exit code."""
    try:
        app()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        sys.stderr.write(f"{exc.code}\n")
        return EXIT_BUG
    except RaydeckError as exc:
        if debug:
            sys.stderr.write(redact_text(traceback.format_exc()))
        else:
            err_console.print(f"[bold red]error:[/] {escape(redact_text(str(exc)))}",
                              soft_wrap=True)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception:
        sys.stderr.write(redact_text(traceback.format_exc()))
        return EXIT_BUG
    return 0
