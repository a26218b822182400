"""What each caller may do to the queue: who may submit to a team and at which priority, who
may cancel or reprioritize a job, who may change the teams file and the policy.

Owns: the rules, each a function that returns when the call is allowed and raises
:class:`~raydeck.errors.ConfigError` naming the field and the fix when it is not. The queue
(:mod:`raydeck.scheduling.queue.job_queue`) applies them to the caller's
:class:`~raydeck.scheduling.queue.identity.Identity` and the stored
:class:`~raydeck.scheduling.queue.jobspec.TeamsFile`:

* **submit**: to a team that lists ``members``, only its members or an admin; at most the
  team's ``max_priority`` (the unknown-team check is
  :func:`~raydeck.scheduling.queue.jobspec.admit`).
* **cancel, reprioritize**: the job's submitter, a member of its team, or an admin. A job queued
  by a raydeck that recorded no submitter may be changed by anyone.
* **configure** (teams file, policy, aging): an admin. Until a teams file names admins there
  are none, and anyone may; a new file that names admins must name the caller among them (else
  they would lock themselves out by mistake).

Who is an admin, a member and how high a team may go are the teams file's: without one, only a
job's submitter may cancel it and priorities are unbounded.
"""

from __future__ import annotations

from raydeck.errors import ConfigError
from raydeck.scheduling.queue.identity import Identity
from raydeck.scheduling.queue.jobspec import ADMINS_KEY, JobSpec, TeamsFile
from raydeck.scheduling.queue.store import JobRow

_ASK_ADMIN = "ask an admin to change the teams file"


def _admins(teams: TeamsFile) -> str:
    return ", ".join(sorted(teams.admins)) or "none: the teams file names no admins"


def check_submit(who: Identity, spec: JobSpec, teams: TeamsFile) -> None:
    """``who`` may queue ``spec`` in its team at its priority."""
    team = teams.teams.get(spec.team)
    if team is None or who.user in teams.admins:
        return
    if team.members and who.user not in team.members:
        raise ConfigError(f"--team {spec.team}: user {who.user} is not one of its members "
                          f"({', '.join(sorted(team.members))}); use your own team, or "
                          f"{_ASK_ADMIN} ({_admins(teams)})")
    check_priority(who, spec.priority, spec.team, teams)


def check_priority(who: Identity, priority: int, team_name: str, teams: TeamsFile) -> None:
    """``priority`` is within team ``team_name``'s ``max_priority`` (admins are not bound:
    they could change the file anyway)."""
    team = teams.teams.get(team_name)
    if who.user in teams.admins:
        return
    if team is not None and team.max_priority is not None and priority > team.max_priority:
        raise ConfigError(f"--priority={priority}: team {team_name}'s max_priority is "
                          f"{team.max_priority}; use {team.max_priority} or less, or "
                          f"{_ASK_ADMIN} ({_admins(teams)})")


def check_change(who: Identity, row: JobRow, what: str, teams: TeamsFile) -> None:
    """``who`` may ``what`` (``cancel``, ``reprioritize``) the job of ``row``."""
    team = teams.teams.get(row.team)
    if (not row.user or who.user == row.user or who.user in teams.admins
            or (team is not None and who.user in team.members)):
        return
    raise ConfigError(f"{what} {row.id}: user {who.user} may not; it was submitted by "
                      f"{row.user}@{row.host} for team {row.team}, and only its submitter, "
                      f"team {row.team}'s members or an admin ({_admins(teams)}) may {what} it")


def check_configure(who: Identity, current: TeamsFile, new: TeamsFile | None) -> None:
    """``who`` may change the queue's settings (to teams file ``new``, when given)."""
    if current.admins and who.user not in current.admins:
        raise ConfigError(f"--teams/--policy/--aging: only the queue's admins "
                          f"({_admins(current)}) may change them, not user {who.user}; "
                          "ask one of them")
    if new is not None and new.admins and who.user not in new.admins:
        raise ConfigError(f"--teams: the file's {ADMINS_KEY} ({_admins(new)}) do not include "
                          f"you ({who.user}), so you could not change it again; add yourself")
