"""The queue's configuration: its policy, the policy's aging bound (the starvation bound), the
``las`` levels' thresholds, the minimum run between two preemptions of a job, and the teams
file, stored with its jobs (:class:`~raydeck.scheduling.queue.store.Store`, so a restarted queue
actor keeps them), and the policy object they make. The admins are not among them: the head's
:class:`~raydeck.scheduling.queue.access.AdminsFile` names them, read at each use.

Owns: reading the settings, changing them (a
:class:`~raydeck.scheduling.queue.config_change.ConfigChange`, allowed only to an admin,
:func:`~raydeck.scheduling.queue.access.check_configure`: a refused or bad change changes nothing),
:meth:`QueueConfig.describe` (what ``raydeck queue`` shows of them) and
:meth:`QueueConfig.policy`, which makes the policy and replays the usage fair share
remembers. Does not own the lock: the queue (:mod:`raydeck.scheduling.queue.job_queue`) holds its
own around a change and the policy it then makes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from raydeck.observability.prometheus import prometheus_duration
from raydeck.scheduling.policies.attained_service import (
    MIN_HISTORY,
    Durations,
    Gittins,
    LeastAttainedService,
    adaptive_thresholds,
)
from raydeck.scheduling.policies.core import DEFAULT_AGING_S, Policy, RunningJob
from raydeck.scheduling.policies.preemption import MIN_RUN_BEFORE_PREEMPTION_S
from raydeck.scheduling.policies.registry import make_policy
from raydeck.scheduling.queue import access
from raydeck.scheduling.queue.config_change import ConfigChange
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.jobspec import ADMINS_KEY, Team, TeamsFile
from raydeck.scheduling.queue.reconcile import queued
from raydeck.scheduling.queue.store import Store

DEFAULT_POLICY = "fifo"
# The ended jobs whose usage fair share replays at start: 48 of its 1 h half-lives, after which
# a job's usage weighs 2**-48 of what it did.
REPLAY_S = 48 * 3600.0


class QueueConfig:
    """The configuration in ``store``; ``clock``: the queue's (what ended lately is replayed);
    ``durations``: what a ``gittins`` policy ranks by (the queue's MLflow history);
    ``admins``: the head's file naming the queue's admins (None: the queue has none)."""

    def __init__(self, store: Store, clock: Callable[[], float],
                 durations: Durations | None = None,
                 admins: access.AdminsFile | None = None) -> None:
        self._store = store
        self._clock = clock
        self._durations = durations
        self._admins = admins

    def teams_file(self) -> TeamsFile:
        """The stored teams file with the queue's admins (the head's, whatever a file said).

        Raises:
            ConfigError: the head's admins file is unsafe (:meth:`AdminsFile.read`).
        """
        return TeamsFile(self.teams(), self._admins.read() if self._admins is not None
                         else frozenset())

    def teams(self) -> Mapping[str, Team]:
        """The stored teams file's teams (what needs no admins: the policy, the listing)."""
        return TeamsFile.parse(self._store.setting("teams", {})).teams

    def policy_name(self) -> str:
        return str(self._store.setting("policy", DEFAULT_POLICY))

    def aging_s(self) -> float:
        return float(self._store.setting("aging_s", DEFAULT_AGING_S))

    def thresholds_s(self) -> tuple[float, ...] | None:
        """``las``' fixed levels (``--thresholds``); None: they adapt to the ended jobs'
        services (:func:`~raydeck.scheduling.policies.attained_service.adaptive_thresholds`)."""
        pinned = self._store.setting("thresholds_s", None)
        return tuple(pinned) if pinned else None  # [] (``--thresholds auto``): adaptive

    def min_run_s(self) -> float:
        return float(self._store.setting("min_run_s", MIN_RUN_BEFORE_PREEMPTION_S))

    def change(self, who: Identity, change: ConfigChange) -> None:
        """Apply ``change`` as ``who``.

        Raises:
            ConfigError: ``who`` is not an admin, or the new teams file names other admins
                than the queue's (nothing is changed).
        """
        new = TeamsFile.parse(change.teams) if change.teams is not None else None
        where = (str(self._admins.path) if self._admins is not None
                 else f"RAYDECK_DATA_DIR/{access.ADMINS_FILE}")
        access.check_configure(who, self.teams_file(), new, where)
        if change.teams is not None:
            self._store.set_setting("teams", {name: spec for name, spec in change.teams.items()
                                              if name != ADMINS_KEY})
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
            pinned = self.thresholds_s()
            services = sorted(self._store.services()) if pinned is None else []
            levels = ",".join(map(prometheus_duration, pinned or adaptive_thresholds(services)))
            words.append(f"thresholds {levels} GPU-time" if pinned else
                         f"thresholds adaptive: {levels} GPU-time" + (
                             f" until {MIN_HISTORY} jobs have ended ({len(services)} have)"
                             if len(services) < MIN_HISTORY else ""))
        words.append(f"min run {prometheus_duration(self.min_run_s())}")
        return "; ".join(words)

    def policy(self) -> Policy:
        """The configured policy, with the usage of what ended in the last ``REPLAY_S``."""
        aging_s = self.aging_s()
        teams = self.teams().values()
        weights = {t.name: t.weight for t in teams}
        quotas = {t.name: t.quota for t in teams if t.quota is not None}
        name = self.policy_name()
        policy: Policy
        # The ended jobs' services: the cluster's history las' levels and gittins adapt to.
        if name == "gittins":
            policy = Gittins(aging_s, quotas, services=self._store.services(),
                             durations=self._durations)
        elif name == "las":
            policy = LeastAttainedService(aging_s, quotas, self.thresholds_s(),
                                          self._store.services())
        else:
            policy = make_policy(name, aging_s, quotas, weights)
        # Fair share remembers usage: replay what ended lately (older usage has decayed).
        for row in self._store.ended_since(self._clock() - REPLAY_S):
            if row.started_at is not None and row.ended_at is not None:
                policy.ended(RunningJob(queued(row), row.started_at), row.ended_at)
        return policy
