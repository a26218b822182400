"""The driver's view of a running sweep: trial statuses, slot usage and Prometheus gauges.

Owns: :class:`SweepMonitor`, which Tune feeds through a callback (trial started, reported,
completed, errored) and the scheduler feeds with its STOP decisions; ending each trial's child
run with its status (:mod:`raydeck.tune.status`) through the tracking proxy; marking running
trials ``preempted`` when the driver is told to stop; the timings behind the sweep's start-up and
idle-slot figures; the sweep's Prometheus gauges. Does not own: the decisions themselves
(Tune's scheduler, the status policy).

Tune pickles its callbacks and scheduler into the sweep's state and unpickles them on
``--resume``. What it pickles is therefore only a sweep key: the live monitor is looked up in
this process's registry (:func:`monitoring`), so a resumed driver's callbacks reach its own
monitor and no state (or credential) ends up in the experiment files.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from raydeck._internal.redaction import redact_text
from raydeck.tune.config import SweepConfig
from raydeck.tune.score import best_of
from raydeck.tune.status import COMPLETED, ERRORED, StatusPolicy, TrialOutcome

logger = logging.getLogger(__name__)

# Ending a child run goes through the tracking proxy's router. Tune's callbacks never wait for
# it (they run in Tune's control loop); the summary and a preemption wait this long.
END_RUN_TIMEOUT_S = 60.0
_TUNE_STATES = {"PENDING": "pending", "PAUSED": "pending", "RUNNING": "running",
                "ERROR": ERRORED, "TERMINATED": COMPLETED}

_live: dict[str, SweepMonitor] = {}
_live_lock = threading.Lock()


@dataclass
class _TrialTiming:
    """Driver-side times (``time.monotonic``) of one trial."""

    busy_s: float = 0.0
    started_at: float | None = None
    first_result_at: float | None = None
    last_result_at: float | None = None
    startups: list[float] = field(default_factory=list)
    result_gaps: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class SlotUsage:
    """How well a sweep kept its trial slots busy.

    Attributes:
        slots: trials that ran at once at the busiest moment (the sweep's parallelism).
        idle_fraction: share of ``slots x`` the tuning loop's wall time with no trial in a
            slot (start-up of a trial counts as busy; see ``startup_s``).
        startup_s: mean time from a trial's start to its first result, minus one iteration
            (the median time between two results of one trial in this sweep).
        iteration_s: that median iteration time.
    """

    slots: int
    idle_fraction: float
    startup_s: float
    iteration_s: float


class SweepMonitor:
    """What the driver knows about a sweep's trials while it runs (thread-safe).

    Args:
        config: the sweep's settings.
        namespace: raydeck's Ray namespace (where the tracking proxy runs).
    """

    def __init__(self, config: SweepConfig, namespace: str) -> None:
        from raydeck.observability.metrics import SweepMetrics

        self.config = config
        self.namespace = namespace
        self.policy = StatusPolicy(config.max_t, scheduler_stops_early=config.scheduler == "asha")
        self._lock = threading.Lock()
        self._stopped_at: dict[str, int] = {}
        self._outcomes: dict[str, TrialOutcome] = {}
        # The pending "end this child run" call of each trial that ended in this driver.
        self._ending: dict[str, tuple[TrialOutcome, Any]] = {}
        self._iterations: dict[str, int] = {}
        self._running: set[str] = set()
        self._timings: dict[str, _TrialTiming] = {}
        self._peak_running = 0
        self._loop_started: float | None = None
        self._loop_ended: float | None = None
        self._best: float | None = None
        self._metrics = SweepMetrics(config.name, config.metric, config.mode)

    # --- fed by the scheduler and Tune's callbacks ----------------------------------------------
    def scheduler_stopped(self, trial_id: str, iteration: int) -> None:
        """The scheduler decided STOP for this trial at ``iteration``."""
        with self._lock:
            self._stopped_at[trial_id] = iteration

    def loop_started(self) -> None:
        with self._lock:
            self._loop_started = time.monotonic()

    def loop_ended(self) -> None:
        with self._lock:
            self._loop_ended = time.monotonic()
            for trial_id in list(self._running):
                self._close_interval(trial_id, self._loop_ended)

    def trial_started(self, trial_id: str, trials: list[Any]) -> None:
        now = time.monotonic()
        with self._lock:
            timing = self._timings.setdefault(trial_id, _TrialTiming())
            if trial_id in self._running:  # restarted after a pause (PBT)
                self._close_interval(trial_id, timing.last_result_at or now)
            timing.started_at, timing.first_result_at = now, None
            self._running.add(trial_id)
            self._peak_running = max(self._peak_running, len(self._running))
        self._publish(trials)

    def trial_result(self, trial_id: str, result: Mapping[str, Any], trials: list[Any]) -> None:
        now = time.monotonic()
        score = result.get(self.config.metric)
        with self._lock:
            self._iterations[trial_id] = _iteration(result)
            timing = self._timings.setdefault(trial_id, _TrialTiming())
            if timing.started_at is not None and timing.first_result_at is None:
                timing.first_result_at = now
                timing.startups.append(now - timing.started_at)
            elif timing.last_result_at is not None:
                timing.result_gaps.append(now - timing.last_result_at)
            timing.last_result_at = now
            self._best = best_of((self._best, score), self.config.mode)
        self._publish(trials)

    def trial_completed(self, trial_id: str, result: Mapping[str, Any] | None,
                        trials: list[Any]) -> TrialOutcome:
        """A trial ended without error: classify it and end its child run (no waiting)."""
        iteration = _iteration(result) or self._iterations.get(trial_id, 0)
        with self._lock:
            outcome = self.policy.ended(iteration, stopped_at=self._stopped_at.get(trial_id),
                                        observed=True)
        self._ended(trial_id, outcome)
        self._publish(trials)
        return outcome

    def trial_errored(self, trial_id: str, error: BaseException | str | None,
                      trials: list[Any]) -> TrialOutcome:
        outcome = self.policy.errored(self._iterations.get(trial_id, 0), error)
        self._ended(trial_id, outcome)
        self._publish(trials)
        return outcome

    def _ended(self, trial_id: str, outcome: TrialOutcome) -> None:
        now = time.monotonic()
        with self._lock:
            self._outcomes[trial_id] = outcome
            if trial_id in self._running:
                self._close_interval(trial_id, now)
        ref = end_child_run(self.config, self.namespace, trial_id, outcome, wait_s=None)
        with self._lock:
            self._ending[trial_id] = (outcome, ref)

    def _close_interval(self, trial_id: str, at: float) -> None:
        """Caller holds the lock."""
        self._running.discard(trial_id)
        timing = self._timings[trial_id]
        if timing.started_at is not None:
            timing.busy_s += max(0.0, at - timing.started_at)
            timing.started_at = None

    # --- preemption -----------------------------------------------------------------------------
    def preempt(self, wait_s: float) -> list[str]:
        """Mark every running trial ``preempted`` (child run KILLED); returns their ids.

        Called when the driver is told to stop (``ray job stop`` sends SIGTERM and kills it a
        few seconds later), so it waits at most ``wait_s`` in all.
        """
        with self._lock:
            running = sorted(self._running)
            outcomes = {t: self.policy.preempted(self._iterations.get(t, 0)) for t in running}
            self._outcomes.update(outcomes)
        deadline = time.monotonic() + wait_s
        refs = {trial_id: end_child_run(self.config, self.namespace, trial_id, outcome,
                                        wait_s=None)
                for trial_id, outcome in outcomes.items()}
        with self._lock:
            self._ending.update({t: (outcomes[t], ref) for t, ref in refs.items()})
        _wait_all([ref for ref in refs.values() if ref is not None], deadline)
        return running

    # --- read by the summary --------------------------------------------------------------------
    def outcome(self, trial_id: str) -> TrialOutcome | None:
        with self._lock:
            return self._outcomes.get(trial_id)

    def ending(self, trial_id: str, outcome: TrialOutcome) -> Any:
        """The pending call ending this trial's run with ``outcome`` (None if there is none)."""
        with self._lock:
            sent = self._ending.get(trial_id)
        return sent[1] if sent is not None and sent[0] == outcome else None

    def stopped_at(self, trial_id: str) -> int | None:
        with self._lock:
            return self._stopped_at.get(trial_id)

    def slot_usage(self) -> SlotUsage | None:
        """Slot usage of this driver's tuning loop (None if no trial ran)."""
        with self._lock:
            if self._loop_started is None or not self._peak_running:
                return None
            end = self._loop_ended or time.monotonic()
            wall_s = max(end - self._loop_started, 1e-9)
            busy_s = sum(t.busy_s for t in self._timings.values())
            gaps = [gap for t in self._timings.values() for gap in t.result_gaps]
            iteration_s = statistics.median(gaps) if gaps else 0.0
            startups = [max(0.0, s - iteration_s) for t in self._timings.values()
                        for s in t.startups]
            slots = self._peak_running
        return SlotUsage(
            slots=slots,
            idle_fraction=min(1.0, max(0.0, 1.0 - busy_s / (wall_s * slots))),
            startup_s=statistics.fmean(startups) if startups else 0.0,
            iteration_s=iteration_s,
        )

    # --- Prometheus -----------------------------------------------------------------------------
    def _publish(self, trials: list[Any]) -> None:
        from raydeck.observability.metrics import TRIAL_STATES

        counts = dict.fromkeys(TRIAL_STATES, 0)
        with self._lock:
            for trial in trials:
                outcome = self._outcomes.get(trial.trial_id)
                state = outcome.status if outcome else _TUNE_STATES.get(trial.status, "running")
                counts[state] += 1
            best = self._best
        try:
            self._metrics.trial_states(counts)
            if best is not None:
                self._metrics.best_score(best)
        except Exception as exc:  # metrics must never fail a sweep
            logger.debug("could not export sweep metrics: %s", exc)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._metrics.close()


def end_child_run(config: SweepConfig, namespace: str, trial_id: str, outcome: TrialOutcome,
                  wait_s: float | None) -> Any:
    """End a trial's child run with ``outcome`` (status tags and MLflow status).

    Through the tracking proxy's router, which also releases the trial's processes from the
    run. ``None`` returns the pending reference (it resolves to False if the router does not
    know the run), a number waits that long. Never raises: a failure here must not fail the
    trial in Tune (the summary awaits every trial's record and writes what did not land).
    """
    import ray

    from raydeck.tracking.proxy.actors import find_router

    try:
        router = find_router(namespace)
        if router is None:
            raise RuntimeError("tracking proxy not running")
        ref = router.end_run.remote(config.trial_key(trial_id), outcome.run_status,
                                    outcome.tags())
        if wait_s:
            ray.get(ref, timeout=wait_s)
        return ref
    except Exception as exc:
        logger.warning("could not mark trial %s %s yet: %s", trial_id, outcome.status,
                       redact_text(str(exc)))
        return None


def _wait_all(refs: list[Any], deadline: float) -> None:
    import ray

    if not refs:
        return
    with contextlib.suppress(Exception):
        ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))


