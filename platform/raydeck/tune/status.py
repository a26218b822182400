"""Why a trial ended: the statuses a sweep records, and the one policy that decides them.

Owns: the status vocabulary, what each means, how it is written on a trial's child run (tags and
MLflow run status) and :class:`StatusPolicy`, which classifies an ended trial. Does not own:
observing trials (:mod:`raydeck.tune.monitor` feeds the policy) or the scheduler's decisions
(:mod:`raydeck.tune.scheduling` records them).

``completed``      the trial ran to ``max_t`` or its training function returned.
``stopped_early``  the scheduler (ASHA) stopped it at a rung; the rung is recorded.
``errored``        the training function raised; the error's first line is recorded.
``preempted``      the sweep's driver was stopped (SIGTERM from ``ray job stop``, SIGINT) while
                   the trial ran; ``--resume`` continues it from its last checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

COMPLETED = "completed"
STOPPED_EARLY = "stopped_early"
ERRORED = "errored"
PREEMPTED = "preempted"
TRIAL_STATUSES = (COMPLETED, STOPPED_EARLY, ERRORED, PREEMPTED)

TRIAL_STATUS_TAG = "raydeck.trial_status"
STOP_ITERATION_TAG = "raydeck.stop_iteration"
STOPPED_AT_RUNG_TAG = "raydeck.stopped_at_rung"
TRIAL_ERROR_TAG = "raydeck.trial_error"
TRIAL_ID_TAG = "raydeck.trial_id"
RESUMED_TAG = "raydeck.trial_resumed"
SWEEP_TAG = "raydeck.sweep"

# MLflow's run status for each trial status.
RUN_STATUS = {COMPLETED: "FINISHED", STOPPED_EARLY: "FINISHED", ERRORED: "FAILED",
              PREEMPTED: "KILLED"}
ERROR_LINE_MAX_CHARS = 500


@dataclass(frozen=True)
class TrialOutcome:
    """How one trial ended, as its child run records it."""

    status: str
    iteration: int
    rung: int | None = None
    error: str | None = None

    @property
    def run_status(self) -> str:
        return RUN_STATUS[self.status]

    def tags(self) -> dict[str, str]:
        tags = {TRIAL_STATUS_TAG: self.status, STOP_ITERATION_TAG: str(self.iteration)}
        if self.rung is not None:
            tags[STOPPED_AT_RUNG_TAG] = str(self.rung)
        if self.error is not None:
            tags[TRIAL_ERROR_TAG] = self.error
        return tags


class StatusPolicy:
    """Decides a trial's status from what the driver saw.

    A scheduler STOP below ``max_t`` is ``stopped_early`` (ASHA decides only at a rung, so the
    iteration is the rung); a STOP at ``max_t``, Tune's ``max_t`` stop and a training function
    that returned are ``completed``. A trial whose end no driver observed (a resumed sweep whose
    first driver died before recording it) and that ended below ``max_t`` is counted
    ``stopped_early`` only if the scheduler can stop trials at all.
    """

    def __init__(self, max_t: int, scheduler_stops_early: bool) -> None:
        self.max_t = max_t
        self.scheduler_stops_early = scheduler_stops_early

    def ended(self, iteration: int, *, stopped_at: int | None, observed: bool) -> TrialOutcome:
        """A trial that ended without an error at ``iteration``.

        Args:
            stopped_at: the iteration at which the scheduler decided STOP (None: it did not).
            observed: this driver saw the trial end, so a missing STOP means there was none.
        """
        if stopped_at is not None and stopped_at < self.max_t:
            return TrialOutcome(STOPPED_EARLY, iteration, rung=stopped_at)
        if observed or iteration >= self.max_t or not self.scheduler_stops_early:
            return TrialOutcome(COMPLETED, iteration)
        return TrialOutcome(STOPPED_EARLY, iteration, rung=iteration)

    @staticmethod
    def errored(iteration: int, error: BaseException | str | None) -> TrialOutcome:
        return TrialOutcome(ERRORED, iteration, error=error_line(error))

    @staticmethod
    def preempted(iteration: int) -> TrialOutcome:
        return TrialOutcome(PREEMPTED, iteration)


def error_line(error: BaseException | str | None) -> str:
    """The first line of what the training function raised: ``ValueError: bad lr``.

    Ray wraps a trial's exception (``RayTaskError``, Tune's ``StartTraceback``, Ray Train's
    ``WorkerGroupError``); unwrapping stops at the first exception that is not Ray's own, which
    is what the user's code raised.
    """
    if error is None:
        return "unknown error"
    if isinstance(error, str):
        text = error
    else:
        cause = _unwrap(error)
        message = str(cause).strip()
        text = f"{type(cause).__name__}: {message}" if message else type(cause).__name__
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return (lines[0] if lines else "unknown error")[:ERROR_LINE_MAX_CHARS]


def _unwrap(error: BaseException) -> BaseException:
    seen: set[int] = set()
    while type(error).__module__.startswith("ray.") and id(error) not in seen:
        seen.add(id(error))
        failures = getattr(error, "worker_failures", None)
        inner = (next(iter(failures.values()), None) if isinstance(failures, dict) else None) or \
            getattr(error, "cause", None) or error.__cause__
        if not isinstance(inner, BaseException):
            break
        error = inner
    return error
