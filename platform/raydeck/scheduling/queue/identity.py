"""Who is calling the queue: :class:`Identity`, the OS account and host a client runs as.

Owns: making and validating an identity (and a list of user names, as the teams file gives its
members and the head its admins). What each identity may do is
:mod:`raydeck.scheduling.queue.access`.

The account is the calling process's own: the name of its uid in the system's user database
(``pwd``), never ``LOGNAME``/``USER`` (which ``getpass.getuser()`` reads first, and which anyone
sets: ``LOGNAME=root raydeck cancel ...`` is still its real user). So through raydeck's commands
a user acts as themselves only. The queue's actor takes the identity a call carries as sent: a
program of one's own that calls the actor through Ray may send any identity, as it may stop any
Ray job; Ray has no access control, and anyone who can run code on the cluster can do anything
there (docs/scheduling.md, "Identity and limits", says what this protects against and what not).

Why the OS account and not a per-user credential: raydeck has no user database to issue, hand
out and revoke them from, and Ray's own auth token is one per cluster, shared by every user: it
says which cluster, not who. Against the threats these rules are for (mistakes, and one user
acting as another through raydeck's commands) the OS account is enough; against someone with
raw Ray access a credential checked by the queue's actor would protect nothing, since they can
replace the actor or edit its database.
"""

from __future__ import annotations

import os
import pwd
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from raydeck.errors import ConfigError

# POSIX-ish user names, and the forms directory services add (``ana.lee``, ``ana@corp``).
_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@$\-]{0,63}$")
_HOST = re.compile(r"^[A-Za-z0-9_.\-]{1,253}$")


@dataclass(frozen=True)
class Identity:
    """The OS account (``user``) a client runs as and its ``host`` (recorded with each job it
    submits; only ``user`` decides what it may do: the same account name on another machine is
    the same user)."""

    user: str
    host: str

    def __post_init__(self) -> None:
        user_name(self.user, "user")
        if not isinstance(self.host, str) or not _HOST.match(self.host):
            raise ConfigError(f"host {self.host!r}: a host name is 1-253 of A-Z a-z 0-9 _ . -")

    @classmethod
    def here(cls) -> Identity:
        """This process's OS account, by its uid (never an environment variable), and host name
        (a uid without an entry in the user database, as in some containers, is ``uid<N>``)."""
        uid = os.getuid()
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            user = f"uid{uid}"
        return cls(user, socket.gethostname() or "localhost")

    def __str__(self) -> str:
        return f"{self.user}@{self.host}"


def user_name(name: object, where: str) -> str:
    """``name`` if it is a valid user name, else ConfigError naming ``where``."""
    if not isinstance(name, str) or not _USER.match(name):
        raise ConfigError(f"{where} {name!r}: a user name is 1-64 of A-Z a-z 0-9 _ . @ $ -")
    return name


def users(names: object, where: str) -> frozenset[str]:
    """A list of user names (a team's ``members``, the queue's admins), validated."""
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise ConfigError(f"{where}: must be a list of user names, e.g. [ana, bo]")
    return frozenset(user_name(name, where) for name in names)
