"""Every policy by its name: what ``raydeck queue --policy``, the queue's settings and the
simulator's ``--policy`` accept.

Its own module because it names policies of both :mod:`~raydeck.scheduling.policies.core` and
:mod:`~raydeck.scheduling.policies.attained_service`, which builds on ``core``: kept in ``core``,
it had to import ``attained_service`` inside a function, a cycle that only hid.
"""

from __future__ import annotations

from collections.abc import Mapping

from raydeck.errors import ConfigError
from raydeck.scheduling.policies.attained_service import Gittins, LeastAttainedService
from raydeck.scheduling.policies.core import (
    DEFAULT_AGING_S,
    Backfill,
    FairShare,
    Fifo,
    Policy,
    PriorityAging,
    ShortestJobFirst,
)
from raydeck.scheduling.policies.resources import Resources

POLICIES = ("fifo", "priority", "sjf", "fairshare", "las", "gittins", "backfill")


def make_policy(name: str, aging_s: float = DEFAULT_AGING_S,
                quotas: Mapping[str, Resources] | None = None,
                weights: Mapping[str, float] | None = None) -> Policy:
    """A policy by name (``raydeck queue --policy``, the simulator's ``--policy``), holding
    ``quotas``; fair share weighs teams by ``weights``.

    Raises:
        ConfigError: an unknown name, listing the known ones.
    """
    base = name.removeprefix("backfill-") if name != "backfill" else "fifo"
    if base == "fifo":
        policy: Policy = Fifo(aging_s, quotas)
    elif base == "priority":
        policy = PriorityAging(aging_s, quotas)
    elif base == "sjf":
        policy = ShortestJobFirst(aging_s, quotas)
    elif base == "fairshare":
        policy = FairShare(weights, quotas, aging_s=aging_s)
    elif base in ("las", "gittins") and base == name:  # they preempt rather than reserve
        kind = LeastAttainedService if base == "las" else Gittins
        policy = kind(aging_s, quotas)
    else:
        raise ConfigError(f"policy {name!r} is not one of {', '.join(POLICIES)} "
                          "(or backfill-<policy> but las and gittins)")
    return Backfill(policy) if base != name or name == "backfill" else policy
