"""The shard's spool on its own: what it accepted survives a crash, re-deliveries are dropped."""

from __future__ import annotations

from pathlib import Path

from raydeck.tracking.messages import Batch
from raydeck.tracking.spool import Spool


def _batch(client: str, seq: int, points: int = 3, files: bool = False) -> Batch:
    return Batch(
        client_id=client, seq=seq, run_id="run", params_run_id="run",
        points=[("x", float(i), 1000 + i, i) for i in range(points)],
        files=[("model/weights.bin", b"\x00\x01" * 10)] if files else [],
    )


def test_uncommitted_batches_are_replayed_after_reopening(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    first = spool.accept(_batch("a", 0))
    second = spool.accept(_batch("a", 1, files=True))
    assert first and second
    spool.commit([first.record_id])
    spool.close()

    reopened = Spool(tmp_path)
    assert [item.batch.seq for item in reopened.replayed] == [1]
    blob = reopened.blob_root(reopened.replayed[0].record_id) / "model" / "weights.bin"
    assert blob.read_bytes() == b"\x00\x01" * 10


def test_redelivered_batches_are_dropped_also_after_a_restart(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    assert spool.accept(_batch("a", 0)) is not None
    assert spool.accept(_batch("a", 0)) is None
    spool.close()
    reopened = Spool(tmp_path)
    assert reopened.accept(_batch("a", 0)) is None
    assert reopened.accept(_batch("a", 1)) is not None
    assert reopened.accept(_batch("b", 0)) is not None


def test_a_torn_record_at_the_tail_is_cut_off(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.accept(_batch("a", 0))
    spool.accept(_batch("a", 1))
    spool.close()
    segment = sorted(tmp_path.glob("seg-*.log"))[-1]
    data = segment.read_bytes()
    segment.write_bytes(data[:-5])  # the process died in the middle of the last write

    reopened = Spool(tmp_path)
    assert [item.batch.seq for item in reopened.replayed] == [0]
    assert reopened.accept(_batch("a", 1)) is not None  # the torn one can be delivered again


def test_committed_data_leaves_the_spool(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    items = [spool.accept(_batch("a", seq, points=1000, files=True)) for seq in range(20)]
    spool.commit([item.record_id for item in items if item])
    spool.close()
    reopened = Spool(tmp_path)
    assert reopened.replayed == []
    assert len(list(tmp_path.glob("seg-*.log"))) == 1
    assert list((tmp_path / "blobs").iterdir()) == []
