"""The worker-side tracker: what training code calls to log.

A log call validates its values (bad ones raise at the call site, good ones are kept), appends
them to a local buffer and returns in about a microsecond. A background flusher sends the buffer
to the run's shard every ``RAYDECK_TRACKING_FLUSH_INTERVAL_S`` or once it holds
``RAYDECK_TRACKING_MAX_BATCH_POINTS`` points, one batch in flight at a time, keeping the batch
until the shard acknowledges it (spooled), so a shard restart delays data but never drops it.
Errors of the flusher are kept and raised by the next :meth:`Tracker.flush` or
:meth:`Tracker.finish`.

``get_tracker()`` finds the run without help: an explicit ``run_id``, ``RAYDECK_RUN_ID``, the Ray
Train run the process belongs to, or a new run. A process whose mode makes it silent (ranks > 0 in
``rank_zero``) or with tracking disabled gets a :class:`NoOpTracker` with the same methods.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import ray

from raydeck.cluster import connect
from raydeck.config import Settings, load_settings
from raydeck.errors import (
    ConfigError,
    TrackingUnavailableError,
    TrackingValidationError,
    TrackingWriteError,
)
from raydeck.tracking import validation
from raydeck.tracking.context import detect_process
from raydeck.tracking.messages import (
    AttachRequest,
    Batch,
    LandedReport,
    Pending,
    Point,
    ProcessInfo,
    RunBinding,
)
from raydeck.tracking.modes import ModePolicy, check_mode
from raydeck.tracking.proxy import get_router, get_shard
from raydeck.tracking.repro import reproducibility_tags, runtime_env_json
from raydeck.tracking.system_metrics import SystemSampler

logger = logging.getLogger(__name__)

DELIVERY_TIMEOUT_S = 30.0
ROUTER_CALL_TIMEOUT_S = 60.0
HEARTBEAT_INTERVAL_S = 5.0
RETRY_BACKOFF_MAX_S = 5.0
CONSOLE_CHUNK_MAX_BYTES = 1024 * 1024

_active: dict[str, Tracker] = {}
_active_lock = threading.Lock()
_exit_hook_installed = False
_uncaught_exception = False


class Tracker:
    """Logs to one MLflow run through the tracking proxy. Get one with :func:`get_tracker`.

    Attributes give the run and this process's place in it: ``run_id`` (where this tracker's
    metrics go), ``parent_run_id`` (the run itself in ``per_rank`` mode, else ``run_id``),
    ``run_key``, ``run_name``, ``experiment_id``, ``mode``, ``rank``, ``local_rank``,
    ``node_rank``, ``world_size``, ``is_primary``, ``resumed`` (attached to an existing run).
    """

    def __init__(
        self,
        settings: Settings,
        binding: RunBinding,
        process: ProcessInfo,
        client_id: str,
        request: AttachRequest,
    ) -> None:
        self._settings = settings
        self._binding = binding
        self._process = process
        self._client_id = client_id
        self._request = request
        self._policy = ModePolicy(binding.mode, process)
        self._writes_params = self._policy.writes_params(binding.is_primary)
        self._keep_nonfinite = settings.tracking.nonfinite == "keep"
        self._max_points = settings.tracking.max_batch_points
        self._flush_interval_s = settings.tracking.flush_interval_s
        self._keys: dict[str, str] = {}
        # Per final key: values at steps up to this one are already in the run (see
        # skip_logged_steps); empty unless this process resumed from an older checkpoint.
        self._logged_through: dict[str, int] = {}
        self._steps: dict[str, int] = {}
        self._logged_params: dict[str, str] = dict(binding.existing_params)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._points: list[Point] = []
        self._params: dict[str, str] = {}
        self._tags: dict[str, str] = {}
        self._files: list[tuple[str, bytes]] = []
        self._logs: list[tuple[str, str]] = []
        self._seq = 0
        self._unacked: Batch | None = None
        self._error: BaseException | None = None
        self._finished = False
        self._report: LandedReport | None = None
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._shard = get_shard(settings.ray_namespace, binding.shard_index)
        self._router = get_router(settings)
        self._heartbeat_ref: Any = None
        self._console = _ConsoleCapture() if settings.tracking.capture_logs else None
        self._sampler: SystemSampler | None = None
        interval = settings.tracking.system_metrics_interval_s
        if binding.sample_system and interval > 0:
            self._sampler = SystemSampler(process.node_ip)
        self._mean_of = (
            (process.world_rank, process.world_size)
            if binding.mode == "all_ranks" and settings.tracking.cross_rank_mean
            and process.world_rank is not None and process.world_size
            else None
        )
        self._thread = threading.Thread(
            target=self._flush_forever, name=f"raydeck-tracker-{binding.run_key}", daemon=True
        )
        self._thread.start()
        self._heartbeat_thread = threading.Thread(
            target=self._heartbeat_forever, name=f"raydeck-heartbeat-{binding.run_key}",
            daemon=True,
        )
        self._heartbeat_thread.start()

    # --- identity ----------------------------------------------------------------------------
    @property
    def run_id(self) -> str:
        return self._binding.run_id

    @property
    def parent_run_id(self) -> str:
        return self._binding.params_run_id

    @property
    def run_key(self) -> str:
        return self._binding.run_key

    @property
    def run_name(self) -> str:
        return self._binding.run_name

    @property
    def experiment_id(self) -> str:
        return self._binding.experiment_id

    @property
    def mode(self) -> str:
        return self._binding.mode

    @property
    def is_primary(self) -> bool:
        return self._binding.is_primary

    @property
    def resumed(self) -> bool:
        return self._binding.resumed

    @property
    def rank(self) -> int | None:
        return self._process.world_rank

    @property
    def local_rank(self) -> int | None:
        return self._process.local_rank

    @property
    def node_rank(self) -> int | None:
        return self._process.node_rank

    @property
    def world_size(self) -> int | None:
        return self._process.world_size

    @property
    def active(self) -> bool:
        """False for a :class:`NoOpTracker`."""
        return True

    # --- logging (caller's thread; must stay cheap) ----------------------------------------------
    def log_metric(self, key: str, value: float, step: int | None = None) -> None:
        """Log one metric value. See :meth:`log_metrics`."""
        self.log_metrics({key: value}, step)

    def log_metrics(
        self, metrics: dict[str, Any], step: int | None = None, timestamp_ms: int | None = None
    ) -> None:
        """Log metric values at ``step``; returns at once, values are sent in the background.

        ``step=None`` means "the next step for each key" (0, 1, 2, ... per key in this
        process), so curves never collapse onto one step. ``timestamp_ms`` defaults to now;
        re-logging a point with its original timestamp is idempotent (MLflow keeps one copy).

        Raises:
            TrackingValidationError: some keys or values broke a rule; every other value of the
                call was kept. The message names each rejected key and its rule.
        """
        if step is not None:
            problem = validation.step_problem(step)
            if problem:
                raise TrackingValidationError(dict.fromkeys(map(str, metrics), problem))
            step = int(step)
        timestamp = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
        keys = self._keys
        steps = self._steps
        logged_through = self._logged_through
        out: list[Point] = []
        problems: dict[str, str] | None = None
        for key, value in metrics.items():
            final = keys.get(key)
            if final is None:
                problem = validation.key_problem(key)
                if problem:
                    problems = problems or {}
                    problems[str(key)] = problem
                    continue
                final = keys[key] = self._policy.metric_key(key)
            if type(value) is float and value - value == 0.0:
                number = value
            else:
                number, problem = validation.metric_value(value, self._keep_nonfinite)
                if problem:
                    problems = problems or {}
                    problems[key] = problem
                    continue
            if step is None:
                point_step = steps.get(final, 0)
                steps[final] = point_step + 1
            else:
                point_step = step
                if steps.get(final, 0) <= step:
                    steps[final] = step + 1
            if logged_through and point_step <= logged_through.get(final, -1):
                continue
            out.append((final, number, timestamp, point_step))
        with self._lock:
            self._points.extend(out)
            full = len(self._points) >= self._max_points
        if full:
            self._wake.set()
        if problems:
            raise TrackingValidationError(problems)

    def log_params(self, params: dict[str, Any]) -> None:
        """Log params once per run. Non-primary ranks' calls are no-ops (the primary writes).

        Raises:
            TrackingValidationError: a key is illegal, a value too long, or a param was already
                logged with a different value (MLflow params are immutable); others were kept.
        """
        problems: dict[str, str] = {}
        accepted: dict[str, str] = {}
        for key, value in params.items():
            problem = validation.key_problem(key)
            text = ""
            if not problem:
                text, problem = validation.param_value(value)
            if not problem and key in self._logged_params and self._logged_params[key] != text:
                problem = (
                    f"already logged as {self._logged_params[key]!r}, cannot change to {text!r} "
                    "(MLflow params are immutable; log a new key or use a tag)"
                )
            if problem:
                problems[str(key)] = problem
            else:
                accepted[key] = text
        if self._writes_params:
            new = {k: v for k, v in accepted.items() if k not in self._logged_params}
            self._logged_params.update(accepted)
            with self._lock:
                self._params.update(new)
        if problems:
            raise TrackingValidationError(problems)

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Set tags on this tracker's run (last value wins).

        Raises:
            TrackingValidationError: a key is illegal or a value is not a scalar; others kept.
        """
        problems: dict[str, str] = {}
        accepted: dict[str, str] = {}
        for key, value in tags.items():
            problem = validation.key_problem(key)
            text = ""
            if not problem:
                text, problem = validation.tag_value(value)
            if problem:
                problems[str(key)] = problem
            else:
                accepted[key] = text
        with self._lock:
            self._tags.update(accepted)
        if problems:
            raise TrackingValidationError(problems)

    def log_artifact(self, local_path: str | os.PathLike[str], artifact_path: str | None = None
                     ) -> None:
        """Log a file, or a directory with its contents, as MLflow's ``log_artifact`` does.

        The bytes are read now, so the file may change or vanish after the call returns; they
        reach MLflow through the shard's spool, so an unreachable artifact store delays the
        upload instead of failing it.

        Raises:
            TrackingValidationError: the path does not exist or ``artifact_path`` is illegal.
        """
        path = Path(local_path)
        problem = validation.artifact_path_problem(artifact_path)
        if problem is None and not path.exists():
            problem = f"no such file or directory: {path}"
        if problem:
            raise TrackingValidationError({str(local_path): problem})
        base = artifact_path.strip("/") + "/" if artifact_path else ""
        files: list[tuple[str, bytes]] = []
        if path.is_dir():
            for file in sorted(p for p in path.rglob("*") if p.is_file()):
                files.append((f"{base}{path.name}/{file.relative_to(path).as_posix()}",
                              file.read_bytes()))
        else:
            files.append((f"{base}{path.name}", path.read_bytes()))
        with self._lock:
            self._files.extend(files)
        self._wake.set()

    def log_dict(self, dictionary: dict[str, Any], artifact_file: str) -> None:
        """Log a dict as a JSON (or YAML, by extension) artifact file."""
        if artifact_file.endswith((".yaml", ".yml")):
            import yaml

            text = yaml.safe_dump(dictionary, sort_keys=False)
        else:
            text = json.dumps(dictionary, indent=2, default=str)
        self.log_text(text, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        """Log a string as an artifact file at ``artifact_file`` (e.g. ``notes/run.md``)."""
        problem = validation.artifact_path_problem(artifact_file)
        if problem:
            raise TrackingValidationError({artifact_file: problem})
        with self._lock:
            self._files.append((artifact_file, text.encode("utf-8")))
        self._wake.set()

    def run_config(self, **kwargs: Any) -> Any:
        """A ``ray.train.RunConfig`` whose name binds Ray Train workers to this run.

        Workers of a TorchTrainer using it call :func:`get_tracker` with no arguments and land
        in this run, also when several runs share one Ray job (Tune trials).
        """
        from ray.train import RunConfig

        return RunConfig(name=self.run_key, **kwargs)

    def latest(self, timeout_s: float = 5.0) -> dict[str, tuple[float, int]]:
        """The newest value and step the proxy received per metric key of this run."""
        return dict(ray.get(self._shard.latest.remote(self.run_id), timeout=timeout_s))

    def last_steps(self, keys: Iterable[str], timeout_s: float = 60.0) -> dict[str, int]:
        """The highest step of each metric key this run holds, in MLflow or on its way (-1: none).

        Waits up to ``timeout_s`` for the proxy to write what it holds of this run first; if
        MLflow stays down that long, answers from what the proxy has received.
        """
        self.flush(timeout_s)
        finals = {self._policy.metric_key(key): key for key in keys}
        highest = ray.get(self._shard.last_steps.remote(self.run_id, sorted(finals), timeout_s),
                          timeout=timeout_s + 30)
        return {finals[final]: int(step) for final, step in highest.items()}

    def skip_logged_steps(self, keys: Iterable[str], timeout_s: float = 60.0) -> None:
        """From now on, drop values of ``keys`` at steps this run already holds.

        For a job restarted from a checkpoint older than what it had logged: a worker can die
        after logging an epoch but before Ray Train registered that epoch's checkpoint, and the
        restarted job trains the epoch again. The run keeps the first values; the repeats are
        dropped here, on the caller's side.
        """
        self._logged_through = {
            self._policy.metric_key(key): step
            for key, step in self.last_steps(keys, timeout_s).items() if step >= 0
        }

    # --- delivery (flusher thread, flush(), finish()) ----------------------------------------
    def flush(self, timeout_s: float | None = None) -> None:
        """Send everything logged so far and wait until the shard has spooled it.

        Raises:
            TrackingUnavailableError: the proxy could not be reached within ``timeout_s``
                (default ``RAYDECK_TRACKING_FINISH_TIMEOUT_S``); the data stays buffered.
        """
        self._raise_kept_error()
        timeout_s = timeout_s or self._settings.tracking.finish_timeout_s
        self._deliver_all(time.monotonic() + timeout_s)

    def _take_batch(self) -> Batch | None:
        with self._lock:
            if not (self._points or self._params or self._tags or self._files or self._logs):
                return None
            batch = Batch(
                client_id=self._client_id, seq=self._seq, run_id=self.run_id,
                params_run_id=self.parent_run_id, points=self._points, params=self._params,
                tags=self._tags, files=self._files, logs=self._logs, mean_of=self._mean_of,
            )
            self._points, self._params, self._tags, self._files, self._logs = [], {}, {}, [], []
            self._seq += 1
            return batch

    def _deliver_all(self, deadline: float) -> None:
        """Send until the buffer is empty; retry with backoff until ``deadline``."""
        delay = 0.1
        with self._send_lock:
            while True:
                try:
                    if self._unacked is None:
                        self._unacked = self._take_batch()
                        if self._unacked is None:
                            return
                    left = max(0.1, min(DELIVERY_TIMEOUT_S, deadline - time.monotonic()))
                    ray.get(self._shard.ingest.remote(self._unacked), timeout=left)
                    self._unacked = None
                    delay = 0.1
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
                        ray.exceptions.RaySystemError) as exc:
                    if time.monotonic() >= deadline:
                        raise TrackingUnavailableError(
                            f"tracking proxy unreachable for run {self.run_id}: "
                            f"{type(exc).__name__}; {self._buffered().describe()} still buffered "
                            "in this process"
                        ) from None
                    logger.debug("delivery failed (%s); reconnecting", type(exc).__name__)
                    time.sleep(delay)
                    delay = min(RETRY_BACKOFF_MAX_S, delay * 2)
                    self._reconnect()

    def _buffered(self) -> Pending:
        with self._lock:
            batches = [self._unacked] if self._unacked else []
            points = len(self._points) + sum(len(b.points) for b in batches)
            params = len(self._params) + sum(len(b.params) for b in batches)
            tags = len(self._tags) + sum(len(b.tags) for b in batches)
            files = len(self._files) + sum(len(b.files) for b in batches)
        return Pending(points=points, params=params, tags=tags, files=files)

    def _reconnect(self) -> None:
        """Find the proxy again (Ray restarts it; if it was stopped, this recreates it)."""
        try:
            self._router = get_router(self._settings)
            binding = ray.get(self._router.attach.remote(self._request),
                              timeout=ROUTER_CALL_TIMEOUT_S)
            self._shard = get_shard(self._settings.ray_namespace, binding.shard_index)
        except Exception as exc:
            logger.debug("reconnect failed: %s", exc)

    def _heartbeat_forever(self) -> None:
        """Tell the router this process lives. A thread of its own, so a slow delivery (a busy
        shard, an overloaded node) never makes a live process look dead."""
        while not self._closed.wait(HEARTBEAT_INTERVAL_S):
            try:
                self._heartbeat()
            except Exception as exc:
                logger.debug("heartbeat failed: %s", exc)

    def _flush_forever(self) -> None:
        next_sample = time.monotonic()
        interval = self._settings.tracking.system_metrics_interval_s
        sample_step = 0
        while not self._closed.is_set():
            self._wake.wait(self._flush_interval_s)
            self._wake.clear()
            if self._closed.is_set():
                return
            now = time.monotonic()
            if self._sampler is not None and now >= next_sample:
                self._append_system(sample_step)
                sample_step += 1
                next_sample = now + interval
            self._capture_console()
            try:
                self._deliver_all(time.monotonic() + DELIVERY_TIMEOUT_S)
            except TrackingUnavailableError as exc:
                # The batch stays buffered and is retried next round; flush() and finish()
                # retry too and raise only if the proxy is still unreachable then.
                logger.warning("%s; retrying", exc)
            except Exception as exc:
                self._error = exc

    def _append_system(self, step: int) -> None:
        assert self._sampler is not None
        timestamp = int(time.time() * 1000)
        points = [(k, v, timestamp, step) for k, v in self._sampler.sample().items()]
        with self._lock:
            self._points.extend(points)

    def _capture_console(self) -> None:
        if self._console is None:
            return
        text = self._console.read_new()
        if text:
            with self._lock:
                self._logs.append((self._policy.log_name, text))

    def _heartbeat(self) -> None:
        previous = self._heartbeat_ref
        if previous is not None:
            ready, _ = ray.wait([previous], timeout=0)
            if ready:
                try:
                    if ray.get(ready[0]):
                        logger.info("router did not know this tracker (restarted?); re-attaching")
                        self._reconnect()
                except ray.exceptions.RayError:
                    self._reconnect()
        self._heartbeat_ref = self._router.heartbeat.remote([self._client_id])

    def _raise_kept_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # --- end ---------------------------------------------------------------------------------
    def finish(self, status: str = "FINISHED", timeout_s: float | None = None,
               wait: bool = True) -> LandedReport:
        """Send everything, wait until it is in MLflow, and leave the run.

        Only the primary's finish ends the run (once every other process left); other ranks just
        leave. Waits at most ``timeout_s`` (default ``RAYDECK_TRACKING_FINISH_TIMEOUT_S``); data
        still pending then stays in the shard's spool and lands when MLflow is back: the returned
        report, and a warning, say exactly what is pending. With ``wait=False`` it returns once
        the proxy holds everything (spooled, durable) without waiting for MLflow; the report
        then says ``landed=False`` with nothing counted (a Tune trial being stopped uses this,
        because Tune reuses its process only if it exits within seconds).

        Raises:
            TrackingUnavailableError: the proxy could not be reached to take the last data.
            TrackingWriteError: MLflow permanently refused some values (the rest landed).
        """
        if self._finished:
            return self._report or LandedReport(True, Pending())
        self._finished = True
        timeout_s = timeout_s or self._settings.tracking.finish_timeout_s
        deadline = time.monotonic() + timeout_s
        _forget(self)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        self._capture_console()
        try:
            self._deliver_all(deadline)
            left = max(1.0, deadline - time.monotonic())
            report = LandedReport(False, Pending())
            if wait:
                report = ray.get(
                    self._shard.wait_landed.remote(sorted({self.run_id, self.parent_run_id}),
                                                   left),
                    timeout=left + 10,
                )
            ray.get(self._router.detach.remote(self._client_id, status),
                    timeout=ROUTER_CALL_TIMEOUT_S)
        finally:
            self._closed.set()
            self._wake.set()
            self._thread.join(timeout=5)
            self._heartbeat_thread.join(timeout=5)
        self._report = report
        if wait and not report.landed:
            logger.warning(
                "run %s: finish() timed out after %.0f s with %s pending in the tracking proxy; "
                "it is spooled and will be written when MLflow is reachable",
                self.run_id, timeout_s, report.pending.describe(),
            )
        self._raise_kept_error()
        if report.rejected:
            raise TrackingWriteError(
                f"MLflow refused {len(report.rejected)} value(s) of run {self.run_id} (all "
                f"others landed): {'; '.join(report.rejected[:10])}"
            )
        return report

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        status = "FAILED" if exc_type is not None else "FINISHED"
        if exc_type is None:
            self.finish(status)
            return
        try:
            self.finish(status)
        except Exception:
            logger.exception("finishing run %s after an error failed", self.run_id)

    def __repr__(self) -> str:
        return (f"Tracker(run_id={self.run_id!r}, key={self.run_key!r}, mode={self.mode!r}, "
                f"rank={self.rank}, primary={self.is_primary})")


