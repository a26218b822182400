"""Every metric raydeck exports, and the small APIs that record them.

Owns: the registry of raydeck's metrics (:data:`METRICS`: name, kind, labels, meaning; README's
table and the dashboards are written against it), the Ray metric objects behind them, and the
recording APIs: :class:`TrainingMetrics` (called by
:func:`raydeck.train.checkpointing.report_epoch`), :class:`SweepMetrics` (for the sweep driver),
:func:`storage_operation` (for storage code). The tracking proxy's
:mod:`raydeck.tracking.proxy.metrics` records the ``raydeck_tracking_*`` entries. Does not own:
keeping gauges exported between two ``set()`` calls (:mod:`raydeck.observability.held_gauge`, which
every gauge here goes through), scraping (:mod:`raydeck.observability.prometheus`) or dashboards.

How numbers reach Prometheus: a ``ray.util.metrics`` object in any Ray process (driver, actor,
Train worker) is exported by its node's metrics agent on the node's metrics export port. Ray
prefixes custom names with ``ray_`` and counters gain ``_total``: the Counter
``raydeck_storage_op_errors`` is scraped as ``ray_raydeck_storage_op_errors_total``
(:attr:`MetricSpec.prometheus_name`). Ray adds ``SessionName``, ``NodeAddress``, ``WorkerId``,
``Component`` and ``Version`` labels; Prometheus adds ``job`` and ``instance``.

Why error counters start at zero: Ray's ``Counter.inc`` rejects 0, and a counter series that was
never incremented is not exported: the error panel says "No data" instead of 0, and
``increase()`` misses the first error because the series appears already at 1. Prometheus'
instrumentation guidelines say to export the label sets you know at zero; :func:`zero_counter`
records a 0 through Ray's recording path (``Metric._record``, which ``inc`` calls after its
check; the end-to-end test fails if a Ray upgrade changes that).
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from raydeck.observability.held_gauge import HeldGauge

if TYPE_CHECKING:
    from ray.util.metrics import Counter, Histogram

logger = logging.getLogger(__name__)

MetricKind = Literal["counter", "gauge", "histogram"]

RAY_PREFIX = "ray_"

THROUGHPUT_KEY = "samples_per_s"
LOSS_KEY_PART = "loss"
TRIAL_STATES = ("pending", "running", "stopped_early", "completed", "errored", "preempted")

WRITE_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CHECKPOINT_SAVE_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                             300.0, 600.0)
STORAGE_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                             30.0, 60.0)

_NAME_PATTERN = re.compile(r"^raydeck_[a-z0-9_]+$")
_LABEL_PATTERN = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class MetricSpec:
    """One metric raydeck exports.

    Attributes:
        name: the name declared to Ray (``raydeck_...``); Prometheus stores
            :attr:`prometheus_name`.
        kind: ``counter``, ``gauge`` or ``histogram``.
        description: what one unit means; README's table shows it.
        labels: the label keys every sample carries (besides Ray's and Prometheus' own).
        boundaries: histogram bucket upper bounds, in the metric's unit.
    """

    name: str
    kind: MetricKind
    description: str
    labels: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not _NAME_PATTERN.match(self.name):
            raise ValueError(f"metric name {self.name!r}: must match {_NAME_PATTERN.pattern}")
        if self.kind not in get_args(MetricKind):
            raise ValueError(f"metric {self.name}: kind {self.kind!r} is not one of "
                             f"{', '.join(get_args(MetricKind))}")
        for label in self.labels:
            if not _LABEL_PATTERN.match(label):
                raise ValueError(f"metric {self.name}: label {label!r} must be snake_case")
        if (self.kind == "histogram") != bool(self.boundaries):
            raise ValueError(f"metric {self.name}: histograms, and only they, need boundaries")

    @property
    def prometheus_name(self) -> str:
        """The name Prometheus stores: Ray's ``ray_`` prefix, plus ``_total`` for counters."""
        base = f"{RAY_PREFIX}{self.name}"
        return f"{base}_total" if self.kind == "counter" else base

    @property
    def series_names(self) -> tuple[str, ...]:
        """Every series name Prometheus stores for this metric."""
        if self.kind == "histogram":
            base = self.prometheus_name
            return (f"{base}_bucket", f"{base}_sum", f"{base}_count")
        return (self.prometheus_name,)


