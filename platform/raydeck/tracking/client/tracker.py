"""The tracker: what training code calls to log, with MLflow's method names.

A log call validates its values (strict calls raise at the call site naming the key and the fix;
raydeck's own paths repair instead, see :mod:`raydeck.tracking.client.validation`), appends them to
a bounded local buffer and returns in microseconds;
:class:`~raydeck.tracking.client.delivery.Delivery` sends the buffer to the run's shard in the
background. ``flush()`` and ``log_*`` never raise because MLflow, S3 or the proxy is unavailable:
the data waits (in the shard's spool, or in the buffer while the proxy is unreachable) and one
warning says so. Only :meth:`Tracker.finish` reports what did not land.

This module is the facade (identity, params and tags, delivery, ``finish``); the rest of the
class lives beside it, one concept a module: :mod:`~raydeck.tracking.client.step_policy` (metrics
and the step counter), :mod:`~raydeck.tracking.client.artifact_logging` (artifacts and models),
:mod:`~raydeck.tracking.client.resume` (Ray Train, resume and preemption helpers) and
:mod:`~raydeck.tracking.client.noop` (the tracker that logs nothing).

Method names and argument order follow ``mlflow`` (``log_metric(key, value, step, synchronous,
timestamp)``, ``log_param``, ``set_tag``, ``log_artifact(s)``, ``log_dict``, ``log_text``,
``log_figure``, ``log_image``, ``log_table``, ``log_input``, ``log_model``), so code moves over
by renaming the object. ``synchronous=True`` waits until the proxy holds the data (spooled).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from types import TracebackType
from typing import Any

import ray

from raydeck.config.settings import Settings
from raydeck.errors import TrackingUnavailableError, TrackingWriteError
from raydeck.tracking.client import lifecycle, validation
from raydeck.tracking.client.artifact_logging import ArtifactLogging
from raydeck.tracking.client.console import ConsoleCapture
from raydeck.tracking.client.delivery import Delivery
from raydeck.tracking.client.modes import ModePolicy
from raydeck.tracking.client.repro import reproducibility_tags, runtime_env_json
from raydeck.tracking.client.resume import ResumeHelpers
from raydeck.tracking.client.step_policy import StepPolicy
from raydeck.tracking.client.system_metrics import SystemSampler, sampler_for
from raydeck.tracking.messages import (
    AttachRequest,
    LandedReport,
    Pending,
    ProcessInfo,
    RunBinding,
)

logger = logging.getLogger(__name__)

SANITIZED_METRIC = "raydeck/sanitized_values"
DROPPED_METRIC = "raydeck/dropped_values"
RESOLVE_TIMEOUT_S = 60.0
# known_run_id's look-up of a run id the process does not have yet (see there).
RUN_ID_PROBE_INTERVAL_S = 30.0
RUN_ID_PROBE_TIMEOUT_S = 1.0


class Tracker(StepPolicy, ArtifactLogging, ResumeHelpers):
    """Logs to one MLflow run through the tracking proxy. Get one with :func:`get_tracker`.

    Attributes give the run and this process's place in it: ``run_id`` (MLflow's id of the run
    this tracker's metrics go to), ``parent_run_id`` (the run itself in ``per_rank`` mode, else
    ``run_id``), ``run_key`` (raydeck's id, known at once even while MLflow is down),
    ``run_name``, ``experiment_id``, ``mode``, ``rank``, ``local_rank``, ``node_rank``,
    ``world_size``, ``is_primary``, ``resumed`` (attached to an existing run).
    """

    def __init__(self, settings: Settings, process: ProcessInfo, request: AttachRequest,
                 binding: RunBinding | None) -> None:
        self._settings = settings
        self._process = process
        self._request = request
        self._policy = ModePolicy(binding.mode if binding else request.mode, process)
        self._writes_params = process.world_rank in (None, 0)
        self._keep_nonfinite = settings.tracking.nonfinite == "keep"
        self._lock = threading.RLock()
        self._keys: dict[str, str] = {}
        self._next_step = 0
        self._logged_through: dict[str, int] = {}
        self._logged_params: dict[str, str] = dict(binding.existing_params) if binding else {}
        self._warned: set[tuple[str, str]] = set()
        self._sanitized = 0
        self._dropped = 0
        self._counts_sent = (0, 0)
        self._tables: dict[str, Any] = {}
        self._provenance = False
        self._finished = False
        self._report: LandedReport | None = None
        self._console = ConsoleCapture() if settings.tracking.capture_logs else None
        self._sampler: SystemSampler | None = None
        self._sample_interval_s = (0.0 if settings.tracking.system_metrics == "off"
                                   else settings.tracking.system_metrics_interval_s)
        self._next_sample = time.monotonic()
        self._sample_step = 0
        self._run_id_probed_at = -RUN_ID_PROBE_INTERVAL_S
        self._open_delivery = Delivery(settings, request, binding, self._collect, self._on_bound)
        if binding is not None:
            self._on_bound(binding)

    @property
    def _delivery(self) -> Delivery:
        if self._finished:
            self._reopen()
        return self._open_delivery

    def _reopen(self) -> None:
        """Logging after ``finish()``: attach to the same run again (the router reopens it;
        the next ``finish()`` ends it), so nothing logged late is lost."""
        import uuid
        from dataclasses import replace

        with self._lock:
            if not self._finished:
                return
            binding = self._open_delivery.binding
            logger.warning("run %s: logging after finish(); the run is reopened until the next "
                           "finish()", self.run_key)
            self._request = replace(self._request, client_id=uuid.uuid4().hex,
                                    run_key=binding.params_run_key if binding else
                                    self._request.run_key)
            self._open_delivery = Delivery(self._settings, self._request, None, self._collect,
                                           self._on_bound)
            self._report = None
            self._finished = False
        lifecycle.register(self, self._request.run_key, None, None, "")

    def _on_bound(self, binding: RunBinding) -> None:
        self._policy = ModePolicy(binding.mode, self._process)
        with self._lock:
            self._keys.clear()
            for key, value in binding.existing_params.items():
                self._logged_params.setdefault(key, value)
        if self._sample_interval_s > 0 and self._sampler is None:
            self._sampler = sampler_for(self._process, node_view=binding.sample_system)
        if binding.created and not self._provenance:
            # A new run records how it was produced (git commit, command, versions, runtime env).
            self._provenance = True
            self.set_tags(reproducibility_tags())
            self.log_text(runtime_env_json(self._settings), "raydeck/runtime_env.json")

    # --- identity ----------------------------------------------------------------------------
    def _binding(self) -> RunBinding:
        binding = self._open_delivery.binding
        if binding is None:
            self._open_delivery.attach(RESOLVE_TIMEOUT_S)
            binding = self._open_delivery.binding
        if binding is None:
            raise TrackingUnavailableError(
                "this tracker is not attached to its run yet: the tracking proxy does not "
                "answer (its data is buffered and sent once it does)")
        return binding

    @property
    def run_key(self) -> str:
        """raydeck's id of this tracker's run (the ``raydeck.run_key`` tag); never waits."""
        binding = self._open_delivery.binding
        return binding.run_key if binding else str(self._request.run_key or "")

    @property
    def parent_run_key(self) -> str:
        """raydeck's id of the run itself (differs from ``run_key`` for a per-rank child)."""
        binding = self._open_delivery.binding
        return binding.params_run_key if binding else str(self._request.run_key or "")

    @property
    def run_id(self) -> str:
        """MLflow's run id. Known at once when MLflow is up; during an MLflow outage the proxy
        creates the run when MLflow answers, and this waits up to a minute for it.

        Raises:
            TrackingUnavailableError: MLflow has not created the run within that minute.
        """
        binding = self._binding()
        if binding.run_id:
            return binding.run_id
        return self._resolve(binding.run_key).run_id

    @property
    def parent_run_id(self) -> str:
        binding = self._binding()
        if binding.params_run_key == binding.run_key:
            return self.run_id
        return self._resolve(binding.params_run_key).run_id

    @property
    def experiment_id(self) -> str:
        return str(self._resolve(self._binding().params_run_key).experiment_id)

    def _resolve(self, run_key: str) -> Any:
        shard = self._open_delivery.shard()
        found = ray.get(shard.resolve.remote(run_key, RESOLVE_TIMEOUT_S),
                        timeout=RESOLVE_TIMEOUT_S + 10)
        if found is None:
            raise TrackingUnavailableError(
                f"run {run_key!r} is not in MLflow yet (MLflow unreachable?); its data is "
                "spooled and lands when MLflow answers")
        if run_key == self._binding().run_key:
            self._open_delivery.learned_run_id(found.run_id)
        return found

    def known_run_id(self) -> str:
        """MLflow's run id if known, else "" (for labels and logs; never waits on MLflow).

        A process that attached before the shard created the run learns its id here: at most
        once per ``RUN_ID_PROBE_INTERVAL_S`` it asks the shard, without waiting for MLflow and
        for at most ``RUN_ID_PROBE_TIMEOUT_S`` when the shard is slow to answer.
        """
        binding = self._open_delivery.binding
        if binding is None or binding.run_id:
            return binding.run_id if binding else ""
        now = time.monotonic()
        if now - self._run_id_probed_at < RUN_ID_PROBE_INTERVAL_S:
            return ""
        self._run_id_probed_at = now
        try:
            found = ray.get(self._open_delivery.shard().resolve.remote(binding.run_key, 0.0),
                            timeout=RUN_ID_PROBE_TIMEOUT_S)
        except Exception:  # a label may stay empty; training goes on
            return ""
        if found is None:
            return ""
        self._open_delivery.learned_run_id(found.run_id)
        return str(found.run_id)

    @property
    def run_name(self) -> str:
        binding = self._open_delivery.binding
        return binding.run_name if binding else str(self._request.run_name or self.run_key)

    @property
    def mode(self) -> str:
        return self._policy.mode

    @property
    def is_primary(self) -> bool:
        return self._binding().is_primary

    @property
    def resumed(self) -> bool:
        return self._binding().resumed

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

    # --- params and tags ----------------------------------------------------------------------
    def log_param(self, key: str, value: Any, synchronous: bool | None = None) -> Any:
        """Log one param (MLflow returns the value, so does this). See :meth:`log_params`."""
        self.log_params({key: value}, synchronous)
        return value

    def log_params(self, params: dict[str, Any], synchronous: bool | None = None,
                   *, strict: bool = True) -> None:
        """Log params once per run. Ranks other than 0 do nothing (every rank may call it).

        Raises:
            TrackingValidationError: (``strict``) a key is illegal, a value too long, or a param
                was already logged with a different value (MLflow params are immutable); the
                others were kept. With ``strict=False``: keys made legal, long values cut to
                MLflow's limit, changed values kept as first logged; each warned once, counted.
        """
        if not strict:
            params, changes = validation.sanitize_params(params)
            self._corrected("param", changes)
        problems: dict[str, str] = {}
        accepted: dict[str, str] = {}
        with self._lock:
            for key, value in params.items():
                problem = validation.key_problem(key)
                text = ""
                if not problem:
                    text, problem = validation.param_value(value)
                if not problem and key in self._logged_params and (
                        self._logged_params[key] != text):
                    problem = (
                        f"already logged as {self._logged_params[key]!r}, cannot change to "
                        f"{text!r} (MLflow params are immutable; log a new key or use a tag)")
                if problem:
                    problems[str(key)] = problem
                else:
                    accepted[key] = text
            new = {k: v for k, v in accepted.items() if k not in self._logged_params}
            self._logged_params.update(accepted)
        if self._writes_params and new:
            self._delivery.add_params(new)
        if synchronous:
            self.flush()
        self._refused("param", problems, strict)

    def set_tag(self, key: str, value: Any, synchronous: bool | None = None) -> None:
        """Set one tag. See :meth:`set_tags`."""
        self.set_tags({key: value}, synchronous)

    def set_tags(self, tags: dict[str, Any], synchronous: bool | None = None,
                 *, strict: bool = True) -> None:
        """Set tags on this tracker's run (last value wins).

        Raises:
            TrackingValidationError: (``strict``) a key is illegal or a value is not a scalar;
                others kept. With ``strict=False``: keys made legal, other values dropped;
                each warned once and counted.
        """
        problems: dict[str, str] = {}
        accepted: dict[str, str] = {}
        for key, value in tags.items():
            name = key
            if not strict:
                fixed, reason = validation.legal_key(key)
                if reason:
                    self._corrected("tag", [validation.Sanitized(str(key), fixed, reason)])
                if fixed is None:
                    continue
                name = fixed
            problem = validation.key_problem(name)
            text = ""
            if not problem:
                text, problem = validation.tag_value(value)
            if problem:
                problems[str(name)] = problem
            else:
                accepted[name] = text
        self._delivery.add_tags(accepted)
        if synchronous:
            self.flush()
        self._refused("tag", problems, strict)

    # --- delivery -----------------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> None:
        """Hand everything logged so far to the proxy (spooled, durable) and return.

        Never raises because the proxy is unreachable: then the data stays buffered, the
        flusher keeps trying, and a warning says so once (``finish()`` reports it).
        """
        timeout_s = timeout_s or self._settings.tracking.finish_timeout_s
        self._collect()
        try:
            self._open_delivery.flush(time.monotonic() + timeout_s)
        except TrackingUnavailableError as exc:
            logger.warning("run %s: %s", self.run_key, exc)

    def _collect(self) -> None:
        """Add system metrics, console output and the sanitized count (flusher thread)."""
        if self._sampler is not None and time.monotonic() >= self._next_sample:
            self._next_sample = time.monotonic() + self._sample_interval_s
            stamp = int(time.time() * 1000)
            self._open_delivery.add_points([(k, v, stamp, self._sample_step)
                                       for k, v in self._sampler.sample().items()])
            self._sample_step += 1
        if self._console is not None:
            text = self._console.read_new()
            if text:
                self._open_delivery.add_log(self._policy.log_name, text)
        with self._lock:
            counts = (self._sanitized, self._dropped)
            changed = counts != self._counts_sent
            self._counts_sent = counts
            step = max(0, self._next_step - 1)
        if changed:
            # In all_ranks mode every rank counts its own (tags of one run would overwrite).
            suffix = f".rank_{self.rank}" if self.mode == "all_ranks" and self.rank is not None \
                else ""
            stamp = int(time.time() * 1000)
            self._open_delivery.add_tags({validation.SANITIZED_VALUES_TAG + suffix: str(counts[0]),
                                          validation.DROPPED_VALUES_TAG + suffix: str(counts[1])})
            self._open_delivery.add_points([
                (self._policy.metric_key(SANITIZED_METRIC), float(counts[0]), stamp, step),
                (self._policy.metric_key(DROPPED_METRIC), float(counts[1]), stamp, step)])

    # --- end ----------------------------------------------------------------------------------
    def finish(self, status: str = "FINISHED", timeout_s: float | None = None,
               wait: bool = True) -> LandedReport:
        """Send everything, wait until it is in MLflow, and leave the run.

        Only the primary's finish ends the run (once every other process left); other ranks just
        leave. Waits at most ``timeout_s`` (default ``RAYDECK_TRACKING_FINISH_TIMEOUT_S``); data
        still pending then stays in the shard's spool and lands when MLflow is back: the returned
        report, and a warning, say exactly what is pending. With ``wait=False`` it returns once
        the proxy holds everything (spooled, durable). A finish that raised stays unfinished: a
        second call (or the process's exit) tries again. A guest's tracker
        (:func:`~raydeck.tracking.client.attach.attach_guest`) only hands its data over: it ends
        nothing and never waits for MLflow.
        A run that was active when its driver got SIGTERM or SIGINT ends KILLED, whatever
        ``status`` says (:func:`~raydeck.tracking.client.lifecycle.end_status`).

        Raises:
            TrackingUnavailableError: the proxy could not be reached to take the last data.
            TrackingWriteError: MLflow refused some values for good (set aside as dead letters
                and recorded on the run; everything else landed).
        """
        if self._finished:
            return self._report or LandedReport(True, Pending())
        status = lifecycle.end_status(self, status)
        # A guest's part is in the proxy once flushed; it ends nothing, so it waits for no one.
        wait = wait and not self._request.guest
        timeout_s = timeout_s or self._settings.tracking.finish_timeout_s
        deadline = time.monotonic() + timeout_s
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        self._collect()
        self._open_delivery.flush(deadline)
        binding = self._binding()
        report = LandedReport(False, Pending())
        if wait:
            left = max(1.0, deadline - time.monotonic())
            try:
                report = ray.get(self._open_delivery.shard().wait_landed.remote(
                    sorted({binding.run_key, binding.params_run_key}), left), timeout=left + 10)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
                report = LandedReport(False, self._open_delivery.buffered())
        delivery = self._open_delivery
        ended = delivery.detach(status, max(deadline, time.monotonic() + 10))
        if wait and ended and report.landed:
            # This process ended the run: return once MLflow shows it ended.
            left = max(1.0, deadline - time.monotonic())
            with contextlib.suppress(ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
                end = ray.get(delivery.shard().wait_landed.remote(ended, left),
                              timeout=left + 10)
                report = LandedReport(end.landed, end.pending, report.dead_letters + tuple(
                    d for d in end.dead_letters if d not in report.dead_letters))
        self._finished = True
        self._report = report
        lifecycle.forget(self)
        delivery.close()
        if self._console is not None:
            self._console.close()
        if wait and not report.landed:
            logger.warning(
                "run %s: finish() timed out after %.0f s with %s pending in the tracking proxy; "
                "it is spooled and will be written when MLflow is reachable",
                self.run_key, timeout_s, report.pending.describe())
        if report.dead_letters:
            shown = "; ".join(f"{d.kind} {d.key!r}: {d.reason}" for d in report.dead_letters[:10])
            raise TrackingWriteError(
                f"MLflow refused {len(report.dead_letters)} value(s) of run {self.run_key} for "
                f"good (set aside, recorded on the run as the tag raydeck.dead_letters; all "
                f"others landed): {shown}")
        return report

    def abandon(self) -> None:
        """Stop delivering without ending the run: this process exits with data not handed
        over (``lifecycle`` calls it last at exit). The proxy ends the run when it finds the
        process gone; what it already holds lands."""
        self._open_delivery.stop()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """End the run (FAILED after an exception). Never raises: a problem is logged."""
        try:
            self.finish("FAILED" if exc_type is not None else "FINISHED")
        except Exception as error:
            logger.error("run %s: %s", self.run_key, error)

    def __repr__(self) -> str:
        binding = self._open_delivery.binding
        primary = binding.is_primary if binding else "?"
        return (f"Tracker(run_key={self.run_key!r}, mode={self.mode!r}, rank={self.rank}, "
                f"primary={primary})")
