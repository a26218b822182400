"""Capturing what a process writes to stdout and stderr, for the run's ``logs/`` artifacts.

Works where the streams are files, as they are for Ray workers and ``ray job submit`` drivers
(Ray redirects them to its log directory); elsewhere (a terminal) it is inert. Reads only what is
new since the last call, at most :data:`CONSOLE_CHUNK_MAX_BYTES` per stream and call, so a chatty
process never makes the tracker hold its whole log.
"""

from __future__ import annotations

import os
from typing import Any

CONSOLE_CHUNK_MAX_BYTES = 1024 * 1024


class ConsoleCapture:
    """Reads what this process wrote to stdout/stderr since the capture started."""

    def __init__(self) -> None:
        self._files: list[tuple[Any, str]] = []
        for fd, label in ((1, "stdout"), (2, "stderr")):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if os.path.isfile(target) and all(target != f.name for f, _ in self._files):
                handle = open(target, "rb")  # noqa: SIM115 - kept open for incremental reads
                handle.seek(0, os.SEEK_END)
                self._files.append((handle, label))

    def read_new(self) -> str:
        parts = []
        for handle, label in self._files:
            data = handle.read(CONSOLE_CHUNK_MAX_BYTES)
            if data:
                text = data.decode("utf-8", errors="replace")
                parts.append(text if label == "stdout" else "".join(
                    f"[stderr] {line}" for line in text.splitlines(keepends=True)))
        return "".join(parts)

    def close(self) -> None:
        for handle, _ in self._files:
            handle.close()
        self._files = []
