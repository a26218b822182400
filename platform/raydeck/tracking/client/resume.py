"""The tracker's Ray Train, resume and preemption helpers (part of
:class:`~raydeck.tracking.client.tracker.Tracker`).

Owns: :class:`ResumeHelpers`: ``run_config`` (binds Ray Train workers to the run), ``latest``
and ``last_steps`` (what the proxy holds of the run), ``skip_logged_steps`` (a job restarted
from an older checkpoint drops the repeats, and has the proxy drop them too, whatever the
timing) and ``should_preempt`` (the job queue's answer, read from the training runtime's signal,
:mod:`raydeck.tracking.client.preemption`; the tracker never asks the queue).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import ray

from raydeck.errors import TrackingUnavailableError
from raydeck.tracking.client import preemption
from raydeck.tracking.client.delivery import Delivery
from raydeck.tracking.client.modes import ModePolicy

logger = logging.getLogger(__name__)


class ResumeHelpers:
    """Mixin of :class:`~raydeck.tracking.client.tracker.Tracker`: Ray Train, resume, preemption."""

    _lock: threading.RLock
    _policy: ModePolicy
    _logged_through: dict[str, int]
    _open_delivery: Delivery

    if TYPE_CHECKING:
        @property
        def run_key(self) -> str: ...

        def flush(self, timeout_s: float | None = None) -> None: ...

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
        return self._held_steps(keys, timeout_s, resumed_by=None)

    def _held_steps(self, keys: Iterable[str], timeout_s: float, resumed_by: str | None
                    ) -> dict[str, int]:
        """:meth:`last_steps`; ``resumed_by`` (this tracker's client id) also fences the keys
        at the shard (:mod:`raydeck.tracking.proxy.step_fences`)."""
        self.flush(timeout_s)
        finals = {self._policy.metric_key(key): key for key in keys}
        highest = ray.get(self._open_delivery.shard().last_steps.remote(
            self.run_key, sorted(finals), timeout_s, resumed_by), timeout=timeout_s + 30)
        return {finals[final]: int(step) for final, step in highest.items()}

    def skip_logged_steps(self, keys: Iterable[str], timeout_s: float = 60.0) -> None:
        """From now on, drop values of ``keys`` at steps this run already holds.

        For a job restarted from a checkpoint older than what it had logged: a worker can die
        after logging an epoch but before Ray Train registered that epoch's checkpoint, and the
        restarted job trains the epoch again. The run keeps the first values; the repeats are
        dropped here, on the caller's side, and by the proxy, whatever the timing: a batch the
        dead attempt sent just before it died can reach the proxy after this answer, and then
        each step of ``keys`` keeps one attempt's values, whichever arrived first. Values this
        tracker logs twice at one step are both kept, as MLflow does. Never raises: if the
        proxy cannot answer, nothing is skipped (and a warning says so).
        """
        try:
            steps = self._held_steps(keys, timeout_s, self._open_delivery.client_id)
        except (TrackingUnavailableError, ray.exceptions.RayError) as exc:
            logger.warning("run %s: cannot ask which steps it holds (%s); steps trained again "
                           "may appear twice", self.run_key, type(exc).__name__)
            return
        with self._lock:
            self._logged_through = {self._policy.metric_key(key): step
                                    for key, step in steps.items() if step >= 0}

    def should_preempt(self) -> bool:
        """Whether raydeck's job queue asked this job to stop for a higher-priority one (as
        Determined's ``should_preempt()``): the answer given on a Ray Train worker when the
        last checkpoint was committed, the same on every rank (``report_epoch`` returns it
        too). Return from the training function; the job resumes from that checkpoint in this
        run when the queue starts it again. Always False for a job the queue did not start.
        """
        return preemption.stop_requested()
