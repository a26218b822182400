"""Writing a file aside and renaming it into place, so no reader ever sees half of it.

Owns: :func:`atomic_write`, which the stack's state file, the stack's connection file and the
digits example's split cache use. A reader sees the old file or the new one, never a torn one,
and an error removes the temporary (a killed process may leave one behind; a later write from
the same pid truncates and reuses it). Does not own: creating the parent directory (callers do,
where they want it) or fsync (what is written here can be recomputed or rewritten).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

# What ``open()`` creates files with (before the umask): the default for files anyone may read.
DEFAULT_FILE_MODE = 0o666


@contextlib.contextmanager
def atomic_write(path: Path, *, binary: bool = False,
                 file_mode: int = DEFAULT_FILE_MODE) -> Iterator[IO[Any]]:
    """Open a temporary beside ``path`` for writing; when the block ends, rename it onto ``path``.

    Args:
        path: the file to replace; its directory must exist.
        binary: open the temporary in binary mode (else text, in the locale's encoding).
        file_mode: permissions a new temporary is created with (before the umask), e.g. 0o600
            for a file that holds credentials, so that it is never readable by others.

    Yields:
        The open temporary.

    Raises:
        OSError: the temporary cannot be created or written, or the rename fails. The
            temporary is removed then, as on any error the block raises, and ``path`` keeps
            what it held.
    """
    # A hidden sibling named by this process's pid: two processes writing the same file never
    # share a temporary, and the rename stays within one file system.
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb" if binary else "w",
                  opener=lambda name, flags: os.open(name, flags, file_mode)) as handle:
            yield handle
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
