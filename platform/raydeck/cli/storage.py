"""``raydeck storage init``: create the buckets raydeck uses and prove it can use them.

The command only calls :func:`raydeck.storage.init_buckets` and draws its answer; a refused
credential, a missing permission or an unreachable endpoint is a
:class:`~raydeck.errors.StorageError`, which the CLI prints as one line with exit code 2.
"""

from __future__ import annotations

import typer
from rich.table import Table

from raydeck.cli._console import add_columns, console, print_table, setup_logging

app = typer.Typer(help="Set up object storage (MinIO or any S3).", no_args_is_help=True)


@app.command("init")
def init(
    probe: bool = typer.Option(True, "--probe/--no-probe",
                               help="Write, read and delete a probe object in each bucket."),
) -> None:
    """Create the artifacts and checkpoints buckets if missing (idempotent) and probe them."""
    from raydeck._internal.redaction import redact_url
    from raydeck.config.settings import load_settings
    from raydeck.storage import init_buckets

    settings = load_settings()
    setup_logging(settings.log_level)
    storage = settings.storage
    endpoint = redact_url(storage.endpoint)
    with console.status(f"checking {endpoint or 'object storage'}..."):
        reports = init_buckets(storage, probe=probe)
    table = Table(title=f"object storage at {endpoint} "
                        f"(access key id {storage.access_key_id})")
    add_columns(table, "role", "bucket", "state", "probe", "location",
                whole=("bucket", "location"))
    for report in reports:
        state = "[green]created[/]" if report.created else "exists"
        table.add_row(report.role, report.bucket, state, report.probe or "skipped", report.uri)
    print_table(table)
