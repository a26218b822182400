"""How fast Ray Train persists a checkpoint: the S3 bucket against local disk, in one run.

Uses Ray Train's own upload path (``StorageContext.persist_current_checkpoint``, i.e.
``pyarrow.fs.copy_files`` with Ray's chunk size and threading) with the storage raydeck
configures (:func:`raydeck.storage.checkpoint_storage`): once to a directory on local disk,
once to the checkpoint bucket of a SeaweedFS S3 server started here on loopback (or the S3
configured by ``RAYDECK_S3_*``, if set). Checkpoints are random bytes (incompressible), in
shapes a job produces: the digits job's three small files, one large state file, many shards.

Prints a table with MB/s (10^6 bytes per second, median of the repeats) and the ratio
S3 / local disk. Local disk numbers include the page cache, as Ray Train sees them.
Run: ``.venv/bin/python benchmarks/checkpoint_upload.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures.s3_server import S3Server  # noqa: E402

MB = 1_000_000
# (name, number of files, bytes per file)
SHAPES: list[tuple[str, int, int]] = [
    ("digits job (3 small files)", 3, 120_000),
    ("1 file x 64 MB", 1, 64 * MB),
    ("1 file x 256 MB", 1, 256 * MB),
    ("32 files x 4 MB", 32, 4 * MB),
]
DEFAULT_REPEATS = 3
BENCH_BUCKET = "bench-checkpoints"


def make_checkpoint(directory: Path, files: int, size: int) -> int:
    """Write ``files`` random files of ``size`` bytes; returns the total bytes."""
    directory.mkdir(parents=True)
    for index in range(files):
        (directory / f"shard_{index:03d}.bin").write_bytes(os.urandom(size))
    return files * size


def uploader(storage_path: str, filesystem: object | None) -> Callable[[Path], float]:
    """A function that persists a checkpoint directory the way Ray Train does; returns seconds."""
    from ray.train import Checkpoint
    from ray.train.v2._internal.execution.storage import StorageContext

    context = StorageContext(storage_path=storage_path,
                             experiment_dir_name=f"bench-{uuid.uuid4().hex[:8]}",
                             storage_filesystem=filesystem)  # type: ignore[arg-type]

    def upload(source: Path) -> float:
        started = time.perf_counter()
        context.persist_current_checkpoint(Checkpoint.from_directory(str(source)),
                                           f"checkpoint_{uuid.uuid4().hex[:8]}")
        return time.perf_counter() - started

    return upload


def measure(upload: Callable[[Path], float], source: Path, repeats: int) -> float:
    """Median seconds of ``repeats`` uploads (after one warm-up upload)."""
    upload(source)
    return statistics.median(upload(source) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from raydeck.config.settings import load_settings
    from raydeck.storage import checkpoint_storage, init_buckets

    # Ray Train logs every persisted checkpoint at INFO; the table is the output here.
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    console = Console()
    if not console.is_terminal:
        console.width = 120
    with tempfile.TemporaryDirectory(prefix="raydeck-bench-") as tmp:
        root = Path(tmp)
        server: S3Server | None = None
        env = dict(os.environ)
        if not env.get("RAYDECK_S3_ENDPOINT"):
            server = S3Server(root / "s3").start()
            env.update(server.settings_env(RAYDECK_S3_CHECKPOINTS_BUCKET=BENCH_BUCKET))
        try:
            settings = load_settings(env={**env, "RAYDECK_DATA_DIR": str(root / "data")})
            init_buckets(settings.storage, probe=False)
            s3 = checkpoint_storage(settings)
            local = root / "local-disk"
            targets = {
                "local disk": uploader(str(local), None),
                "S3": uploader(s3.storage_path, s3.filesystem),
            }
            table = Table(title=f"checkpoint upload, Ray Train's path: local disk vs "
                                f"{settings.storage.endpoint} ({os.cpu_count()} CPUs)")
            for column in ("checkpoint", "size MB", "local disk MB/s", "S3 MB/s",
                           "S3 / local disk", "S3 s per checkpoint"):
                table.add_column(column, justify="left" if column == "checkpoint" else "right")
            for name, files, size in SHAPES:
                source = root / "sources" / name.replace(" ", "_")
                total = make_checkpoint(source, files, size)
                seconds = {target: measure(upload, source, args.repeats)
                           for target, upload in targets.items()}
                rates = {target: total / MB / took for target, took in seconds.items()}
                table.add_row(name, f"{total / MB:.1f}", f"{rates['local disk']:.0f}",
                              f"{rates['S3']:.0f}", f"{rates['S3'] / rates['local disk']:.2f}",
                              f"{seconds['S3']:.2f}")
                console.print(f"measured {name}")
            console.print(table)
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    main()