class NoOpTracker(Tracker):
    """A tracker whose calls do nothing: tracking disabled, or a rank that must stay silent.

    Jobs never branch on rank or mode: they call the same methods on whatever
    :func:`get_tracker` returns.
    """

    def __init__(self, binding: RunBinding | None = None, process: ProcessInfo | None = None
                 ) -> None:
        self._binding = binding or RunBinding(
            run_key="", run_id="", params_run_id="", experiment_id="", run_name="",
            mode="rank_zero", shard_index=0, is_primary=False, created=False, resumed=False,
            sample_system=False, active=False,
        )
        self._process = process or ProcessInfo(
            role="disabled", role_key="disabled", job_id=None, node_ip="", hostname="", pid=0
        )

    @property
    def active(self) -> bool:
        return False

    def log_metric(self, key: str, value: float, step: int | None = None) -> None:
        return None

    def log_metrics(
        self, metrics: dict[str, Any], step: int | None = None, timestamp_ms: int | None = None
    ) -> None:
        return None

    def log_params(self, params: dict[str, Any]) -> None:
        return None

    def set_tags(self, tags: dict[str, Any]) -> None:
        return None

    def log_artifact(self, local_path: str | os.PathLike[str], artifact_path: str | None = None
                     ) -> None:
        return None

    def log_dict(self, dictionary: dict[str, Any], artifact_file: str) -> None:
        return None

    def log_text(self, text: str, artifact_file: str) -> None:
        return None

    def latest(self, timeout_s: float = 5.0) -> dict[str, tuple[float, int]]:
        return {}

    def last_steps(self, keys: Iterable[str], timeout_s: float = 60.0) -> dict[str, int]:
        return dict.fromkeys(keys, -1)

    def skip_logged_steps(self, keys: Iterable[str], timeout_s: float = 60.0) -> None:
        return None

    def flush(self, timeout_s: float | None = None) -> None:
        return None

    def finish(self, status: str = "FINISHED", timeout_s: float | None = None,
               wait: bool = True) -> LandedReport:
        return LandedReport(True, Pending())

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        return None

    def __repr__(self) -> str:
        return f"NoOpTracker(run_key={self.run_key!r}, rank={self.rank})"


