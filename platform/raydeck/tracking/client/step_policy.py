"""The tracker's metrics and step policy (part of
:class:`~raydeck.tracking.client.tracker.Tracker`).

Step policy: one step counter per tracker, like W&B. A call without ``step`` logs all its values
at the tracker's current step and then advances it by one; ``step=N`` logs at ``N`` and moves the
counter to ``N + 1`` if it was lower. So metrics logged at different rates share one x-axis.

Owns: :class:`StepPolicy`, the ``log_metric(s)`` half of the tracker (validation, the step
counter, steps already logged before a restart, the mode's key names) and counting what a
lenient call changed or dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from raydeck.errors import TrackingValidationError
from raydeck.tracking.client import validation
from raydeck.tracking.client.delivery import Delivery
from raydeck.tracking.client.modes import ModePolicy
from raydeck.tracking.messages import Point

logger = logging.getLogger(__name__)


class StepPolicy:
    """Mixin of :class:`~raydeck.tracking.client.tracker.Tracker`: metrics at the tracker's
    steps."""

    _lock: threading.RLock
    _policy: ModePolicy
    _keep_nonfinite: bool
    _keys: dict[str, str]
    _next_step: int
    _logged_through: dict[str, int]
    _warned: set[tuple[str, str]]
    _sanitized: int
    _dropped: int

    if TYPE_CHECKING:
        @property
        def _delivery(self) -> Delivery: ...

        @property
        def run_key(self) -> str: ...

        def flush(self, timeout_s: float | None = None) -> None: ...

    def log_metric(self, key: str, value: float, step: int | None = None,
                   synchronous: bool | None = None, timestamp: int | None = None,
                   *, strict: bool = True) -> None:
        """Log one metric value. See :meth:`log_metrics`.

        The common case (a key logged before, a finite float, an explicit step, no steps of an
        earlier attempt to skip) goes straight to the buffer: this is the cost of every
        ``mlflow.log_metric`` call through the plugin. Everything else takes
        :meth:`log_metrics`' path, which raises or corrects exactly as that documents.
        """
        final = self._keys.get(key)
        if (final is None or type(value) is not float or value - value != 0.0
                or type(step) is not int or step < 0 or self._logged_through or synchronous):
            self.log_metrics({key: value}, step, synchronous, timestamp, strict=strict)
            return
        stamp = int(time.time() * 1000) if timestamp is None else int(timestamp)
        with self._lock:
            if self._next_step <= step:
                self._next_step = step + 1
        self._delivery.add_points([(final, value, stamp, step)])

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