def _iteration(result: Mapping[str, Any] | None) -> int:
    return int((result or {}).get("training_iteration", 0) or 0)


@contextlib.contextmanager
def monitoring(monitor: SweepMonitor) -> Iterator[SweepMonitor]:
    """Make ``monitor`` the live monitor of its sweep in this process while the block runs."""
    key = monitor.config.key
    with _live_lock:
        _live[key] = monitor
    try:
        yield monitor
    finally:
        with _live_lock:
            if _live.get(key) is monitor:
                del _live[key]
        monitor.close()


def live_monitor(sweep_key: str) -> SweepMonitor | None:
    with _live_lock:
        return _live.get(sweep_key)


def tune_callback(sweep_key: str) -> Any:
    """The Tune callback that feeds the live monitor of ``sweep_key`` (pickles as the key)."""
    from ray.tune import Callback

    class SweepMonitorCallback(Callback):
        def __init__(self, key: str) -> None:
            self.key = key

        def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            monitor = live_monitor(self.key)
            if monitor is not None:
                monitor.trial_started(trial.trial_id, trials)

        def on_trial_result(self, iteration: int, trials: list, trial: Any,
                            result: dict[str, Any], **info: Any) -> None:
            monitor = live_monitor(self.key)
            if monitor is not None:
                monitor.trial_result(trial.trial_id, result, trials)

        def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any
                              ) -> None:
            monitor = live_monitor(self.key)
            if monitor is not None:
                monitor.trial_completed(trial.trial_id, trial.last_result, trials)

        def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            monitor = live_monitor(self.key)
            if monitor is not None:
                monitor.trial_errored(trial.trial_id, _trial_error(trial), trials)

    return SweepMonitorCallback(sweep_key)


def _trial_error(trial: Any) -> BaseException | str | None:
    """The exception Tune saved for a failed trial (on the driver's disk, just written)."""
    import ray.cloudpickle as cloudpickle

    path = getattr(trial, "pickled_error_file", None)
    try:
        if path:
            with open(path, "rb") as file:
                error = cloudpickle.load(file)
            if isinstance(error, BaseException):
                return error
        text = getattr(trial, "error_file", None)
        if text:
            with open(text) as file:
                lines = [line for line in file.read().splitlines()[1:] if line.strip()]
                return lines[-1] if lines else None
    except Exception as exc:
        logger.debug("could not read the error of trial %s: %s", trial.trial_id, exc)
    return None
