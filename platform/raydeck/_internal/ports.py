"""Choosing free TCP ports on this machine, for the servers raydeck starts or configures."""

from __future__ import annotations

import socket
from collections.abc import Collection

LOOPBACK = "127.0.0.1"
FREE_PORT_ATTEMPTS = 100


def free_port(taken: Collection[int] = ()) -> int | None:
    """A TCP port on the loopback interface that nothing listens on right now and that is
    not in ``taken``; None after :data:`FREE_PORT_ATTEMPTS` tries.

    The kernel may hand out a port it handed out a moment ago (the socket asking for it is
    closed again at once), so ports chosen for one purpose must be chosen against each other.
    """
    for _ in range(FREE_PORT_ATTEMPTS):
        with socket.socket() as sock:
            sock.bind((LOOPBACK, 0))
            port = int(sock.getsockname()[1])
        if port not in taken:
            return port
    return None
