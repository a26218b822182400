"""raydeck._internal.atomic_file: a file is replaced whole or not at all, with its permissions."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from raydeck._internal.atomic_file import atomic_write

pytestmark = pytest.mark.timeout(30)


def test_the_file_appears_whole_with_the_mode_asked_for_and_no_temporary_stays(
        tmp_path: Path) -> None:
    path = tmp_path / "credentials"
    path.write_text("old")
    previous_umask = os.umask(0o022)
    try:
        with atomic_write(path, file_mode=0o600) as handle:
            handle.write("new")
            assert path.read_text() == "old", "the file changed before the block ended"
    finally:
        os.umask(previous_umask)
    assert path.read_text() == "new"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["credentials"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path: Path) -> None:
    path = tmp_path / "cache.npz"
    path.write_bytes(b"old")
    with pytest.raises(OSError, match="disk full"), atomic_write(path, binary=True) as handle:
        handle.write(b"half")
        raise OSError("disk full")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.npz"]


def test_a_missing_directory_raises_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError), atomic_write(tmp_path / "absent" / "state.json"):
        pass
    assert list(tmp_path.iterdir()) == []