_TRAIN_LABELS = ("run", "run_id", "rank", "job_id")

TRACKING_POINTS_RECEIVED = MetricSpec(
    "raydeck_tracking_points_received", "counter",
    "Entities (points, params, tags, files) a shard accepted and spooled", ("shard",))
TRACKING_POINTS_WRITTEN = MetricSpec(
    "raydeck_tracking_points_written", "counter", "Entities a shard wrote to MLflow", ("shard",))
TRACKING_WRITE_ERRORS = MetricSpec(
    "raydeck_tracking_write_errors", "counter",
    "Failed MLflow writes: kind=transient (retried) or rejected (refused for good, set aside)",
    ("shard", "kind"))
TRACKING_WRITE_LATENCY = MetricSpec(
    "raydeck_tracking_write_latency_s", "histogram",
    "Seconds per MLflow call of a shard (a chunk of values, a file, a run update)",
    ("shard",), WRITE_LATENCY_BUCKETS_S)
TRACKING_QUEUE_DEPTH = MetricSpec(
    "raydeck_tracking_queue_depth", "gauge", "Entities accepted but not yet written",
    ("shard",))
TRACKING_SPOOL_BYTES = MetricSpec(
    "raydeck_tracking_spool_bytes", "gauge", "Bytes in the shard's spool directory", ("shard",))
TRACKING_REPLAY_BACKLOG = MetricSpec(
    "raydeck_tracking_replay_backlog", "gauge",
    "Entities a shard found in its spool at start (after a restart) and has not yet written",
    ("shard",))
TRACKING_ACTIVE_RUNS = MetricSpec(
    "raydeck_tracking_active_runs", "gauge", "Runs the tracking router holds open")

TRAIN_STEP = MetricSpec(
    "raydeck_train_step", "gauge", "Last step (epoch) this rank reported", _TRAIN_LABELS)
TRAIN_STEP_TIMESTAMP = MetricSpec(
    "raydeck_train_step_timestamp_s", "gauge",
    "Unix time at which this rank's last step was reported", _TRAIN_LABELS)
TRAIN_STEP_TIME = MetricSpec(
    "raydeck_train_step_time_s", "gauge",
    "Seconds between this rank's last two reported steps", _TRAIN_LABELS)
TRAIN_SAMPLES_PER_S = MetricSpec(
    "raydeck_train_samples_per_s", "gauge",
    f"Training throughput of this rank, when the job reports `{THROUGHPUT_KEY}`", _TRAIN_LABELS)
TRAIN_LOSS = MetricSpec(
    "raydeck_train_loss", "gauge",
    f"Each reported value whose key contains `{LOSS_KEY_PART}` (label name = the key)",
    (*_TRAIN_LABELS, "name"))
TRAIN_CHECKPOINT_SAVE = MetricSpec(
    "raydeck_train_checkpoint_save_s", "histogram",
    "Seconds to write and report one checkpoint (includes Ray Train's persist)",
    _TRAIN_LABELS, CHECKPOINT_SAVE_BUCKETS_S)
TRAIN_CHECKPOINT_BYTES = MetricSpec(
    "raydeck_train_checkpoint_bytes", "gauge", "Size of the last checkpoint this rank wrote",
    _TRAIN_LABELS)

SWEEP_TRIALS = MetricSpec(
    "raydeck_sweep_trials", "gauge",
    f"Trials of a sweep in each state ({', '.join(TRIAL_STATES)})", ("sweep", "state"))
