"""Who is calling the queue: :class:`Identity`, the OS user and host a client runs as.

Owns: making and validating an identity (and a list of user names, as the teams file gives its
members and admins). What each identity may do is :mod:`raydeck.scheduling.queue.access`.

Why the OS user and not a token: raydeck has no user database to issue, hand out and revoke
tokens from, and Ray's own auth token is one per cluster, shared by every user, so it says
which cluster, not who. The OS user is what every cluster user already has, needs no set-up,
and reads well in ``raydeck queue``. It is what the client says it is: the queue trusts it.
That is enough for what these rules are for (mistakes and misuse by cluster users: cancelling
someone else's job, claiming another team's share, an unbounded ``--priority``), and a token
would add nothing against what they cannot stop: anyone who can reach the cluster's Ray can run
code on it, the queue's actor and its database included (docs/scheduling.md).
"""

from __future__ import annotations

import getpass
import os
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
    """The OS ``user`` a client runs as and its ``host`` (recorded with each job it submits;
    only ``user`` decides what it may do: the same person on another machine is the same
    user)."""

    user: str
    host: str

    def __post_init__(self) -> None:
        user_name(self.user, "user")
        if not isinstance(self.host, str) or not _HOST.match(self.host):
            raise ConfigError(f"host {self.host!r}: a host name is 1-253 of A-Z a-z 0-9 _ . -")

    @classmethod
    def here(cls) -> Identity:
        """This process's OS user and host name (a uid without a user name is ``uid<N>``)."""
        try:
            user = getpass.getuser()
        except (KeyError, OSError):  # no passwd entry and no USER/LOGNAME (some containers)
            user = f"uid{os.getuid()}"
        return cls(user, socket.gethostname() or "localhost")

    def __str__(self) -> str:
        return f"{self.user}@{self.host}"


def user_name(name: object, where: str) -> str:
    """``name`` if it is a valid user name, else ConfigError naming ``where``."""
    if not isinstance(name, str) or not _USER.match(name):
        raise ConfigError(f"{where} {name!r}: a user name is 1-64 of A-Z a-z 0-9 _ . @ $ -")
    return name


def users(names: object, where: str) -> frozenset[str]:
    """A list of user names (the teams file's ``members`` and ``admins``), validated."""
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise ConfigError(f"{where}: must be a list of user names, e.g. [ana, bo]")
    return frozenset(user_name(name, where) for name in names)
