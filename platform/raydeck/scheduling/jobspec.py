"""What a client queues: :class:`JobSpec` (one job and what it needs) and :class:`Team` (who
shares the cluster, with a fair-share weight and an optional quota).

Owns: validating both where they are made, so the queue (:mod:`raydeck.scheduling.queue`)
stores only jobs and teams it can schedule.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from raydeck.errors import ConfigError
from raydeck.scheduling.policies import Capacity, Gang, Resources

DEFAULT_TEAM = "default"
_TEAM_NAME = re.compile(r"^[a-z0-9][a-z0-9_\-]{0,63}$")


@dataclass(frozen=True)
class Team:
    """A team sharing the cluster: its fair-share weight and optional quota."""

    name: str
    weight: float = 1.0
    quota: Resources | None = None

    def __post_init__(self) -> None:
        if not _TEAM_NAME.match(self.name):
            raise ConfigError(f"team {self.name!r}: use 1-64 of a-z 0-9 _ -")
        if not self.weight > 0:
            raise ConfigError(f"team {self.name}: weight={self.weight} must be > 0")

    @classmethod
    def parse(cls, name: str, spec: Mapping[str, Any]) -> Team:
        """A team from ``{weight: 2, gpus: 4, cpus: 32}`` (the teams file's entries)."""
        unknown = set(spec) - {"weight", "gpus", "cpus"}
        if unknown:
            raise ConfigError(f"team {name}: unknown key(s) {', '.join(sorted(unknown))}; "
                              "a team has weight, gpus, cpus")
        quota = (Resources(float(spec.get("cpus", float("inf"))),
                           float(spec.get("gpus", float("inf"))))
                 if "gpus" in spec or "cpus" in spec else None)
        return cls(name, float(spec.get("weight", 1.0)), quota)


@dataclass(frozen=True)
class JobSpec:
    """What a client queues: one job for the job server, and what it needs."""

    id: str
    team: str
    priority: int
    preset: str
    needs: Resources
    key: str
    entrypoint: str
    runtime_env: dict[str, Any]
    metadata: dict[str, str] = field(default_factory=dict)
    package_uri: str = ""
    estimate_s: float | None = None
    gang: Gang | None = None

    def __post_init__(self) -> None:
        if self.priority < 0:
            raise ConfigError(f"--priority={self.priority}: must be >= 0 (higher runs first)")
        if self.estimate_s is not None and not self.estimate_s > 0:
            raise ConfigError(f"--estimate={self.estimate_s}: must be > 0 seconds")


def admit(spec: JobSpec, teams: Mapping[str, Team], nodes: tuple[Resources, ...]) -> None:
    """Refuse a job the queue could never start on a cluster of ``nodes`` (each node's total).

    Raises:
        ConfigError: unknown team, a job larger than the cluster (or no placement of its gang
            fits it even idle), or larger than its team's quota.
    """
    if teams and spec.team not in teams:
        raise ConfigError(f"--team {spec.team!r} is not one of the queue's teams: "
                          f"{', '.join(sorted(teams))} (`raydeck queue --teams FILE`)")
    total = Resources.total(nodes)
    if not total.fits(spec.needs):
        raise ConfigError(f"job {spec.id} needs {spec.needs.describe()} but the whole "
                          f"cluster has {total.describe()}: it could never start")
    idle = Capacity(total, nodes)
    if spec.gang is not None and not idle.places(spec.gang):
        raise ConfigError(f"job {spec.id} needs {spec.gang.describe()}, which no placement "
                          f"on the cluster's {len(nodes)} node(s) ({idle.describe_nodes()}) "
                          "holds even when idle: it could never start")
    quota = teams[spec.team].quota if spec.team in teams else None
    if quota is not None and not quota.fits(spec.needs):
        raise ConfigError(f"job {spec.id} needs {spec.needs.describe()}, more than team "
                          f"{spec.team}'s quota of {quota.describe()}")