SWEEP_BEST_SCORE = MetricSpec(
    "raydeck_sweep_best_score", "gauge", "Best value of the sweep's metric so far",
    ("sweep", "metric", "mode"))

STORAGE_OP_LATENCY = MetricSpec(
    "raydeck_storage_op_latency_s", "histogram", "Seconds per object-storage operation",
    ("op",), STORAGE_LATENCY_BUCKETS_S)
STORAGE_OP_ERRORS = MetricSpec(
    "raydeck_storage_op_errors", "counter", "Object-storage operations that raised", ("op",))

_SERVING_LABELS = ("app", "model")
SERVING_MODEL_VERSION = MetricSpec(
    "raydeck_serving_model_version", "gauge",
    "Registry version a serving replica answers with (0: a runs:/ URI)", _SERVING_LABELS)
SERVING_MODEL_UPDATES = MetricSpec(
    "raydeck_serving_model_updates", "counter",
    "Alias moves a replica acted on: outcome=switched, or rejected (failed its health check; "
    "the replica kept its version)", (*_SERVING_LABELS, "outcome"))
SERVING_BAD_REQUESTS = MetricSpec(
    "raydeck_serving_bad_requests", "counter",
    "Requests answered 400 (not JSON, wrong shape or dtype, too large)", _SERVING_LABELS)

QUEUE_WAIT_BUCKETS_S = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 14400.0,
                        43200.0, 86400.0)
DURATION_RATIO_BUCKETS = (0.25, 0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 2.0, 4.0)
QUEUE_JOBS = MetricSpec(
    "raydeck_queue_jobs", "gauge", "Jobs of the queue per team in each state (queued, running)",
    ("team", "state"))
QUEUE_WAIT = MetricSpec(
    "raydeck_queue_wait_s", "histogram", "Seconds a job waited in the queue before it started",
    ("team",), QUEUE_WAIT_BUCKETS_S)
QUEUE_DURATION_RATIO = MetricSpec(
    "raydeck_queue_duration_ratio", "histogram",
    "A finished job's duration over the duration the queue predicted (1: exact)", ("team",),
    DURATION_RATIO_BUCKETS)
QUEUE_PREEMPTIONS = MetricSpec(
    "raydeck_queue_preemptions", "counter",
    "Running jobs the queue asked to stop at their next checkpoint for a higher-priority job",
    ("team",))

METRICS: tuple[MetricSpec, ...] = (
    TRACKING_POINTS_RECEIVED, TRACKING_POINTS_WRITTEN, TRACKING_WRITE_ERRORS,
    TRACKING_WRITE_LATENCY, TRACKING_QUEUE_DEPTH, TRACKING_SPOOL_BYTES, TRACKING_REPLAY_BACKLOG,
    TRACKING_ACTIVE_RUNS,
    TRAIN_STEP, TRAIN_STEP_TIMESTAMP, TRAIN_STEP_TIME, TRAIN_SAMPLES_PER_S, TRAIN_LOSS,
    TRAIN_CHECKPOINT_SAVE, TRAIN_CHECKPOINT_BYTES,
    SWEEP_TRIALS, SWEEP_BEST_SCORE,
    STORAGE_OP_LATENCY, STORAGE_OP_ERRORS,
    SERVING_MODEL_VERSION, SERVING_MODEL_UPDATES, SERVING_BAD_REQUESTS,
    QUEUE_JOBS, QUEUE_WAIT, QUEUE_DURATION_RATIO, QUEUE_PREEMPTIONS,
)


def metrics_markdown() -> str:
    """README's table of raydeck's metrics, rendered from :data:`METRICS`."""
    lines = ["| Prometheus name | Kind | Labels | Meaning |", "|---|---|---|---|"]
    for spec in METRICS:
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "-"
        lines.append(f"| `{spec.prometheus_name}` | {spec.kind} | {labels} | "
                     f"{spec.description} |")
    return "\n".join(lines)


