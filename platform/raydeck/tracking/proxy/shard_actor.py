"""The Ray actor of a writer shard: :class:`Shard` wraps
:class:`~raydeck.tracking.proxy.shard.ShardCore` in two concurrency groups; the router
(:mod:`raydeck.tracking.proxy.actors`) starts one per shard.
"""

from __future__ import annotations

from typing import Any

import ray

from raydeck.tracking.messages import (
    Batch,
    DeadLetter,
    IngestResult,
    LandedReport,
    Resolution,
    ShardConfig,
)
from raydeck.tracking.proxy.shard import ShardCore


class Shard:
    """The Ray actor wrapping :class:`ShardCore`.

    Two concurrency groups: ``io`` takes ``ingest``, uploads, control and stats, and never
    waits; ``wait`` takes the calls that block until data landed, so a tracker waiting in
    ``finish()`` never holds a thread that another tracker's ``ingest`` needs.
    """

    def __init__(self, config: ShardConfig) -> None:
        self.core = ShardCore(config)

    @ray.method(concurrency_group="io")
    def ingest(self, batch: Batch) -> IngestResult:
        return self.core.ingest(batch)

    @ray.method(concurrency_group="io")
    def put_chunk(self, upload_id: str, offset: int, data: bytes) -> int:
        return self.core.put_chunk(upload_id, offset, data)

    @ray.method(concurrency_group="io")
    def control(self, run_key: str, kind: str, payload: Any) -> None:
        self.core.control(run_key, kind, payload)

    @ray.method(concurrency_group="io")
    def latest(self, run_key: str) -> dict[str, tuple[float, int]]:
        return self.core.latest(run_key)

    @ray.method(concurrency_group="io")
    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    @ray.method(concurrency_group="io")
    def dead_letters(self, run_key: str | None = None) -> list[DeadLetter]:
        return self.core.spool.dead_letters(run_key)

    @ray.method(concurrency_group="wait")
    def wait_landed(self, run_keys: list[str], timeout_s: float) -> LandedReport:
        return self.core.wait_landed(run_keys, timeout_s)

    @ray.method(concurrency_group="wait")
    def resolve(self, run_key: str, timeout_s: float) -> Resolution | None:
        return self.core.resolve(run_key, timeout_s)

    @ray.method(concurrency_group="wait")
    def last_steps(self, run_key: str, keys: list[str], timeout_s: float,
                   resumed_by: str | None = None) -> dict[str, int]:
        return self.core.last_steps(run_key, keys, timeout_s, resumed_by)

    @ray.method(concurrency_group="io")
    def ping(self) -> bool:
        return True
