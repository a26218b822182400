"""What each caller may do to the queue: who may submit to a team and at which priority, who
may cancel or reprioritize a job, who may change the queue's settings, which process may report
a job's checkpoints, stop and completion, and who the admins are.

Owns: the rules, each a function that returns when the call is allowed and raises
:class:`~raydeck.errors.ConfigError` naming the field and the fix when it is not, and
:class:`AdminsFile`, where the admins come from. The queue
(:mod:`raydeck.scheduling.queue.job_queue`) applies them to the caller's
:class:`~raydeck.scheduling.queue.identity.Identity`, the stored
:class:`~raydeck.scheduling.queue.jobspec.TeamsFile` and the admins:

* **submit**: to a team that lists ``members``, only its members or an admin; at most the
  team's ``max_priority`` (the unknown-team check is
  :func:`~raydeck.scheduling.queue.jobspec.admit`).
* **cancel, reprioritize**: the job's submitter, a member of its team, or an admin. A job queued
  by a raydeck that recorded no submitter may be changed by anyone.
* **configure** (teams file, policy, aging...): an admin; anyone while the queue has none.
* **a job's own calls** (checkpointed, preempted, completed): only with the token of the job's
  current attempt (:func:`is_current_attempt`), which the queue issued when it queued that
  attempt and set in its runtime env alone.

Admins are the head's choice, never a caller's: the user names in :data:`ADMINS_FILE` in the
head's data dir, a file only the head's account may write (:class:`AdminsFile`). A teams file
cannot name them: one whose ``admins:`` differ is refused. Members and ``max_priority`` are the
teams file's: without one, only a job's submitter (or an admin) may cancel it and priorities are
unbounded.

What these rules are worth is the identity's worth (:mod:`raydeck.scheduling.queue.identity`):
they stop mistakes and one user acting as another through raydeck's commands, not someone who
runs their own code on the cluster (docs/scheduling.md, "Identity and limits").
"""

from __future__ import annotations

import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from raydeck._internal.contract import QUEUE_TOKEN_ENV
from raydeck.errors import ConfigError
from raydeck.scheduling.queue.identity import Identity, users
from raydeck.scheduling.queue.jobspec import ADMINS_KEY, JobSpec, TeamsFile
from raydeck.scheduling.queue.store import JobRow

# The queue's admins: a file in the head's RAYDECK_DATA_DIR, one or more user names a line.
ADMINS_FILE = "queue-admins"
_ASK_ADMIN = "ask an admin to change the teams file"


@dataclass(frozen=True)
class AdminsFile:
    """The queue's admins: the user names in ``path`` on the head (whitespace or commas between
    them, ``#`` to the end of a line a comment). Read at each call that needs them, so the head's
    account changes them without restarting anything. No file, or no name in it: no admins, and
    anyone may change the queue's settings (one user's cluster)."""

    path: Path

    def read(self) -> frozenset[str]:
        """The admins named in the file.

        Raises:
            ConfigError: the file is not a regular file, is owned by another account than the
                head's (or root), or may be written by its group or others: anyone could then
                make themselves an admin, so no call that needs the admins is answered until
                it is fixed.
        """
        try:
            # Non-blocking: a FIFO put there would otherwise hold the call forever.
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return frozenset()
        except OSError as exc:
            raise ConfigError(f"the queue's admins file {self.path} cannot be read on the head "
                              f"({exc.strerror}); let the head's account read it") from None
        with os.fdopen(fd, encoding="utf-8") as handle:
            info = os.fstat(handle.fileno())  # the file read, not whatever the path names now
            head = os.getuid()
            if not stat.S_ISREG(info.st_mode):
                raise ConfigError(f"the queue's admins file {self.path} is not a regular file; "
                                  "replace it with one naming the admins")
            if info.st_uid not in (head, 0):
                raise ConfigError(f"the queue's admins file {self.path} is owned by uid "
                                  f"{info.st_uid}, not the head's account (uid {head}): anyone "
                                  "with that account could name the admins; write it again as "
                                  "the head's account")
            if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise ConfigError(f"the queue's admins file {self.path} may be written by its "
                                  f"group or others (mode {stat.filemode(info.st_mode)}); "
                                  f"`chmod go-w {self.path}` on the head")
            text = handle.read()
        names = [name for line in text.splitlines()
                 for name in line.split("#", 1)[0].replace(",", " ").split()]
        return users(names, f"the queue's admins file {self.path}")


def _admins(teams: TeamsFile) -> str:
    return ", ".join(sorted(teams.admins)) or "none: the queue has no admins"


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


def check_configure(who: Identity, current: TeamsFile, new: TeamsFile | None,
                    admins_file: str) -> None:
    """``who`` may change the queue's settings (to teams file ``new``, when given);
    ``current.admins`` are the queue's admins, named in ``admins_file`` on the head."""
    if current.admins and who.user not in current.admins:
        raise ConfigError(f"--teams/--policy/--aging: only the queue's admins "
                          f"({_admins(current)}) may change them, not user {who.user}; "
                          "ask one of them")
    if new is not None and new.admins and new.admins != current.admins:
        raise ConfigError(f"--teams: the file's {ADMINS_KEY} ({', '.join(sorted(new.admins))}) "
                          f"are not the queue's ({_admins(current)}): a teams file does not "
                          f"choose them, {admins_file} on the head does; remove "
                          f"`{ADMINS_KEY}:` from the teams file")


def is_current_attempt(row: JobRow, token: object) -> bool:
    """Whether ``token`` is the token of ``row``'s current attempt (compared in constant time:
    the answer says nothing of how much of it was right)."""
    return isinstance(token, str) and secrets.compare_digest(row.token.encode(),
                                                             token.encode())


def check_attempt(row: JobRow, token: object, what: str) -> None:
    """The call reporting ``what`` of ``row``'s job carries its current attempt's token."""
    if not is_current_attempt(row, token):
        raise ConfigError(f"{what} {row.id}: refused, the call does not carry the token of its "
                          f"current attempt {row.submission_id}; only that attempt's own "
                          f"process reports it ({QUEUE_TOKEN_ENV} in its runtime env)")