# --- Ray metric objects, one per metric and process --------------------------------------------
_objects: dict[str, Any] = {}
_objects_lock = threading.Lock()


def counter(spec: MetricSpec) -> Counter:
    """This process's Ray Counter for ``spec``."""
    from ray.util.metrics import Counter

    return _object(spec, "counter", lambda: Counter(spec.name, spec.description,
                                                     tag_keys=spec.labels))


def histogram(spec: MetricSpec) -> Histogram:
    """This process's Ray Histogram for ``spec``."""
    from ray.util.metrics import Histogram

    return _object(spec, "histogram", lambda: Histogram(
        spec.name, spec.description, boundaries=list(spec.boundaries), tag_keys=spec.labels))


def gauge(spec: MetricSpec) -> HeldGauge:
    """This process's :class:`HeldGauge` for ``spec``."""
    return _object(spec, "gauge",
                   lambda: HeldGauge(spec.name, spec.description, spec.labels))


def _object(spec: MetricSpec, kind: str, make: Any) -> Any:
    if spec.kind != kind:
        raise TypeError(f"metric {spec.name} is a {spec.kind}, not a {kind}")
    with _objects_lock:
        made = _objects.get(spec.name)
        if made is None:
            made = _objects[spec.name] = make()
        return made


def zero_counter(spec: MetricSpec, tags: Mapping[str, str]) -> None:
    """Export ``spec``'s series for ``tags`` at 0 without counting anything (module docstring)."""
    counter(spec)._record(0, tags=dict(tags))


# --- training ------------------------------------------------------------------------------------
class TrainingMetrics:
    """One rank's progress in one training run, as :func:`report_epoch` reports it.

    Every series carries ``run`` (run name), ``run_id`` (MLflow run id, empty when tracking is
    off), ``rank`` and ``job_id`` (Ray job). A step's timestamp is kept exported while the
    process lives, which is what the TrainingStalled alert relies on: a hung worker keeps
    exporting an ageing timestamp, a finished one stops exporting.
    """

    def __init__(self, run: str, run_id: str, rank: int, job_id: str) -> None:
        self.tags = {"run": run, "run_id": run_id, "rank": str(rank), "job_id": job_id}
        self._last_report_monotonic: float | None = None
        self._loss_names: set[str] = set()

    def step_reported(self, step: int, values: Mapping[str, Any]) -> None:
        """Record that ``step`` was reported with ``values`` (the job's metric dict)."""
        now = time.monotonic()
        gauge(TRAIN_STEP).set(step, self.tags)
        gauge(TRAIN_STEP_TIMESTAMP).set(time.time(), self.tags)
        if self._last_report_monotonic is not None:
            gauge(TRAIN_STEP_TIME).set(now - self._last_report_monotonic, self.tags)
        self._last_report_monotonic = now
        throughput = values.get(THROUGHPUT_KEY)
        if throughput is not None and _finite(throughput):
            gauge(TRAIN_SAMPLES_PER_S).set(float(throughput), self.tags)
        for key, value in values.items():
            if LOSS_KEY_PART in key and _finite(value):
                self._loss_names.add(key)
                gauge(TRAIN_LOSS).set(float(value), {**self.tags, "name": key})

    def checkpoint_saved(self, seconds: float, size_bytes: int) -> None:
        """Record one checkpoint this rank wrote: how long it took and how big it is."""
        histogram(TRAIN_CHECKPOINT_SAVE).observe(seconds, self.tags)
        gauge(TRAIN_CHECKPOINT_BYTES).set(size_bytes, self.tags)

    def close(self) -> None:
        """Stop exporting this rank's gauges (the run ended in a process that lives on)."""
        for spec in (TRAIN_STEP, TRAIN_STEP_TIMESTAMP, TRAIN_STEP_TIME, TRAIN_SAMPLES_PER_S,
                     TRAIN_CHECKPOINT_BYTES):
            gauge(spec).forget(self.tags)
        for name in self._loss_names:
            gauge(TRAIN_LOSS).forget({**self.tags, "name": name})


