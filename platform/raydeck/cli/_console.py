"""The CLI's console and error policy: one place that decides how errors look.

Library code raises typed errors and logs; only the CLI prints. A
:class:`~raydeck.errors.RaydeckError` becomes one red line and exit code 2; anything else is a
bug and shows its traceback.
"""

from __future__ import annotations

import logging

from rich.console import Console

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
