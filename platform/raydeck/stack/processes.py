"""Starting, recognising and stopping the stack's processes, and the ports they listen on.

Every service starts in a process group of its own with the stack's marker in its environment
(:data:`~raydeck.stack.services.MARKER_ENV` = the state directory). Stopping a service signals
its recorded group; afterwards every process still carrying the marker is killed: Ray's
workers, job drivers and notebook kernels inherit it but live in groups of their own. A
recorded process is recognised by PID *and* start time, so a reused PID is never signalled.
Nothing here looks at a process without the marker, and there is no ``ray stop``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from raydeck._internal import ports
from raydeck.errors import StackError
from raydeck.stack.services import LOOPBACK, MARKER_ENV, SERVICE_ENV

logger = logging.getLogger(__name__)

STOP_GRACE_S = 20.0
KILL_WAIT_S = 10.0
# psutil rounds start times; two readings of one process differ by less than this.
CREATE_TIME_TOLERANCE_S = 0.05


@dataclass(frozen=True)
class RunAs:
    """An unprivileged user a service runs as (PostgreSQL refuses to run as root)."""

    user: str
    uid: int
    gid: int
    groups: tuple[int, ...]


@dataclass(frozen=True)
class ProcessRecord:
    """A started service process: what ``raydeck down`` signals and ``raydeck ps`` checks."""

    pid: int
    create_time: float
    started_at: float

    def process(self) -> psutil.Process | None:
        """The live process, or None if it exited (or the PID now belongs to another)."""
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.create_time) > CREATE_TIME_TOLERANCE_S:
                return None
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except psutil.Error:
            return None

    def alive(self) -> bool:
        return self.process() is not None


def start(argv: list[str], *, env: Mapping[str, str], log_path: Path, cwd: Path,
          run_as: RunAs | None = None) -> tuple[subprocess.Popen[bytes], ProcessRecord]:
    """Start ``argv`` in a new process group, appending its output to ``log_path``.

    Returns the ``Popen`` (to notice an early exit while waiting) and the record to keep.
    """
    fd = open_log(log_path)
    try:
        popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT,
            env=dict(env), cwd=cwd, start_new_session=True,
            user=run_as.uid if run_as else None, group=run_as.gid if run_as else None,
            extra_groups=list(run_as.groups) if run_as else None,
        )
    finally:
        os.close(fd)
    try:
        create_time = psutil.Process(popen.pid).create_time()
    except psutil.Error:  # exited at once; the caller sees it through popen.poll()
        create_time = 0.0
    return popen, ProcessRecord(pid=popen.pid, create_time=create_time, started_at=time.time())


def open_log(path: Path) -> int:
    """A file descriptor appending to ``path`` (created 0600: logs may quote a secret)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


def marked(marker: str, service: str | None = None) -> list[psutil.Process]:
    """Live processes carrying the stack's ``marker`` (and ``service``, if given)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if proc.pid == os.getpid():
                continue
            environ = proc.environ()
            if environ.get(MARKER_ENV) != marker:
                continue
            if service is not None and environ.get(SERVICE_ENV) != service:
                continue
            if proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def memory_bytes(marker: str) -> dict[str, int]:
    """Resident memory (RSS) of the stack's processes, summed per service."""
    totals: dict[str, int] = {}
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            environ = proc.environ()
            if environ.get(MARKER_ENV) == marker:
                name = environ.get(SERVICE_ENV, "")
                totals[name] = totals.get(name, 0) + proc.memory_info().rss
    return totals


def stop(record: ProcessRecord | None, marker: str, service: str,
         sig: int = signal.SIGTERM, grace_s: float = STOP_GRACE_S) -> None:
    """Stop one service: ``sig`` to its process group, SIGKILL after ``grace_s``, then kill
    whatever of it is left (processes with the marker and this service's name).
    """
    proc = record.process() if record is not None else None
    if proc is not None and record is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(record.pid, sig)
        _wait_gone([proc, *_children(proc)], grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(record.pid, signal.SIGKILL)
    leftovers = marked(marker, service)
    for leftover in leftovers:
        with contextlib.suppress(psutil.Error):
            leftover.kill()
    _wait_gone(leftovers, KILL_WAIT_S)


def reap(marker: str) -> int:
    """SIGKILL every process still carrying ``marker``; returns how many there were."""
    leftovers = marked(marker)
    for proc in leftovers:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    _wait_gone(leftovers, KILL_WAIT_S)
    return len(leftovers)


def _children(proc: psutil.Process) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return list(proc.children(recursive=True))
    return []


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> None:
    if procs:
        psutil.wait_procs(procs, timeout=timeout_s)


# --- ports -------------------------------------------------------------------------------------
def free_port(taken: Collection[int] = ()) -> int:
    """A TCP port on the loopback interface that nothing listens on right now and that is
    not in ``taken`` (:func:`raydeck._internal.ports.free_port`): ``ray start`` refuses two
    components on one port, so a stack's ports are chosen against each other.

    Raises:
        StackError: none found.
    """
    port = ports.free_port(taken)
    if port is None:
        raise StackError(f"no free loopback port outside the {len(taken)} this stack uses; "
                         "free some ports")
    return port


def port_free(port: int) -> bool:
    """Whether a server could listen on ``port`` on the loopback interface (nothing listens
    there or on 0.0.0.0). SO_REUSEADDR, as servers set it: a closed connection that left the
    port in TIME_WAIT does not count."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def listening(port: int) -> bool:
    """Whether something accepts connections on ``127.0.0.1:port``."""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=1):
            return True
    except OSError:
        return False


def port_holder(port: int) -> str:
    """Who listens on ``port``, as ``pid 123 (name)``, or "another program" when unknown."""
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections(kind="tcp"):
            listens = conn.laddr and conn.laddr.port == port and conn.status == "LISTEN"
            if listens and conn.pid:
                with contextlib.suppress(psutil.Error):
                    return f"pid {conn.pid} ({psutil.Process(conn.pid).name()})"
                return f"pid {conn.pid}"
    return "another program"