_training: dict[tuple[str, str, int, str], TrainingMetrics] = {}
_training_lock = threading.Lock()


def training_metrics(run: str, run_id: str, rank: int) -> TrainingMetrics:
    """The :class:`TrainingMetrics` of ``rank`` in a run, the same object on every call.

    ``run`` falls back to the Ray Train run name when empty (tracking disabled). The Ray job id
    comes from the runtime context (empty outside a Ray job).
    """
    job_id = ""
    try:
        import ray

        if ray.is_initialized():
            job_id = ray.get_runtime_context().get_job_id() or ""
        if not run:
            import ray.train

            run = ray.train.get_context().get_experiment_name()
    except Exception:  # outside a Train worker: the labels stay as given
        logger.debug("no Ray Train context for the training metrics' labels", exc_info=True)
    key = (run, run_id, rank, job_id)
    with _training_lock:
        found = _training.get(key)
        if found is None:
            found = _training[key] = TrainingMetrics(run, run_id, rank, job_id)
        return found


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# --- sweeps --------------------------------------------------------------------------------------
class SweepMetrics:
    """A sweep's trial states and best score; the sweep driver calls it on every change.

    Args:
        sweep: the sweep's name (the ``sweep`` label).
        metric: the metric the sweep optimizes (a label of the best score).
        mode: ``max`` or ``min``.

    Raises:
        ValueError: ``mode`` is neither ``max`` nor ``min``.
    """

    def __init__(self, sweep: str, metric: str, mode: str) -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"mode={mode!r}: must be 'max' or 'min'")
        self.sweep = sweep
        self._score_tags = {"sweep": sweep, "metric": metric, "mode": mode}

    def trial_states(self, counts: Mapping[str, int]) -> None:
        """Set how many trials are in each state; states not given are 0.

        Raises:
            ValueError: a state outside :data:`TRIAL_STATES`.
        """
        unknown = sorted(set(counts) - set(TRIAL_STATES))
        if unknown:
            raise ValueError(f"unknown trial state(s) {', '.join(unknown)}; known: "
                             f"{', '.join(TRIAL_STATES)}")
        for state in TRIAL_STATES:
            gauge(SWEEP_TRIALS).set(int(counts.get(state, 0)), {"sweep": self.sweep,
                                                                 "state": state})

    def best_score(self, value: float) -> None:
        """Set the best value of the sweep's metric so far (non-finite values are ignored)."""
        if _finite(value):
            gauge(SWEEP_BEST_SCORE).set(float(value), self._score_tags)

    def close(self) -> None:
        """Stop exporting the sweep's gauges (it finished; Prometheus keeps the history)."""
        for state in TRIAL_STATES:
            gauge(SWEEP_TRIALS).forget({"sweep": self.sweep, "state": state})
        gauge(SWEEP_BEST_SCORE).forget(self._score_tags)


# --- storage -------------------------------------------------------------------------------------
_storage_ops_seen: set[str] = set()


@contextmanager
def storage_operation(op: str) -> Iterator[None]:
    """Time one object-storage operation named ``op`` (``put``, ``get``, ``list``, ...).

    The block's duration goes to the latency histogram; if the block raises, the error counter
    is incremented and the exception propagates unchanged.
    """
    tags = {"op": op}
    if op not in _storage_ops_seen:
        _storage_ops_seen.add(op)
        zero_counter(STORAGE_OP_ERRORS, tags)
    started = time.perf_counter()
    try:
        yield
    except BaseException:
        counter(STORAGE_OP_ERRORS).inc(1, tags)
        raise
    finally:
        histogram(STORAGE_OP_LATENCY).observe(time.perf_counter() - started, tags)
