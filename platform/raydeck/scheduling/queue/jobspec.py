"""What a client queues: :class:`JobSpec` (one job, what it needs and who submitted it) and
:class:`Team` (who shares the cluster: a fair-share weight, an optional quota, its members and
the highest priority its jobs may have).

Owns: validating both where they are made, so the queue (:mod:`raydeck.scheduling.queue.job_queue`)
stores only jobs and teams it can schedule. Who may do what with them:
:mod:`raydeck.scheduling.queue.identity`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from raydeck.errors import ConfigError
from raydeck.scheduling.policies.core import Capacity
from raydeck.scheduling.policies.resources import Gang, Resources
from raydeck.scheduling.queue.identity import Identity, users

DEFAULT_TEAM = "default"
_TEAM_NAME = re.compile(r"^[a-z0-9][a-z0-9_\-]{0,63}$")
# The teams file's key naming its admins (so no team may be called that).
ADMINS_KEY = "admins"
_TEAM_KEYS = ("weight", "gpus", "cpus", "members", "max_priority")


@dataclass(frozen=True)
class Team:
    """A team sharing the cluster: its fair-share weight, optional quota, its members (OS user
    names that may submit to it and cancel or reprioritize its jobs; empty: anyone may submit
    to it) and ``max_priority``, the highest ``--priority`` its jobs may have (None: no
    bound)."""

    name: str
    weight: float = 1.0
    quota: Resources | None = None
    members: frozenset[str] = frozenset()
    max_priority: int | None = None

    def __post_init__(self) -> None:
        team_name(self.name, "team")
        if not self.weight > 0:
            raise ConfigError(f"team {self.name}: weight={self.weight} must be > 0")
        if self.max_priority is not None and self.max_priority < 0:
            raise ConfigError(f"team {self.name}: max_priority={self.max_priority} must be "
                              ">= 0")

    @classmethod
    def parse(cls, name: str, spec: Mapping[str, Any]) -> Team:
        """A team from ``{weight: 2, gpus: 4, cpus: 32, members: [ana, bo], max_priority: 5}``
        (the teams file's entries)."""
        if not isinstance(spec, Mapping):
            raise ConfigError(f"team {name}: must map {', '.join(_TEAM_KEYS)} to values")
        unknown = set(spec) - set(_TEAM_KEYS)
        if unknown:
            raise ConfigError(f"team {name}: unknown key(s) {', '.join(sorted(unknown))}; "
                              f"a team has {', '.join(_TEAM_KEYS)}")
        quota = (Resources(float(spec.get("cpus", float("inf"))),
                           float(spec.get("gpus", float("inf"))))
                 if "gpus" in spec or "cpus" in spec else None)
        bound = spec.get("max_priority")
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int)):
            raise ConfigError(f"team {name}: max_priority={bound!r} must be a whole number")
        return cls(name, float(spec.get("weight", 1.0)), quota,
                   users(spec.get("members", []), f"team {name}: members"), bound)


@dataclass(frozen=True)
class TeamsFile:
    """The teams file (``raydeck queue --teams FILE``): each team by name, and ``admins``, the
    users who may change it and cancel or reprioritize any job. The queue's admins are the
    head's (:class:`~raydeck.scheduling.queue.access.AdminsFile`), which the queue puts here;
    a file's own reserved key ``admins: [ana]`` is parsed only so that the queue can refuse a
    file naming other admins than its own."""

    teams: Mapping[str, Team] = field(default_factory=dict)
    admins: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> TeamsFile:
        """The file's YAML mapping, validated whole (a bad entry raises ConfigError)."""
        return cls({name: Team.parse(name, spec) for name, spec in raw.items()
                    if name != ADMINS_KEY},
                   users(raw.get(ADMINS_KEY, []), f"teams file: {ADMINS_KEY}"))


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
    # Made in the process that submits (the CLI): its OS user and host.
    submitter: Identity = field(default_factory=Identity.here)

    def __post_init__(self) -> None:
        team_name(self.team, "--team")
        if self.priority < 0:
            raise ConfigError(f"--priority={self.priority}: must be >= 0 (higher runs first)")
        if self.estimate_s is not None and not self.estimate_s > 0:
            raise ConfigError(f"--estimate={self.estimate_s}: must be > 0 seconds")


def team_name(name: str, where: str) -> None:
    """Refuse a team name that is not 1-64 of a-z 0-9 _ - (``where``: how the user gave it).
    Team names become metric labels; the teams file bounds which exist
    (:func:`admit`)."""
    if not isinstance(name, str) or not _TEAM_NAME.match(name):
        raise ConfigError(f"{where} {name!r}: use 1-64 of a-z 0-9 _ -, starting with a letter "
                          "or digit")


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
