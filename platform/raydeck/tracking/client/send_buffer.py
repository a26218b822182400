"""A tracker's bounded buffer: what a process has logged and not yet cut into a batch.

Back-pressure: the buffer holds at most ``RAYDECK_TRACKING_MAX_BUFFER_POINTS`` points and
``RAYDECK_TRACKING_MAX_BUFFER_MB`` of data. It only fills while the proxy cannot take data (its
spool is on disk, so an MLflow outage does not fill it). A log call that finds it full waits for
room up to ``RAYDECK_TRACKING_BUFFER_FULL_WAIT_S``; if there is still none, that call's values are
dropped and counted (a warning, and the tag ``raydeck.buffer_dropped_values`` once the proxy is
back), so training is delayed by a bounded time and never stopped, and nothing is dropped
silently.

Waking the sender: ``_wake`` is set when a batch's worth of points is buffered, when a file or
dataset arrives (sent at once), and when anything arrives while the sender sleeps for want of
data (``_idle``, which the sender sets under ``_lock``). Sending is
:class:`~raydeck.tracking.client.delivery.Delivery`'s, which extends this class.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from raydeck.config.settings import TrackingSettings
from raydeck.tracking.messages import DatasetRef, FileRef, Point

logger = logging.getLogger(__name__)

POINT_BYTES = 64  # what one buffered point costs, roughly, besides its key
MAX_BATCH_LOG_BYTES = 1024 * 1024
DROP_WARNING_INTERVAL_S = 60.0
DROPPED_TAG = "raydeck.buffer_dropped_values"


@dataclass
class _Buffer:
    points: list[Point] = field(default_factory=list)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    files: list[tuple[FileRef, Path]] = field(default_factory=list)
    inputs: list[DatasetRef] = field(default_factory=list)
    logs: list[tuple[str, str]] = field(default_factory=list)
    nbytes: int = 0

    def empty(self) -> bool:
        return not (self.points or self.params or self.tags or self.files or self.inputs
                    or self.logs)


class SendBuffer:
    """The bounded buffer (see the module docstring). Thread-safe."""

    def __init__(self, tracking: TrackingSettings) -> None:
        self._max_points = tracking.max_buffer_points
        self._max_bytes = int(tracking.max_buffer_mb * 1024 * 1024)
        self._batch_points = tracking.max_batch_points
        self._full_wait_s = tracking.buffer_full_wait_s
        self._lock = threading.RLock()
        self._room = threading.Condition(self._lock)
        self._buffer = _Buffer()
        self._dropped = 0
        self._dropped_reported = 0
        self._last_drop_warning = 0.0
        self._wake = threading.Event()
        self._idle = False  # the sender sleeps until data arrives (under ``_lock``)

    def add_points(self, points: list[Point]) -> None:
        """Buffer points; waits for room up to the bound, then drops and counts them."""
        if not points:
            return
        size = len(points) * POINT_BYTES
        with self._lock:
            buffer = self._buffer
            if len(buffer.points) + len(points) > self._max_points or (
                    buffer.nbytes + size > self._max_bytes):
                self._wake.set()
                deadline = time.monotonic() + self._full_wait_s
                while (len(buffer.points) + len(points) > self._max_points
                       or buffer.nbytes + size > self._max_bytes):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._drop(len(points))
                        return
                    self._room.wait(left)
                    buffer = self._buffer
            buffer.points.extend(points)
            buffer.nbytes += size
            if self._idle or len(buffer.points) >= self._batch_points:
                self._idle = False
                self._wake.set()

    def _drop(self, n: int) -> None:
        """Count values dropped because the buffer stayed full. Caller holds the lock."""
        self._dropped += n
        now = time.monotonic()
        if now - self._last_drop_warning > DROP_WARNING_INTERVAL_S:
            self._last_drop_warning = now
            logger.warning(
                "tracking buffer full for %.0f s (the proxy is not taking data); dropped %d "
                "value(s) so far (the run gets the tag %s); raise "
                "RAYDECK_TRACKING_MAX_BUFFER_POINTS/_MB or check `raydeck tracking status`",
                self._full_wait_s, self._dropped, DROPPED_TAG)

    def _arrived(self) -> None:
        """Data arrived: wake the flusher if it sleeps for want of data. Caller holds the lock."""
        if self._idle:
            self._idle = False
            self._wake.set()

    def add_params(self, params: dict[str, str]) -> None:
        with self._lock:
            self._buffer.params.update(params)
            self._buffer.nbytes += sum(len(k) + len(v) for k, v in params.items())
            self._arrived()

    def add_tags(self, tags: dict[str, str]) -> None:
        with self._lock:
            self._buffer.tags.update(tags)
            self._buffer.nbytes += sum(len(k) + len(v) for k, v in tags.items())
            self._arrived()

    def add_input(self, dataset: DatasetRef) -> None:
        with self._lock:
            self._buffer.inputs.append(dataset)
        self._wake.set()

    def add_log(self, name: str, text: str) -> None:
        with self._lock:
            self._buffer.logs.append((name, text))
            self._buffer.nbytes += len(text)
            self._arrived()

    def _add_staged(self, ref: FileRef, staged: Path) -> None:
        with self._lock:
            self._buffer.files.append((ref, staged))
        self._wake.set()

    def _cut(self) -> _Buffer | None:
        """Take the next batch's contents out of the buffer (at most ``max_batch_points``
        points and ``MAX_BATCH_LOG_BYTES`` of console text, everything else whole), with the
        dropped count as a tag if it grew; None when nothing is buffered."""
        with self._lock:
            buffer = self._buffer
            if self._dropped > self._dropped_reported:
                buffer.tags[DROPPED_TAG] = str(self._dropped)
                self._dropped_reported = self._dropped
            if buffer.empty():
                return None
            points = buffer.points[:self._batch_points]
            rest = buffer.points[self._batch_points:]
            logs: list[tuple[str, str]] = []
            log_bytes = 0
            while buffer.logs and (not logs or log_bytes + len(buffer.logs[0][1])
                                   <= MAX_BATCH_LOG_BYTES):
                logs.append(buffer.logs.pop(0))
                log_bytes += len(logs[-1][1])
            self._buffer = _Buffer(
                points=rest, logs=buffer.logs,
                nbytes=len(rest) * POINT_BYTES + sum(len(text) for _, text in buffer.logs))
            self._room.notify_all()
            return _Buffer(points=points, params=buffer.params, tags=buffer.tags,
                           files=buffer.files, inputs=buffer.inputs, logs=logs)
