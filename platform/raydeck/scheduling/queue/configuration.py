"""The queue's configuration: its policy, the policy's aging bound (the starvation bound), the
``las`` levels' thresholds, the minimum run between two preemptions of a job, and the teams
file, stored with its jobs (:class:`~raydeck.scheduling.queue.store.Store`, so a restarted queue
actor keeps them), and the policy object they make.

Owns: reading the settings, changing them (a
:class:`~raydeck.scheduling.queue.config_change.ConfigChange`, allowed only to an admin,
:func:`~raydeck.scheduling.queue.access.check_configure`: a refused or bad change changes nothing),
:meth:`QueueConfig.describe` (what ``raydeck queue`` shows of them) and
:meth:`QueueConfig.policy`, which makes the policy and replays the usage fair share
remembers. Does not own the lock: the queue (:mod:`raydeck.scheduling.queue.job_queue`) holds its
own around a change and the policy it then makes.
"""

from __future__ import annotations

from collections.abc import Callable

from raydeck.observability.prometheus import prometheus_duration
from raydeck.scheduling.policies.attained_service import (
    DEFAULT_THRESHOLDS,
    Durations,
    Gittins,
    LeastAttainedService,
)
from raydeck.scheduling.policies.core import DEFAULT_AGING_S, Policy, RunningJob
from raydeck.scheduling.policies.preemption import MIN_RUN_BEFORE_PREEMPTION_S
from raydeck.scheduling.policies.registry import make_policy
from raydeck.scheduling.queue import access
from raydeck.scheduling.queue.config_change import ConfigChange
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.jobspec import TeamsFile
from raydeck.scheduling.queue.reconcile import queued
from raydeck.scheduling.queue.store import Store

DEFAULT_POLICY = "fifo"
# The ended jobs whose usage fair share replays at start: 48 of its 1 h half-lives, after which
# a job's usage weighs 2**-48 of what it did.
REPLAY_S = 48 * 3600.0


class QueueConfig:
    """The configuration in ``store``; ``clock``: the queue's (what ended lately is replayed);
    ``durations``: what a ``gittins`` policy ranks by (the queue's MLflow history)."""

    def __init__(self, store: Store, clock: Callable[[], float],
                 durations: Durations | None = None) -> None:
        self._store = store
        self._clock = clock
        self._durations = durations

    def teams_file(self) -> TeamsFile:
        return TeamsFile.parse(self._store.setting("teams", {}))

    def policy_name(self) -> str:
        return str(self._store.setting("policy", DEFAULT_POLICY))

    def aging_s(self) -> float:
        return float(self._store.setting("aging_s", DEFAULT_AGING_S))

    def thresholds_s(self) -> tuple[float, ...]:
        return tuple(self._store.setting("thresholds_s", DEFAULT_THRESHOLDS))

    def min_run_s(self) -> float:
        return float(self._store.setting("min_run_s", MIN_RUN_BEFORE_PREEMPTION_S))

    def change(self, who: Identity, change: ConfigChange) -> None:
        """Apply ``change`` as ``who``.

        Raises:
            ConfigError: ``who`` is not an admin (nothing is changed).
        """
        new = TeamsFile.parse(change.teams) if change.teams is not None else None
        access.check_configure(who, self.teams_file(), new)
        if change.teams is not None:
            self._store.set_setting("teams", dict(change.teams))
        if change.policy is not None:
            self._store.set_setting("policy", change.policy)
        if change.aging_s is not None:
            self._store.set_setting("aging_s", change.aging_s)
        if change.thresholds_s is not None:
            self._store.set_setting("thresholds_s", list(change.thresholds_s))
        if change.min_run_s is not None:
            self._store.set_setting("min_run_s", change.min_run_s)

    def describe(self) -> str:
        """The settings in words, for ``raydeck queue``'s title, each in the form its option
        takes: the policy, its starvation bound (``--aging``), ``las``' thresholds and the
        minimum run between two preemptions of a job (every policy preempts for priority)."""
        name = self.policy_name()
        words = [f"policy {name}", f"aging {prometheus_duration(self.aging_s())}"]
        if name == "las":
            words.append("thresholds " + ",".join(map(prometheus_duration, self.thresholds_s()))
                         + " GPU-time")
        words.append(f"min run {prometheus_duration(self.min_run_s())}")
        return "; ".join(words)

    def policy(self) -> Policy:
        """The configured policy, with the usage of what ended in the last ``REPLAY_S``."""
        aging_s = self.aging_s()
        teams = self.teams_file().teams.values()
        weights = {t.name: t.weight for t in teams}
        quotas = {t.name: t.quota for t in teams if t.quota is not None}
        name = self.policy_name()
        policy: Policy
        if name == "gittins":
            policy = Gittins(aging_s, quotas, durations=self._durations)
        elif name == "las":
            policy = LeastAttainedService(aging_s, quotas, self.thresholds_s())
        else:
            policy = make_policy(name, aging_s, quotas, weights)
        # Fair share remembers usage: replay what ended lately (older usage has decayed).
        for row in self._store.ended_since(self._clock() - REPLAY_S):
            if row.started_at is not None and row.ended_at is not None:
                policy.ended(RunningJob(queued(row), row.started_at), row.ended_at)
        return policy