class _ConsoleCapture:
    """Reads what this process wrote to stdout/stderr since the tracker started.

    Works where the streams are files, as they are for Ray workers and ``ray job submit``
    drivers (Ray redirects them to its log directory); elsewhere (a terminal) it is inert.
    """

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


def _forget(tracker: Tracker) -> None:
    with _active_lock:
        for key, value in list(_active.items()):
            if value is tracker:
                del _active[key]


def _finish_all_at_exit() -> None:
    """An exiting process ends its runs: FAILED after an uncaught exception, else FINISHED."""
    with _active_lock:
        trackers = list(_active.values())
    for tracker in trackers:
        try:
            tracker.finish("FAILED" if _uncaught_exception else "FINISHED")
        except Exception as exc:
            logger.warning("could not finish run %s at exit: %s", tracker.run_id, exc)


def _install_exit_hook() -> None:
    global _exit_hook_installed
    if _exit_hook_installed:
        return
    _exit_hook_installed = True
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        global _uncaught_exception
        _uncaught_exception = True
        previous(kind, value, tb)

    sys.excepthook = hook
    atexit.register(_finish_all_at_exit)


def get_tracker(
    run_id: str | None = None,
    *,
    run_name: str | None = None,
    experiment: str | None = None,
    mode: str | None = None,
    parent_run_id: str | None = None,
    params: dict[str, Any] | None = None,
    tags: dict[str, Any] | None = None,
    settings: Settings | None = None,
) -> Tracker:
    """The tracker for this process's run, creating or attaching to the run as needed.

    Args:
        run_id: a shared run id (any 1-128 of ``[A-Za-z0-9_.-]``, or an MLflow run id) that
            several processes use to log to one run; default ``RAYDECK_RUN_ID``, else the Ray
            Train run this worker belongs to, else a new run.
        run_name: MLflow run name when this call creates the run (a different name for an
            existing run only warns).
        experiment: MLflow experiment (default ``RAYDECK_TRACKING_EXPERIMENT``).
        mode: ``rank_zero``, ``all_ranks`` or ``per_rank`` (default
            ``RAYDECK_TRACKING_MODE``); the run keeps the mode it was created with.
        parent_run_id: run id of a parent run (sweeps use it for trial runs).
        params, tags: logged right away (params only by the primary/rank 0).
        settings: settings to use instead of the environment's.

    Returns:
        A :class:`Tracker`, or a :class:`NoOpTracker` when tracking is disabled or this rank
        is silent in the run's mode. Calling again in the same process with the same arguments
        returns the same tracker until it is finished.

    Raises:
        ConfigError: a bad argument or setting (named in the message).
        TrackingUnavailableError: Ray, the proxy or MLflow cannot be reached.
    """
    settings = settings or load_settings()
    if not settings.tracking.enabled:
        return NoOpTracker()
    requested_mode = check_mode(mode) if mode else settings.tracking.mode
    key = run_id or settings.run_id or None
    if key is not None and not isinstance(key, str):
        raise ConfigError(f"run_id={key!r}: must be a string")
    connect(settings)
    process = detect_process()
    cache_key = f"{key or process.train_run_name or ''}|{parent_run_id or ''}"
    trial_scope = f"trial:{process.trial_id}" if process.trial_id else None
    with _active_lock:
        existing = _active.get(cache_key)
        if existing is None and key is None and trial_scope:
            # In a Tune trial, get_tracker() with no arguments is the trial's own run.
            existing = _active.get(trial_scope)
    if existing is not None:
        return existing
    client_id = uuid.uuid4().hex
    request = AttachRequest(
        client_id=client_id, process=process, tracking_uri=settings.tracking.uri,
        run_key=key, run_name=run_name, experiment=experiment or settings.tracking.experiment,
        mode=requested_mode, parent_key=parent_run_id,
    )
    binding = _attach(settings, request)
    if not binding.active:
        return NoOpTracker(binding, process)
    if mode and binding.mode != mode:
        logger.warning("run %s was created in mode %s; ignoring mode=%s", binding.run_id,
                       binding.mode, mode)
    if run_name and binding.resumed and binding.run_name != run_name:
        logger.warning("run %s is named %r; ignoring run_name=%r (attached to the existing run)",
                       binding.run_id, binding.run_name, run_name)
    # Re-attaching after a proxy restart must find this run by key, not create another.
    request = AttachRequest(**{**request.__dict__, "run_key": binding.run_key})
    tracker = Tracker(settings, binding, process, client_id, request)
    if binding.created:
        tracker.set_tags(reproducibility_tags())
        tracker.log_text(runtime_env_json(), "raydeck/runtime_env.json")
    if params:
        tracker.log_params(params)
    if tags:
        tracker.set_tags(tags)
    with _active_lock:
        _active[cache_key] = tracker
        if trial_scope:
            _active.setdefault(trial_scope, tracker)
    _install_exit_hook()
    return tracker


def _attach(settings: Settings, request: AttachRequest) -> RunBinding:
    router = get_router(settings)
    try:
        return ray.get(router.attach.remote(request), timeout=ROUTER_CALL_TIMEOUT_S)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if isinstance(exc.cause, Exception) else exc
        if isinstance(cause, (ConfigError, TrackingUnavailableError)):
            raise type(cause)(str(cause)) from None
        raise TrackingUnavailableError(f"tracking proxy failed to attach: {cause}") from None
    except ray.exceptions.GetTimeoutError:
        raise TrackingUnavailableError(
            f"tracking proxy did not answer within {ROUTER_CALL_TIMEOUT_S:.0f} s; is the Ray "
            "cluster overloaded? `raydeck tracking status` shows the proxy"
        ) from None
