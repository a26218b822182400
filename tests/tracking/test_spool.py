"""The shard's spool on its own: what it accepted survives a crash, re-deliveries are dropped,
progress is committed entity by entity, a full disk refuses cleanly, and no artifact name can
place a file outside it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from raydeck.errors import TrackingSpoolFullError
from raydeck.tracking.messages import DeadLetter, FileRef
from raydeck.tracking.proxy.spool import KIND_FILE, KIND_METRICS, NewEntity, Spool


def _points(run: str, n: int, start: int = 0) -> NewEntity:
    return NewEntity(run, KIND_METRICS, n, [("x", float(i), 1000 + i, i)
                                           for i in range(start, start + n)])


def test_what_was_accepted_is_there_after_a_killed_process(tmp_path: Path) -> None:
    # A separate process accepts two entities and is SIGKILLed without closing anything.
    code = textwrap.dedent(f"""
        import os, signal
        from raydeck.tracking.proxy.spool import KIND_METRICS, NewEntity, Spool
        spool = Spool(__import__("pathlib").Path({str(tmp_path)!r}))
        spool.accept("a", 0, [NewEntity("run", KIND_METRICS, 1, [("x", 1.0, 1, 0)])])
        spool.accept("a", 1, [NewEntity("run", KIND_METRICS, 1, [("x", 2.0, 2, 1)])])
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", code], timeout=120, check=False)
    assert done.returncode == -9
    spool = Spool(tmp_path)
    window = spool.window("run", 10)
    assert [kind for _, kind, _ in window] == [KIND_METRICS, KIND_METRICS]
    loaded = spool.load("run", [entity_id for entity_id, _, _ in window])
    assert [e.payload[0][1] for e in loaded] == [1.0, 2.0]
    assert spool.accept("a", 1, [_points("run", 1)]) is None  # the dedup mark survived too
    spool.close()


def test_redelivered_batches_are_dropped_also_after_a_restart(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    assert spool.accept("a", 0, [_points("run", 3)]) is not None
    assert spool.accept("a", 0, [_points("run", 3)]) is None
    spool.close()
    reopened = Spool(tmp_path)
    assert reopened.accept("a", 0, [_points("run", 3)]) is None
    assert reopened.accept("a", 1, [_points("run", 3)]) is not None
    assert reopened.accept("b", 0, [_points("run", 3)]) is not None
    assert sum(n for _, _, n in reopened.window("run", 100)) == 9
    reopened.close()


def test_progress_is_committed_per_entity_and_counts_come_back(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    accepted = spool.accept("a", 0, [_points("r1", 1000, i * 1000) for i in range(5)]
                            + [_points("r2", 10)])
    assert accepted is not None
    spool.remove(accepted[:2], [DeadLetter("r1", "metric", "x", "refused: bad value")])
    spool.close()
    reopened = Spool(tmp_path)
    counts = {(run, kind): (entities, n) for run, kind, entities, n in reopened.pending_counts()}
    assert counts == {("r1", KIND_METRICS): (3, 3000), ("r2", KIND_METRICS): (1, 10)}
    assert reopened.dead_letters("r1") == [DeadLetter("r1", "metric", "x", "refused: bad value")]
    # A window reads ids, kinds and sizes only; payloads are loaded for what is taken.
    window = reopened.window("r1", 2)
    assert [n for _, _, n in window] == [1000, 1000]
    first = reopened.load("r1", [window[0][0]])[0]
    assert first.payload[0][3] == 2000
    reopened.close()


def test_artifact_bytes_stream_in_and_resume_at_the_size_held(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    upload = uuid.uuid4().hex
    assert spool.append_chunk(upload, 0, b"abc") == 3
    assert spool.append_chunk(upload, 0, b"abc") == 3  # a retried chunk writes nothing
    assert spool.append_chunk(upload, 3, b"def") == 6
    ref = FileRef(upload, "model", "weights.bin", 6)
    [entity] = spool.accept("a", 0, [NewEntity("run", KIND_FILE, 1, ref, ref=upload)]) or []
    staged = spool.stage(entity.id, upload, ref.name)
    assert staged.read_bytes() == b"abcdef" and staged.name == "weights.bin"
    spool.remove([entity])
    assert not spool.upload_path(upload).exists() and not staged.exists()
    spool.close()


@pytest.mark.parametrize("name", ["", ".", "..", "../escape", "a/b", "/etc/passwd"])
def test_no_artifact_name_reaches_outside_the_spool(tmp_path: Path, name: str) -> None:
    spool = Spool(tmp_path / "spool")
    upload = uuid.uuid4().hex
    spool.append_chunk(upload, 0, b"data")
    with pytest.raises(ValueError, match="plain file name"):
        spool.stage(1, upload, name)
    with pytest.raises(ValueError, match="32 hex digits"):
        spool.upload_path("../../etc")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spool"]
    spool.close()


@contextlib.contextmanager
def _tiny_disk(path: Path, size: str) -> Iterator[Path]:
    """A real small file system (tmpfs) mounted at ``path``, unmounted afterwards."""
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root (CI runs as root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_refuses_with_a_clear_error_and_keeps_what_was_acknowledged(
    tmp_path: Path,
) -> None:
    with _tiny_disk(tmp_path / "disk", "1m") as disk:
        spool = Spool(disk)
        acknowledged = 0
        with pytest.raises(TrackingSpoolFullError, match="is full") as raised:
            for seq in range(10_000):
                spool.accept("a", seq, [_points("run", 1000, seq * 1000)])
                acknowledged += 1
        assert "free disk space" in str(raised.value)
        upload = uuid.uuid4().hex
        with pytest.raises(TrackingSpoolFullError):
            spool.append_chunk(upload, 0, os.urandom(2 * 1024 * 1024))
        assert spool.upload_size(upload) == 0  # the torn chunk was cut back
        spool.close()
        reopened = Spool(disk)
        points = sum(n for _, _, _, n in reopened.pending_counts())
        assert acknowledged > 0 and points == acknowledged * 1000
        reopened.close()
