"""The CLI's console and error policy: one place that decides how errors and tables look.

Library code raises typed errors and logs; only the CLI prints. A
:class:`~raydeck.errors.RaydeckError` becomes one red line and exit code 2; anything else is a
bug and shows its traceback. Every table goes through :func:`print_table`, which never cuts a
value a user copies (a run id, a URL, a preset name), and a command's ``--json`` through
:func:`print_json_rows`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import typer
from rich.console import Console, ConsoleOptions
from rich.measure import Measurement
from rich.table import Column, Table
from rich.text import Text

from raydeck.config.tracking_uri import LOCAL_UI_URL, run_page, run_url, ui_command

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

EXIT_USER_ERROR = 2


def setup_logging(level: str) -> None:
    """raydeck's loggers to stderr at ``level``, redacted; Ray's and MLflow's stay quiet."""
    from rich.logging import RichHandler

    from raydeck._internal.redaction import RedactingFilter

    handler = RichHandler(console=err_console, show_path=False, show_time=False)
    handler.addFilter(RedactingFilter())
    root = logging.getLogger("raydeck")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    for noisy in ("ray", "mlflow", "alembic", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def format_duration(seconds: float | None) -> str:
    """``5s``, ``3m07s``, ``2h05m`` (``-`` when unknown): the CLI's one way to show a duration."""
    if seconds is None:
        return "-"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def run_link_lines(tracking_uri: str, experiment_id: str, run_id: str) -> list[tuple[str, str]]:
    """Where to open a run in MLflow's UI, as (label, text) lines: the run's page on the
    tracking server, or, for a file or database store, the command that serves a UI over it and
    the run's page there. Every command that reports a run prints it this way."""
    url = run_url(tracking_uri, experiment_id, run_id)
    if url:
        return [("open:", url)]
    return [("open the MLflow UI:", ui_command(tracking_uri)),
            ("", f"then {LOCAL_UI_URL}/{run_page(experiment_id, run_id)}")]


# --- tables ---------------------------------------------------------------------------------
# Wider than any table raydeck prints: the width a table is measured at to find its natural
# (one line per row) and its least widths.
_UNBOUNDED_WIDTH = 100_000


def add_columns(table: Table, *headers: str, whole: Collection[str] = ()) -> None:
    """Add ``headers`` as columns of ``table``; those in ``whole`` hold what a user copies (run,
    job and submission ids, URLs, preset and model names, versions): :func:`print_table` never
    cuts or splits them. The other columns wrap at spaces and fold a word too long for them."""
    for header in headers:
        if header in whole:
            # "ignore": were the column ever too narrow, its value overflows rather than loses
            # characters (print_table makes it wide enough).
            table.add_column(header, no_wrap=True, overflow="ignore")
        else:
            table.add_column(header, overflow="fold")


def print_table(table: Table, out: Console | None = None) -> None:
    """Print ``table`` so that no cell loses a character and no identifier is split.

    Identifier columns are those that do not wrap (:func:`add_columns`' ``whole``, or any
    column added with ``no_wrap=True``): each is as wide as its widest value. Every other
    column wraps at spaces and is never narrower than its longest word. Where the table goes
    decides the layout:

    - not a terminal (a pipe, a file): every column at its natural width, one line per row
      whatever ``COLUMNS`` says, so ``grep`` and ``cut`` see whole rows (``--json`` is the
      format for programs);
    - a terminal wide enough for that least width: the table, the room left shared among the
      other columns by how much each would take;
    - a narrower terminal: one block per row, a ``column  value`` line for each cell, as
      psql's expanded display (``\\x``) does.
    """
    out = out or console
    wide = out.options.update_width(_UNBOUNDED_WIDTH)
    ranges = [_content_range(out, wide, column) for column in table.columns]
    least = [low for low, _ in ranges]
    natural = [high for _, high in ranges]
    # Borders and padding: what the table measures beyond its columns' contents.
    frame = Measurement.get(out, wide, table).maximum - sum(natural)
    room = out.width - frame
    if sum(least) <= room < sum(natural) and out.is_terminal:
        widths = _share(least, natural, room)
    elif room < sum(least) and out.is_terminal and table.row_count:
        _print_records(table, out)
        return
    else:
        widths = natural
    for column, width in zip(table.columns, widths, strict=True):
        column.width = max(width, 1)
        if not column.no_wrap:
            column.overflow = "fold"  # never "ellipsis", rich's default, were a word longer
    # A table's own width outranks the console's: in a pipe its natural width may be wider.
    table.width = frame + sum(column.width or 0 for column in table.columns)
    out.print(table, crop=False)


def _content_range(out: Console, options: ConsoleOptions, column: Column) -> tuple[int, int]:
    """The least and the natural width of ``column``'s contents, header included: an
    identifier column's are both its widest value; another's, its longest word and its widest
    value."""
    sizes = [Measurement.get(out, options, cell) for cell in (column.header, *column.cells)]
    natural = max(size.maximum for size in sizes)
    return (natural if column.no_wrap else max(size.minimum for size in sizes)), natural


def _share(least: list[int], natural: list[int], room: int) -> list[int]:
    """Widths from ``least`` up to ``natural`` that add up to at most ``room``: the room
    beyond the least widths goes to each column in proportion to what it still wants."""
    spare = room - sum(least)
    wants = [high - low for low, high in zip(least, natural, strict=True)]
    total = sum(wants)
    return [low + want * spare // total for low, want in zip(least, wants, strict=True)]


def _print_records(table: Table, out: Console) -> None:
    """``table`` as one block per row: its title, then for each row a blank line and a
    ``header  value`` line per column (a value is never wrapped: the terminal folds a line
    longer than it is wide)."""
    headers = [Text.from_markup(h) if isinstance(h, str) else Text(str(h))
               for h in (column.header for column in table.columns)]
    label_width = max(header.cell_len for header in headers)
    if table.title:
        out.print(table.title, style="italic", soft_wrap=True)
    rows = zip(*(list(column.cells) for column in table.columns), strict=True)
    for row in rows:
        out.print()
        for header, cell in zip(headers, row, strict=True):
            value = cell if isinstance(cell, Text) else out.render_str(str(cell))
            label = Text.assemble(header, " " * (label_width - header.cell_len + 2),
                                  style="bold")
            out.print(label + value, soft_wrap=True)


def print_json_rows(rows: Sequence[Mapping[str, Any]]) -> None:
    """``rows`` as a JSON array on stdout (``--json``): what a table shows, for programs."""
    typer.echo(json.dumps(list(rows), indent=2, default=str))
