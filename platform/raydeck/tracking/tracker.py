"""The tracker: what training code calls to log, with MLflow's method names.

A log call validates its values (strict calls raise at the call site naming the key and the fix;
raydeck's own paths repair instead, see :mod:`raydeck.tracking.validation`), appends them to a
bounded local buffer and returns in microseconds; :class:`~raydeck.tracking.delivery.Delivery`
sends the buffer to the run's shard in the background. ``flush()`` and ``log_*`` never raise
because MLflow, S3 or the proxy is unavailable: the data waits (in the shard's spool, or in the
buffer while the proxy is unreachable) and one warning says so. Only :meth:`Tracker.finish`
reports what did not land.

Step policy: one step counter per tracker, like W&B. A call without ``step`` logs all its values
at the tracker's current step and then advances it by one; ``step=N`` logs at ``N`` and moves the
counter to ``N + 1`` if it was lower. So metrics logged at different rates share one x-axis.

Method names and argument order follow ``mlflow`` (``log_metric(key, value, step, synchronous,
timestamp)``, ``log_param``, ``set_tag``, ``log_artifact(s)``, ``log_dict``, ``log_text``,
``log_figure``, ``log_image``, ``log_table``, ``log_input``, ``log_model``), so code moves over
by renaming the object. ``synchronous=True`` waits until the proxy holds the data (spooled).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import ray

from raydeck import preemption
from raydeck.config import Settings
from raydeck.errors import TrackingUnavailableError, TrackingValidationError, TrackingWriteError
from raydeck.tracking import validation
from raydeck.tracking.console import ConsoleCapture
from raydeck.tracking.delivery import Delivery
from raydeck.tracking.messages import (
    AttachRequest,
    DatasetRef,
    LandedReport,
    Pending,
    Point,
    ProcessInfo,
    RunBinding,
)
from raydeck.tracking.modes import ModePolicy
from raydeck.tracking.repro import reproducibility_tags, runtime_env_json
from raydeck.tracking.system_metrics import SystemSampler, sampler_for

logger = logging.getLogger(__name__)

SANITIZED_METRIC = "raydeck/sanitized_values"
DROPPED_METRIC = "raydeck/dropped_values"
RESOLVE_TIMEOUT_S = 60.0
# known_run_id's look-up of a run id the process does not have yet (see there).
RUN_ID_PROBE_INTERVAL_S = 30.0
RUN_ID_PROBE_TIMEOUT_S = 1.0


class Tracker:
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
        self._sample_interval_s = settings.tracking.system_metrics_interval_s
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

        from raydeck.tracking import lifecycle

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
            self.log_text(runtime_env_json(), "raydeck/runtime_env.json")

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

    # --- metrics (caller's thread; must stay cheap) -------------------------------------------
    def log_metric(self, key: str, value: float, step: int | None = None,
                   synchronous: bool | None = None, timestamp: int | None = None,
                   *, strict: bool = True) -> None:
        """Log one metric value. See :meth:`log_metrics`."""
        self.log_metrics({key: value}, step, synchronous, timestamp, strict=strict)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None,
                    synchronous: bool | None = None, timestamp: int | None = None,
                    *, strict: bool = True) -> None:
        """Log metric values at ``step`` (the tracker's step counter when None; see the module
        docstring); returns at once, values are sent in the background.

        ``timestamp`` (ms since the epoch) defaults to now; re-logging a point with its
        original timestamp is idempotent (MLflow keeps one copy). ``synchronous=True`` returns
        once the proxy holds the values.

        Raises:
            TrackingValidationError: (``strict``) some keys or values broke a rule; every other
                value of the call was kept. The message names each key, its rule and the fix.
                With ``strict=False`` nothing raises: keys are made legal, values that cannot
                be stored are dropped, each warned about once and counted on the run.
        """
        if not strict:
            metrics, changes = validation.sanitize_metrics(metrics)
            self._corrected("metric", changes)
        problem = validation.step_problem(step) if step is not None else None
        if problem:
            if strict:
                raise TrackingValidationError(dict.fromkeys(map(str, metrics), problem))
            self._corrected("metric", [validation.Sanitized(str(k), None, problem)
                                       for k in metrics])
            return
        stamp = int(time.time() * 1000) if timestamp is None else int(timestamp)
        keys = self._keys
        out: list[Point] = []
        problems: dict[str, str] | None = None
        with self._lock:
            if step is None:
                point_step = self._next_step
                self._next_step += 1
            else:
                point_step = int(step)
                if self._next_step <= point_step:
                    self._next_step = point_step + 1
            logged_through = self._logged_through
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
                        problems[str(key)] = problem
                        continue
                if logged_through and point_step <= logged_through.get(final, -1):
                    continue
                out.append((final, number, stamp, point_step))
        self._delivery.add_points(out)
        if synchronous:
            self.flush()
        self._refused("metric", problems, strict)

    def _refused(self, what: str, problems: dict[str, str] | None, strict: bool) -> None:
        """Raise a strict call's problems; count a lenient call's as dropped values."""
        if not problems:
            return
        if strict:
            raise TrackingValidationError(problems)
        self._corrected(what, [validation.Sanitized(key, None, rule)
                               for key, rule in problems.items()])

    def _corrected(self, what: str, changes: list[validation.Sanitized]) -> None:
        """Count what a lenient path changed or dropped (tags and metrics on the run, sent
        with the next batch); warn once per key."""
        if not changes:
            return
        fresh = []
        with self._lock:
            for change in changes:
                if change.dropped:
                    self._dropped += 1
                else:
                    self._sanitized += 1
                if (what, change.key) not in self._warned:
                    self._warned.add((what, change.key))
                    fresh.append(change)
        for change in fresh:
            if change.dropped:
                logger.warning("run %s: %s %r not logged: %s (warned once per key; counted in "
                               "the run's tag %s)", self.run_key, what, change.key,
                               change.reason, validation.DROPPED_VALUES_TAG)
            else:
                logger.warning("run %s: %s %r logged as %r: %s (warned once per key; counted "
                               "in the run's tag %s)", self.run_key, what, change.key,
                               change.logged_as, change.reason,
                               validation.SANITIZED_VALUES_TAG)

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

    # --- artifacts ----------------------------------------------------------------------------
    def log_artifact(self, local_path: str | os.PathLike[str], artifact_path: str | None = None
                     ) -> None:
        """Log a file (or a directory, under its own name) as MLflow's ``log_artifact`` does.

        ``local_path`` is resolved first (``"."`` is the current directory, by its name). The
        bytes are copied to a staging file now, so the file may change after the call returns,
        and streamed to the proxy in chunks: an unreachable artifact store delays the upload,
        never fails it.

        Raises:
            TrackingValidationError: the path does not exist or ``artifact_path`` is illegal.
        """
        path = Path(local_path).expanduser().resolve()
        problem = validation.artifact_dir_problem(artifact_path)
        if problem is None and not path.exists():
            problem = f"no such file or directory: {path}"
        if problem is None and not path.name:
            problem = "cannot log the file system root; name a file or directory"
        if problem:
            raise TrackingValidationError({str(local_path): problem})
        base = posixpath.normpath(artifact_path).strip("/") if artifact_path else ""
        if path.is_dir():
            self._log_tree(path, posixpath.join(base, path.name) if base else path.name)
        else:
            self._delivery.add_file(path, base, path.name)

    def log_artifacts(self, local_dir: str | os.PathLike[str], artifact_path: str | None = None
                      ) -> None:
        """Log a directory's contents under ``artifact_path`` (MLflow's ``log_artifacts``).

        Raises:
            TrackingValidationError: not a directory, or ``artifact_path`` is illegal.
        """
        path = Path(local_dir).expanduser().resolve()
        problem = validation.artifact_dir_problem(artifact_path)
        if problem is None and not path.is_dir():
            problem = f"not a directory: {path}"
        if problem:
            raise TrackingValidationError({str(local_dir): problem})
        self._log_tree(path, posixpath.normpath(artifact_path).strip("/") if artifact_path
                       else "")

    def _log_tree(self, root: Path, base: str) -> None:
        for folder, _dirs, files in os.walk(root):
            relative = Path(folder).relative_to(root).as_posix()
            directory = base if relative == "." else posixpath.join(base, relative) if base \
                else relative
            for name in sorted(files):
                file = Path(folder) / name
                if file.is_file():
                    self._delivery.add_file(file, directory, name)

    def _log_file_as(self, write: Any, artifact_file: str) -> None:
        """Write a file with ``write(path)`` and log it at ``artifact_file``."""
        problem = validation.artifact_file_problem(artifact_file)
        if problem:
            raise TrackingValidationError({str(artifact_file): problem})
        directory, name = posixpath.split(posixpath.normpath(artifact_file).strip("/"))
        with tempfile.TemporaryDirectory(prefix="raydeck-artifact-") as tmp:
            path = Path(tmp) / name
            write(path)
            self._delivery.add_file(path, directory, name)

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
        self._log_file_as(lambda path: path.write_text(text, encoding="utf-8"), artifact_file)

    def log_figure(self, figure: Any, artifact_file: str, *,
                   save_kwargs: dict[str, Any] | None = None) -> None:
        """Log a matplotlib or plotly figure (as MLflow's ``log_figure``), from any rank."""
        from raydeck.tracking.artifacts import write_figure

        self._log_file_as(lambda path: write_figure(figure, path, save_kwargs), artifact_file)

    def log_image(self, image: Any, artifact_file: str | None = None, key: str | None = None,
                  step: int | None = None, timestamp: int | None = None,
                  synchronous: bool | None = None) -> None:
        """Log an image (numpy array, PIL image or ``mlflow.Image``) as MLflow does: at
        ``artifact_file``, or with ``key`` and ``step`` as a step-indexed image the MLflow UI
        shows in its image charts (``images/<key>+step+<step>+...``)."""
        from raydeck.tracking.artifacts import image_files

        with self._lock:
            if step is None and key is not None:
                step = max(0, self._next_step - 1)
        for artifact, write in image_files(image, artifact_file, key, step, timestamp):
            self._log_file_as(write, artifact)
        if key is not None:
            self.set_tags({"mlflow.loggedImages": "true"})
        if synchronous:
            self.flush()

    def log_table(self, data: Any, artifact_file: str) -> None:
        """Log a table (dict of columns or pandas DataFrame) as MLflow does, ``.json`` or
        ``.parquet``. Calls with the same ``artifact_file`` in this process append rows."""
        from raydeck.tracking.artifacts import logged_artifacts_tag, table_frame, write_table

        with self._lock:
            frame = table_frame(data, self._tables.get(artifact_file))
            self._tables[artifact_file] = frame
            paths = sorted(self._tables)
        self._log_file_as(lambda path: write_table(frame, path), artifact_file)
        self.set_tags({"mlflow.loggedArtifacts": logged_artifacts_tag(paths)})

    def log_input(self, dataset: Any, context: str | None = None,
                  tags: dict[str, str] | None = None) -> None:
        """Record a dataset the run used in MLflow's dataset tables (name, digest, source,
        schema), as ``mlflow.log_input`` does. ``dataset`` is an ``mlflow.data`` dataset."""
        entity = dataset._to_mlflow_entity()
        self._delivery.add_input(DatasetRef(
            name=entity.name, digest=entity.digest, source_type=entity.source_type,
            source=entity.source, schema=entity.schema or "", profile=entity.profile or "",
            context=context or "", tags=dict(tags or {})))

    def log_model(self, model: Any, name: str = "model", *, flavor: Any = None,
                  **save_kwargs: Any) -> str:
        """Log an MLflow model of ``model`` under ``name`` through the proxy.

        The model is saved locally with ``flavor.save_model`` (inferred when None: a torch
        module -> ``mlflow.pytorch``, an ``mlflow.pyfunc.PythonModel`` -> ``mlflow.pyfunc``,
        else ``mlflow.sklearn``) and its files are logged as artifacts. Returns the model's URI
        (``runs:/<run id>/<name>``) for ``mlflow.register_model``.
        """
        from raydeck.tracking.artifacts import save_model

        with tempfile.TemporaryDirectory(prefix="raydeck-model-") as tmp:
            directory = save_model(model, Path(tmp) / "model", flavor, save_kwargs)
            self.log_artifacts(directory, name)
        return f"runs:/{self.run_id}/{name}"

    # --- Ray Train and resume helpers ---------------------------------------------------------
    def run_config(self, **kwargs: Any) -> Any:
        """A ``ray.train.RunConfig`` whose name binds Ray Train workers to this run.

        Workers of a TorchTrainer using it call :func:`get_tracker` with no arguments and land
        in this run, also when several runs share one Ray job (Tune trials).
        """
        from ray.train import RunConfig

        return RunConfig(name=self.run_key, **kwargs)

    def latest(self, timeout_s: float = 5.0) -> dict[str, tuple[float, int]]:
        """The newest value and step the proxy received per metric key of this run.

        For progress displays, which must never break a run: ``{}`` while this tracker is not
        attached yet or the proxy does not answer within ``timeout_s``.
        """
        try:
            shard = self._open_delivery.shard()
            return dict(ray.get(shard.latest.remote(self.run_key), timeout=timeout_s))
        except (TrackingUnavailableError, ray.exceptions.GetTimeoutError,
                ray.exceptions.RayActorError):
            return {}

    def last_steps(self, keys: Iterable[str], timeout_s: float = 60.0) -> dict[str, int]:
        """The highest step of each metric key this run holds, in MLflow or on its way (-1: none).

        Waits up to ``timeout_s`` for the proxy to write what it holds of this run first; if
        MLflow stays down that long, answers from what the proxy has received.
        """
        self.flush(timeout_s)
        finals = {self._policy.metric_key(key): key for key in keys}
        highest = ray.get(self._open_delivery.shard().last_steps.remote(
            self.run_key, sorted(finals), timeout_s), timeout=timeout_s + 30)
        return {finals[final]: int(step) for final, step in highest.items()}

    def skip_logged_steps(self, keys: Iterable[str], timeout_s: float = 60.0) -> None:
        """From now on, drop values of ``keys`` at steps this run already holds.

        For a job restarted from a checkpoint older than what it had logged: a worker can die
        after logging an epoch but before Ray Train registered that epoch's checkpoint, and the
        restarted job trains the epoch again. The run keeps the first values; the repeats are
        dropped here, on the caller's side. Never raises: if the proxy cannot answer, nothing
        is skipped (and a warning says so).
        """
        try:
            steps = self.last_steps(keys, timeout_s)
        except (TrackingUnavailableError, ray.exceptions.RayError) as exc:
            logger.warning("run %s: cannot ask which steps it holds (%s); steps trained again "
                           "may appear twice", self.run_key, type(exc).__name__)
            return
        with self._lock:
            self._logged_through = {self._policy.metric_key(key): step
                                    for key, step in steps.items() if step >= 0}

    # --- the job queue ------------------------------------------------------------------------
    def should_preempt(self) -> bool:
        """Whether raydeck's job queue asked this job to stop for a higher-priority one (as
        Determined's ``should_preempt()``): the answer given on a Ray Train worker when the
        last checkpoint was committed, the same on every rank (``report_epoch`` returns it
        too). Return from the training function; the job resumes from that checkpoint in this
        run when the queue starts it again. Always False for a job the queue did not start.
        """
        return preemption.stop_requested()

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
        second call (or the process's exit) tries again.

        Raises:
            TrackingUnavailableError: the proxy could not be reached to take the last data.
            TrackingWriteError: MLflow refused some values for good (set aside as dead letters
                and recorded on the run; everything else landed).
        """
        from raydeck.tracking.lifecycle import forget

        if self._finished:
            return self._report or LandedReport(True, Pending())
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
        forget(self)
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


class NoOpTracker(Tracker):
    """A tracker whose calls do nothing: tracking disabled, or a rank that must stay silent.

    Jobs never branch on rank or mode: they call the same methods on whatever
    :func:`get_tracker` returns.
    """

    def __init__(self, binding: RunBinding | None = None, process: ProcessInfo | None = None
                 ) -> None:
        self._noop_binding = binding or RunBinding(
            run_key="", params_run_key="", run_id="", experiment="", run_name="",
            mode="rank_zero", shard_index=0, is_primary=False, created=False, resumed=False,
            sample_system=False, active=False,
        )
        self._process = process or ProcessInfo(
            role="disabled", role_key="disabled", job_id=None, node_ip="", hostname="", pid=0
        )
        self._policy = ModePolicy(self._noop_binding.mode, self._process)

    def _binding(self) -> RunBinding:
        return self._noop_binding

    @property
    def run_key(self) -> str:
        return self._noop_binding.run_key

    @property
    def parent_run_key(self) -> str:
        return self._noop_binding.params_run_key

    @property
    def run_id(self) -> str:
        return self._noop_binding.run_id

    @property
    def parent_run_id(self) -> str:
        return self._noop_binding.run_id

    @property
    def experiment_id(self) -> str:
        return ""

    def known_run_id(self) -> str:
        return self._noop_binding.run_id

    @property
    def run_name(self) -> str:
        return self._noop_binding.run_name

    @property
    def active(self) -> bool:
        return False

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None,
                    synchronous: bool | None = None, timestamp: int | None = None,
                    *, strict: bool = True) -> None:
        return None

    def log_params(self, params: dict[str, Any], synchronous: bool | None = None,
                   *, strict: bool = True) -> None:
        return None

    def set_tags(self, tags: dict[str, Any], synchronous: bool | None = None,
                 *, strict: bool = True) -> None:
        return None

    def log_artifact(self, local_path: str | os.PathLike[str], artifact_path: str | None = None
                     ) -> None:
        return None

    def log_artifacts(self, local_dir: str | os.PathLike[str], artifact_path: str | None = None
                      ) -> None:
        return None

    def _log_file_as(self, write: Any, artifact_file: str) -> None:
        return None

    def log_table(self, data: Any, artifact_file: str) -> None:
        return None

    def log_input(self, dataset: Any, context: str | None = None,
                  tags: dict[str, str] | None = None) -> None:
        return None

    def log_model(self, model: Any, name: str = "model", *, flavor: Any = None,
                  **save_kwargs: Any) -> str:
        return ""

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
