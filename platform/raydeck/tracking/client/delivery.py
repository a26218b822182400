"""A tracker's way to the proxy: batches out of its bounded buffer, and the flusher thread.

Owns: what a process has logged and the proxy has not yet acknowledged, cut into batches (at
most ``max_batch_points`` points each), sending one batch at a time and keeping it until its
shard has spooled it, streaming artifact files to the shard in chunks (never whole into
memory), attaching to the run in the background when the proxy was unreachable at
``get_tracker`` time, finding the proxy again after it restarted (also when the process's
heartbeat, :mod:`~raydeck.tracking.client.heartbeats`, finds the router forgot it).
Does not own: validation or the MLflow-like API (:mod:`raydeck.tracking.client.tracker`).

The bounded buffer and its back-pressure are
:class:`~raydeck.tracking.client.send_buffer.SendBuffer`'s, which :class:`Delivery` extends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray

from raydeck.config.settings import Settings
from raydeck.errors import ConfigError, TrackingSpoolFullError, TrackingUnavailableError
from raydeck.tracking.client.heartbeats import PROCESS_HEARTBEAT
from raydeck.tracking.client.send_buffer import SendBuffer
from raydeck.tracking.messages import (
    AttachRequest,
    Batch,
    FileRef,
    Pending,
    RunBinding,
)
from raydeck.tracking.proxy.actors import attach_to_router, get_router, get_shard

logger = logging.getLogger(__name__)

DELIVERY_TIMEOUT_S = 30.0
ROUTER_CALL_TIMEOUT_S = 60.0
UPLOAD_CHUNK_BYTES = 4 * 1024 * 1024
# An idle flusher (nothing buffered) sleeps until data arrives, looking at console output and
# system metrics this often meanwhile: a process's thousands of idle rounds a second cost the
# machine's CPU at scale (1,024 ranks on one machine, docs/scale.md).
IDLE_POLL_S = 1.0


class Delivery(SendBuffer):
    """Buffers what one tracker logged and delivers it to the run's shard, in order.

    Thread-safe. ``collect`` runs in the flusher thread before each round (the tracker adds
    system metrics and console output there).
    """

    def __init__(self, settings: Settings, request: AttachRequest, binding: RunBinding | None,
                 collect: Callable[[], None], on_bound: Callable[[RunBinding], None]) -> None:
        super().__init__(settings.tracking)
        tracking = settings.tracking
        self._settings = settings
        self._request = request
        self._binding = binding
        self._collect = collect
        self._on_bound = on_bound
        self._flush_interval_s = tracking.flush_interval_s
        self._retry_max_s = tracking.retry_max_s
        self.heartbeat_interval_s = tracking.heartbeat_interval_s
        self._send_lock = threading.Lock()
        self._unacked: tuple[Batch, list[Path]] | None = None
        self._seq = 0
        self._warned_unavailable = False
        self._last_failure = ""  # why the latest delivery attempt failed; "" after a success
        self._staging = Path(tempfile.gettempdir()) / f"raydeck-staging-{os.getpid()}" / (
            request.client_id)
        self._router: Any = None
        self._shard: Any = None
        self._rank_of: tuple[int, int] | None = None
        self._closed = threading.Event()
        # Set once this tracker leaves its run (detach): from then on only the detach itself
        # attaches again. A heartbeat answered "unknown" because it crossed the detach, or a
        # late send, must not re-attach a tracker that left: that reopens the run it ended, and
        # nobody ends it again. ``_attach_lock`` orders a reconnect under way before the detach.
        self._leaving = False
        self._attach_lock = threading.Lock()
        if binding is not None:
            self._bind(binding)
        self._thread = threading.Thread(target=self._flush_forever, daemon=True,
                                        name=f"raydeck-tracker-{request.client_id[:8]}")
        self._thread.start()
        # A guest is no participant of its run: nothing to keep alive, nothing to leave.
        if not request.guest:
            PROCESS_HEARTBEAT.join(self)

    # --- binding ------------------------------------------------------------------------------
    @property
    def binding(self) -> RunBinding | None:
        return self._binding

    @property
    def client_id(self) -> str:
        """This tracker's id at the proxy: its batches' sender, one attempt of its run."""
        return self._request.client_id

    def learned_run_id(self, run_id: str) -> None:
        """Remember MLflow's id of the run once the shard created it."""
        if self._binding is not None and not self._binding.run_id:
            self._binding = replace(self._binding, run_id=run_id)

    def _bind(self, binding: RunBinding) -> None:
        process = self._request.process
        self._binding = binding
        self._request = replace(self._request, run_key=binding.params_run_key)
        if self._router is None:
            self._router = get_router(self._settings)
        self._shard = get_shard(self._settings.ray_namespace, binding.shard_index)
        self._rank_of = (
            (process.world_rank, process.world_size)
            if binding.mode == "all_ranks" and self._settings.tracking.cross_rank_stats
            and process.world_rank is not None and process.world_size
            else None
        )

    def attach(self, timeout_s: float) -> RunBinding | None:
        """Ask the router for this tracker's run; None if it did not answer in time.

        Raises:
            ConfigError: the router refused the request (a bad key, another MLflow).
        """
        try:
            binding, self._router = attach_to_router(self._settings, self._request, timeout_s)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, Exception) else exc
            if isinstance(cause, ConfigError):
                raise ConfigError(str(cause)) from None
            logger.warning("tracking proxy failed to attach (%s); retrying in the background",
                           cause)
            return None
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError,
                TrackingUnavailableError) as exc:
            logger.warning("tracking proxy did not answer (%s: %s); this process logs into its "
                           "buffer and attaches in the background", type(exc).__name__, exc)
            return None
        first = self._binding is None
        self._bind(binding)
        if first:
            self._on_bound(binding)
        return binding

    def shard(self) -> Any:
        if self._shard is None:
            raise TrackingUnavailableError(
                "this tracker is not attached to its run yet (the tracking proxy did not "
                "answer); its data is buffered")
        return self._shard

    def add_file(self, source: Path, artifact_dir: str, name: str) -> None:
        """Copy ``source`` to a staging file now (the caller may change it after we return)."""
        upload_id = uuid.uuid4().hex
        folder = self._staging / upload_id
        folder.mkdir(parents=True, exist_ok=True)
        staged = folder / "data"
        shutil.copyfile(source, staged)
        ref = FileRef(upload_id, artifact_dir, name, staged.stat().st_size)
        self._add_staged(ref, staged)

    def buffered(self) -> Pending:
        with self._lock:
            buffer = self._buffer
            points = len(buffer.points)
            params, tags, files = len(buffer.params), len(buffer.tags), len(buffer.files)
            if self._unacked is not None:
                batch = self._unacked[0]
                points += len(batch.points)
                params += len(batch.params)
                tags += len(batch.tags)
                files += len(batch.files)
        return Pending(points=points, params=params, tags=tags, files=files)

    # --- sending --------------------------------------------------------------------------------
    def flush(self, deadline: float) -> None:
        """Send everything buffered; returns once the shard spooled it.

        Raises:
            TrackingUnavailableError: the proxy did not take it before ``deadline`` (the data
                stays buffered, and the flusher keeps trying).
        """
        if self._binding is None and self.attach(max(1.0, deadline - time.monotonic())) is None:
            raise TrackingUnavailableError(
                f"tracking proxy unreachable; {self.buffered().describe()} still buffered in "
                "this process")
        self._deliver_all(deadline)

    def _take_batch(self) -> tuple[Batch, list[Path]] | None:
        """The next batch (``_seq`` its number), or None when nothing is buffered. Caller
        holds ``_send_lock``."""
        assert self._binding is not None
        cut = self._cut()
        if cut is None:
            return None
        binding = self._binding
        batch = Batch(
            client_id=self._request.client_id, seq=self._seq, run_key=binding.run_key,
            params_run_key=binding.params_run_key, points=cut.points, params=cut.params,
            tags=cut.tags, files=[ref for ref, _ in cut.files], inputs=cut.inputs,
            logs=cut.logs, rank_of=self._rank_of,
        )
        self._seq += 1
        return batch, [path for _, path in cut.files]

    def _deliver_all(self, deadline: float, drain: bool = True) -> None:
        """Send until the buffer is empty (``drain``), or only what it held when this started
        (the flusher: points logged meanwhile wait for its next round, so a busy loop's points
        go in one batch per round, not in many small ones that each cost a Ray call here and a
        request to MLflow); retry with backoff until ``deadline``.

        One sender at a time: a caller waits for the flusher thread's retries only until its
        own ``deadline`` (the flusher's is ``DELIVERY_TIMEOUT_S`` away), then fails with the
        flusher's latest reason, as if it had tried itself.
        """
        if not self._send_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TrackingUnavailableError(
                f"tracking proxy did not take the data of run {self._request.run_key} "
                f"({self._last_failure or 'another delivery still running'}); "
                f"{self.buffered().describe()} still buffered in this process")
        delay = 0.1
        with self._lock:
            owed = len(self._buffer.points)
        try:
            while True:
                try:
                    if self._unacked is None:
                        self._unacked = self._take_batch()
                        if self._unacked is None:
                            return
                    batch, staged = self._unacked
                    self._send(batch, staged, deadline)
                    self._unacked = None
                    owed -= len(batch.points)
                    for path in staged:
                        shutil.rmtree(path.parent, ignore_errors=True)
                    delay = 0.1
                    self._warned_unavailable = False
                    self._last_failure = ""
                    if not drain and owed <= 0:
                        return
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
                        ray.exceptions.RaySystemError, ray.exceptions.RayTaskError) as exc:
                    reason = _reason(exc)
                    self._last_failure = reason
                    if time.monotonic() >= deadline or self._closed.is_set():
                        raise TrackingUnavailableError(
                            f"tracking proxy did not take the data of run "
                            f"{self._request.run_key} ({reason}); "
                            f"{self.buffered().describe()} still buffered in this process"
                        ) from None
                    if not self._warned_unavailable:
                        self._warned_unavailable = True
                        logger.warning("tracking proxy not taking data (%s); retrying", reason)
                    time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                    delay = min(self._retry_max_s, delay * 2)
                    self.reconnect()
        finally:
            self._send_lock.release()

    def _send(self, batch: Batch, staged: list[Path], deadline: float) -> None:
        shard = self.shard()
        missing = {ref.upload_id for ref in batch.files}
        while True:
            for ref, path in zip(batch.files, staged, strict=True):
                if ref.upload_id in missing:
                    self._upload(shard, ref, path, deadline)
            left = max(0.1, min(DELIVERY_TIMEOUT_S, deadline - time.monotonic()))
            result = ray.get(shard.ingest.remote(batch), timeout=left)
            if result.accepted:
                return
            missing = set(result.missing_uploads)

    @staticmethod
    def _upload(shard: Any, ref: FileRef, path: Path, deadline: float) -> None:
        """Stream one staged file to the shard in chunks; resumes where the shard stands."""
        offset = 0
        with path.open("rb") as fh:
            while True:
                fh.seek(offset)
                data = fh.read(UPLOAD_CHUNK_BYTES)
                left = max(0.1, min(DELIVERY_TIMEOUT_S, deadline - time.monotonic()))
                held = ray.get(shard.put_chunk.remote(ref.upload_id, offset, data), timeout=left)
                if held >= ref.size:
                    return
                offset = held

    def reconnect(self, leaving: bool = False) -> None:
        """Find the proxy again (Ray restarts it; if it was stopped, this recreates it).

        Does nothing once this tracker left its run, unless ``leaving`` (the detach's own).
        """
        with self._attach_lock:
            if self._closed.is_set() or (self._leaving and not leaving):
                return
            try:
                binding, self._router = attach_to_router(self._settings, self._request,
                                                         ROUTER_CALL_TIMEOUT_S)
                first = self._binding is None
                self._bind(binding)
                if first:
                    self._on_bound(binding)
            except Exception as exc:
                logger.debug("reconnect failed: %s", exc)

    # --- background threads ---------------------------------------------------------------------
    def _flush_forever(self) -> None:
        """One round per flush interval, counted from the last round's start: a point waits at
        most one interval (or one send, if a send takes longer) before it is on its way.

        With nothing buffered after a round, the flusher sleeps until data arrives (then waits
        one interval, so the values a step logs in several calls go together) or
        ``IDLE_POLL_S`` passes (console output and system metrics are collected then).
        """
        started = time.monotonic()
        while not self._closed.is_set():
            if self._idle:
                if self._wake.wait(IDLE_POLL_S) and not self._closed.is_set():
                    self._wake.clear()
                    started = time.monotonic()
                    self._wake.wait(self._flush_interval_s)
                with self._lock:
                    self._idle = False
            else:
                self._wake.wait(max(0.0, started + self._flush_interval_s - time.monotonic()))
            self._wake.clear()
            started = time.monotonic()
            if self._closed.is_set():
                return
            if not ray.is_initialized():
                continue  # Ray was shut down here: a call would start a new one (auto-init)
            if self._binding is None and self.attach(ROUTER_CALL_TIMEOUT_S) is None:
                self._closed.wait(self._retry_max_s)
                continue
            try:
                self._collect()
                self._deliver_all(time.monotonic() + DELIVERY_TIMEOUT_S, drain=False)
            except TrackingUnavailableError:
                pass  # kept buffered; warned once by _deliver_all
            except Exception:
                logger.exception("tracking flusher failed; retrying")
            with self._lock:
                self._idle = self._unacked is None and self._buffer.empty()

    def heartbeat_router(self) -> Any | None:
        """The router the process's heartbeat tells that this tracker lives (heartbeats.py);
        None while unbound or leaving."""
        if self._router is None or self._binding is None or self._leaving or (
                self._closed.is_set()):
            return None
        return self._router

    def detach(self, status: str, deadline: float) -> list[str]:
        """Leave the run; returns the keys of runs this ended. Retries until ``deadline``
        (the router presumes this process gone otherwise). A guest has nothing to leave."""
        if self._request.guest:
            return []
        with self._attach_lock:
            self._leaving = True
        try:
            return self._detach(status, deadline)
        except TrackingUnavailableError:
            self._leaving = False  # still in the run: heartbeats go on until a finish() works
            raise

    def _detach(self, status: str, deadline: float) -> list[str]:
        while True:
            try:
                ended: list[str] | None = ray.get(
                    self._router.detach.remote(self._request.client_id, status),
                    timeout=max(0.1, deadline - time.monotonic()))
                if ended is not None:
                    return ended
                # A restarted router that has not heard from this process yet: attach again
                # (as the heartbeat would), so that this detach can end the run.
                if time.monotonic() >= deadline or self._closed.is_set():
                    raise TrackingUnavailableError(
                        f"tracking router lost this process's part in run "
                        f"{self._request.run_key} and it could not attach again")
                time.sleep(0.2)
                self.reconnect(leaving=True)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                if time.monotonic() >= deadline or self._closed.is_set():
                    raise TrackingUnavailableError(
                        f"tracking router did not take the end of this process's part in run "
                        f"{self._request.run_key} ({type(exc).__name__})") from None
                time.sleep(0.2)
                self.reconnect(leaving=True)

    def stop(self) -> None:
        """Make the background threads, and any send or detach retrying, stop calling Ray at
        their next check; returns at once. For a process that exits with data not handed over:
        Ray's own exit hook shuts Ray down next, and a Ray call after that would start a new
        local Ray inside the dying process."""
        self._closed.set()
        self._wake.set()
        PROCESS_HEARTBEAT.leave(self)

    def close(self) -> None:
        self.stop()
        current = threading.current_thread()
        if self._thread is not current:
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            shutil.rmtree(self._staging, ignore_errors=True)
            # The process's staging folder too, once its last tracker closed (another tracker of
            # this process still staging keeps it: rmdir refuses a folder that is not empty).
            self._staging.parent.rmdir()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause,
                                                                   TrackingSpoolFullError):
        return str(exc.cause)
    return type(exc).__name__
