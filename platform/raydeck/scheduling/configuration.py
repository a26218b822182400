"""The queue's configuration: its policy, the policy's aging bound and the teams file, stored
with its jobs (:class:`~raydeck.scheduling.store.Store`), and the policy object they make.

Owns: reading them, changing them (validated whole first and allowed only to an admin,
:func:`~raydeck.scheduling.access.check_configure`: a refused or bad change changes nothing)
and :meth:`QueueConfig.policy`, which makes the policy and replays the usage fair share
remembers. Does not own the lock: the queue (:mod:`raydeck.scheduling.queue`) holds its own
around a change and the policy it then makes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from raydeck.errors import ConfigError
from raydeck.scheduling import access
from raydeck.scheduling.attained_service import Durations, Gittins
from raydeck.scheduling.identity import Identity
from raydeck.scheduling.jobspec import TeamsFile
from raydeck.scheduling.policies import DEFAULT_AGING_S, Policy, RunningJob, make_policy
from raydeck.scheduling.reconcile import queued
from raydeck.scheduling.store import Store

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

    def change(self, who: Identity, policy: str | None = None, aging_s: float | None = None,
               teams: Mapping[str, Any] | None = None) -> None:
        """Switch the policy, its aging bound and/or replace the teams file, as ``who``.

        Raises:
            ConfigError: an unknown policy, aging <= 0, a bad teams file, or ``who`` is not an
                admin (nothing is changed).
        """
        new = TeamsFile.parse(teams) if teams is not None else None
        if policy is not None:
            make_policy(policy)  # raises for an unknown name
        if aging_s is not None and not aging_s > 0:
            raise ConfigError(f"--aging={aging_s}: must be > 0 seconds")
        access.check_configure(who, self.teams_file(), new)
        if teams is not None:
            self._store.set_setting("teams", dict(teams))
        if policy is not None:
            self._store.set_setting("policy", policy)
        if aging_s is not None:
            self._store.set_setting("aging_s", aging_s)

    def policy(self) -> Policy:
        """The configured policy, with the usage of what ended in the last ``REPLAY_S``."""
        aging_s = float(self._store.setting("aging_s", DEFAULT_AGING_S))
        teams = self.teams_file().teams.values()
        weights = {t.name: t.weight for t in teams}
        quotas = {t.name: t.quota for t in teams if t.quota is not None}
        name = self.policy_name()
        policy = (Gittins(aging_s, quotas, durations=self._durations) if name == "gittins"
                  else make_policy(name, aging_s, quotas, weights))
        # Fair share remembers usage: replay what ended lately (older usage has decayed).
        for row in self._store.ended_since(self._clock() - REPLAY_S):
            if row.started_at is not None and row.ended_at is not None:
                policy.ended(RunningJob(queued(row), row.started_at), row.ended_at)
        return policy
