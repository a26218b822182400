"""A change to the queue's settings, validated where it is made: in the ``raydeck queue``
command, before anything reaches the queue's actor, and again in the actor.

Owns: :class:`ConfigChange` and :func:`parse_thresholds` (``--thresholds``). Apart from the
queue's configuration (:mod:`raydeck.scheduling.queue.configuration`) because the commands import
it: that module reads the queue's database, and importing SQLAlchemy was half a CPU second of
every queue command (``tests/scheduling/test_queue_client_imports.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from raydeck.errors import ConfigError
from raydeck.observability.prometheus import parse_duration
from raydeck.scheduling.policies.registry import make_policy
from raydeck.scheduling.queue.jobspec import TeamsFile

# ``--thresholds auto``: las' levels adapt to the services of the jobs that ended.
AUTO_THRESHOLDS = "auto"


def parse_thresholds(text: str) -> tuple[float, ...]:
    """``--thresholds``: comma-separated GPU-times (CPU-times for a job without GPUs), each a
    duration (``1h,10h``: 1 then 10 GPU-hours; ``30,300``: seconds), as GPU-seconds; ``auto``
    (an empty tuple): the levels adapt to the services of the jobs that ended (the default).

    Raises:
        ConfigError: a part is not a positive duration (naming it and the form).
    """
    if text.strip().lower() == AUTO_THRESHOLDS:
        return ()
    try:
        return tuple(parse_duration(part) for part in text.split(","))
    except ConfigError:
        raise ConfigError(f"--thresholds={text}: must be comma-separated GPU-times, each a "
                          "positive duration, e.g. 1h,10h (1 then 10 GPU-hours), or auto "
                          "(levels that adapt to the jobs that ended)") from None


@dataclass(frozen=True)
class ConfigChange:
    """A change to the queue's settings; None leaves a setting as it is. Validated whole at
    construction, so a bad change changes nothing.

    Attributes:
        policy: the policy's name (:func:`~raydeck.scheduling.policies.registry.make_policy`).
        aging_s: the starvation bound: a job that has waited this long goes first.
        teams: the teams file (:class:`~raydeck.scheduling.queue.jobspec.TeamsFile`).
        thresholds_s: ``las``' levels, increasing GPU-seconds (CPU-seconds for a job without
            GPUs) of attained service; empty: adaptive again (``--thresholds auto``).
        min_run_s: how long a job resumed after a preemption runs before it may be preempted
            again (:func:`~raydeck.scheduling.policies.preemption.preemptible`).

    Raises:
        ConfigError: an unknown policy, a bad teams file, or a value out of range, naming the
            option and what it accepts.
    """

    policy: str | None = None
    aging_s: float | None = None
    teams: Mapping[str, Any] | None = None
    thresholds_s: Sequence[float] | None = None
    min_run_s: float | None = None

    def __post_init__(self) -> None:
        if self.teams is not None:
            TeamsFile.parse(self.teams)
        if self.policy is not None:
            make_policy(self.policy)  # raises for an unknown name
        if self.aging_s is not None and not self.aging_s > 0:
            raise ConfigError(f"--aging={self.aging_s}: must be > 0 seconds")
        if self.thresholds_s is not None:
            thresholds = tuple(self.thresholds_s)
            if not all(0 < t < math.inf for t in thresholds) \
                    or list(thresholds) != sorted(set(thresholds)):
                raise ConfigError(f"--thresholds={','.join(f'{t:g}s' for t in thresholds)}: "
                                  "must be increasing GPU-times > 0, e.g. 1h,10h")
        if self.min_run_s is not None and not 0 < self.min_run_s < math.inf:
            raise ConfigError(f"--min-run={self.min_run_s}: must be > 0 seconds, e.g. 10m")

    def empty(self) -> bool:
        """Whether it changes nothing."""
        return all(value is None for value in (self.policy, self.aging_s, self.teams,
                                               self.thresholds_s, self.min_run_s))
