"""raydeck's error types.

Every error a user can fix derives from :class:`RaydeckError`. The CLI turns these into one clear
line and exit code 2 (tracebacks only with ``--debug``); library callers catch them by type.
Messages name the field, the value and the fix, because the person reading them is usually
looking at a job log on a cluster, not at our source.

Two guarantees hold for every class here, subclasses included:

- **Messages never carry a secret.** The message is passed through
  :func:`raydeck._internal.redaction.redact_text` when the error is built, so URL user-info,
  secret-named values and known secret values are masked in ``str(exc)``, in ``exc.args`` and in
  every traceback and log line that shows it.
- **Errors cross processes intact.** Ray pickles an exception raised in a task, an actor or a
  Ray Train worker and re-raises it on the caller. Pickling rebuilds an exception by calling
  its class with ``exc.args``, which fails for a constructor whose arguments are not its message
  (``TrackingValidationError(problems)``); :meth:`RaydeckError.__reduce__` restores the
  instance from its ``args`` and attributes instead, without calling the constructor, so any
  signature round-trips with its message.
"""

from __future__ import annotations

from typing import Any

from raydeck._internal.redaction import redact_text


def _restore(cls: type[RaydeckError], args: tuple[Any, ...], state: dict[str, Any]
             ) -> RaydeckError:
    """Rebuild a pickled raydeck error without calling its constructor."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class RaydeckError(Exception):
    """Base class for errors a user can act on."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*(redact_text(arg) if isinstance(arg, str) else arg for arg in args))

    def __reduce__(self) -> tuple[Any, ...]:
        return _restore, (type(self), self.args, self.__dict__)


class ConfigError(RaydeckError, ValueError):
    """A setting, preset, file or argument has a value raydeck cannot use."""


class PresetError(ConfigError):
    """A scaling preset is unknown or invalid."""


class InfeasibleResourcesError(RaydeckError):
    """The cluster can never satisfy a resource request (it would pend forever)."""


class ClusterUnavailableError(RaydeckError):
    """The Ray cluster (or its job server) cannot be reached."""


class TrackingUnavailableError(RaydeckError):
    """The tracking proxy or the MLflow server behind it cannot be reached."""


class TrackingValidationError(RaydeckError, ValueError):
    """Values passed to a tracker break a rule; the good values of the same call were kept.

    ``problems`` maps each rejected key to the rule it broke.
    """

    def __init__(self, problems: dict[str, str]) -> None:
        self.problems = dict(problems)
        detail = "; ".join(f"{key!r}: {rule}" for key, rule in self.problems.items())
        super().__init__(f"rejected {len(self.problems)} value(s) (others were kept): {detail}")


class TrackingWriteError(RaydeckError):
    """MLflow permanently refused some logged values (they were isolated; the rest landed)."""


class StorageError(RaydeckError):
    """Object storage is unreachable, refuses the credentials or lacks a bucket."""


class MonitoringError(RaydeckError):
    """Prometheus or Grafana cannot be reached or refuses the request (URL or token)."""


class QueryError(MonitoringError):
    """Prometheus rejected a PromQL expression (the message holds Prometheus' reason)."""


class JobSubmissionError(RaydeckError):
    """A job cannot run on the cluster as asked (e.g. the cluster's Python lacks raydeck)."""


class TrackingSpoolFullError(TrackingUnavailableError):
    """The tracking proxy's spool disk is full: data waits in the logging process for room."""


class StackError(RaydeckError):
    """A service of the one-machine stack (``raydeck up``) cannot start, or its state is unusable.

    The message starts with the service's name and ends with the fix.
    """


class SweepInterruptedError(RaydeckError):
    """A sweep's driver was stopped (SIGTERM, SIGINT) while trials ran; they were marked
    ``preempted`` and ``--resume`` continues them."""


class SweepFinalizeError(RaydeckError):
    """Every trial of a sweep ended, but its summary or registry step failed; the trials' runs
    and checkpoints are intact and ``--resume`` redoes the step."""


class JobPreemptedError(RaydeckError):
    """raydeck's job queue asked the job to stop for a higher-priority one and it stopped at a
    committed checkpoint; the queue starts it again and it resumes there, in the same run."""
