"""PostgreSQL for the stack: finding the server, the user it runs as, its data directory.

Owns the parts of PostgreSQL that can go wrong before it starts, each as one clear error:

- **The server binaries.** Debian installs them outside PATH (``/usr/lib/postgresql/<major>/bin``,
  ``apt-get install postgresql``); elsewhere they are on PATH (Homebrew, Postgres.app with its
  bin on PATH) or in a directory given with ``raydeck up --postgres-bin``.
- **Its version.** A data directory can only be opened by the major version that created it
  (``PG_VERSION``): when several are installed the matching one is used, otherwise the error
  names both versions and the ways out (install the old server, ``pg_upgrade``, or purge).
- **Root.** PostgreSQL refuses to run as root, so under root it runs as the ``postgres`` system
  user (Debian's package creates it), which must be able to reach the data directory: every
  directory above it must let other users through. When the stack's state directory does not
  (it is under a home directory such as ``/root``), PostgreSQL's files live in
  ``/var/lib/raydeck/<stack id>`` instead, owned by that user; the choice is recorded in the
  stack's state and ``raydeck down --purge`` removes the directory.

The server listens on 127.0.0.1 only, without a Unix socket, and accepts password logins
(scram-sha-256) for the stack's user; the password comes from the stack's credentials and is
handed to ``initdb`` in a file only that user can read, removed straight after.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raydeck.config.secrets import Secret
from raydeck.errors import StackError
from raydeck.stack.processes import RunAs, open_log
from raydeck.stack.services import LOOPBACK, POSTGRES_DB, POSTGRES_USER
from raydeck.stack.state import StackPaths, StackState

DEBIAN_ROOT = Path("/usr/lib/postgresql")
SERVER_BINARIES = ("postgres", "initdb")
SYSTEM_USER = "postgres"
COMMAND_TIMEOUT_S = 120.0
CONNECT_TIMEOUT_S = 3
INSTALL_HINT = "apt-get install postgresql"
# Where PostgreSQL's files go when the system user cannot reach the stack's state directory.
SYSTEM_DATA_ROOT = Path("/var/lib/raydeck")
SHELL = "/bin/sh"


@dataclass(frozen=True)
class PostgresInstall:
    """A PostgreSQL server installation: its bin directory and major version."""

    bin_dir: Path
    major: str

    def binary(self, name: str) -> str:
        return str(self.bin_dir / name)


def _major(bin_dir: Path) -> str:
    answer = subprocess.run([str(bin_dir / "postgres"), "--version"], capture_output=True,
                            text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    match = re.search(r"\(PostgreSQL\)\s+(\d+)(?:\.(\d+))?", answer.stdout)
    if answer.returncode != 0 or not match:
        raise StackError(f"postgres: {bin_dir / 'postgres'} --version did not answer as "
                         f"PostgreSQL; reinstall it ({INSTALL_HINT})")
    major = int(match.group(1))
    # Before 10 the major version has two parts (9.6).
    return str(major) if major >= 10 else f"{major}.{match.group(2)}"


def _has_server(directory: Path) -> bool:
    return all(os.access(directory / name, os.X_OK) for name in SERVER_BINARIES)


def candidates(bin_dir: Path | None = None) -> list[Path]:
    """Directories holding a PostgreSQL server, best first.

    With ``bin_dir`` only that one; else the directory of ``postgres`` on PATH, then Debian's
    versions, newest first.
    """
    if bin_dir is not None:
        return [bin_dir] if _has_server(bin_dir) else []
    found = []
    on_path = shutil.which("postgres")
    if on_path and _has_server(Path(on_path).resolve().parent):
        found.append(Path(on_path).resolve().parent)
    if DEBIAN_ROOT.is_dir():
        versions = sorted(DEBIAN_ROOT.iterdir(), key=lambda p: _version_key(p.name), reverse=True)
        found += [v / "bin" for v in versions if _has_server(v / "bin")]
    unique: list[Path] = []
    for directory in found:
        if directory not in unique:
            unique.append(directory)
    return unique


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", name)) or (0,)


def data_version(pgdata: Path) -> str | None:
    """The major version that created ``pgdata``, or None if it is not initialised."""
    try:
        return (pgdata / "PG_VERSION").read_text().strip()
    except FileNotFoundError:
        return None


def find_install(pgdata: Path, bin_dir: Path | None = None) -> PostgresInstall:
    """The server to run ``pgdata`` with (the newest one for a new data directory).

    Raises:
        StackError: no server is installed, or none of the data directory's version.
    """
    directories = candidates(bin_dir)
    if not directories:
        where = (f"in {bin_dir}" if bin_dir is not None
                 else f"on PATH or in {DEBIAN_ROOT}/<version>/bin")
        raise StackError(f"postgres: no PostgreSQL server ({', '.join(SERVER_BINARIES)}) "
                         f"{where}; install it ({INSTALL_HINT}) or pass its bin directory: "
                         "raydeck up --postgres-bin DIR")
    installs = [PostgresInstall(directory, _major(directory)) for directory in directories]
    wanted = data_version(pgdata)
    if wanted is None:
        return installs[0]
    for install in installs:
        if install.major == wanted:
            return install
    have = ", ".join(sorted({install.major for install in installs}))
    raise StackError(
        f"postgres: the data directory {pgdata} was created by PostgreSQL {wanted}, but the "
        f"installed server is {have}; install PostgreSQL {wanted} (apt-get install "
        f"postgresql-{wanted}), upgrade the directory with pg_upgrade, or start afresh with "
        "`raydeck down --purge` (deletes the stack's runs)")


def run_as() -> RunAs | None:
    """The user PostgreSQL runs as: None (this user) unless this is root.

    Raises:
        StackError: running as root and there is no ``postgres`` system user.
    """
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        raise StackError(f"postgres: PostgreSQL refuses to run as root and there is no "
                         f"'{SYSTEM_USER}' system user to run it as; install the server "
                         f"({INSTALL_HINT} creates the user) or run raydeck as another user"
                         ) from None
    return RunAs(user=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid,
                 groups=tuple(os.getgrouplist(entry.pw_name, entry.pw_gid)))


def _reaches(user: RunAs, directory: Path, access: str) -> bool:
    """Whether ``user`` passes ``test -<access>`` on ``directory``: asking as that user sees
    every directory above it, ACLs and mount options included. The shell's builtin, so PATH
    does not matter."""
    answer = subprocess.run([SHELL, "-c", 'test -"$1" "$2"', SHELL, access, str(directory)],
                            user=user.uid, group=user.gid, extra_groups=list(user.groups),
                            timeout=COMMAND_TIMEOUT_S, check=False)
    return answer.returncode == 0


def place_data(paths: StackPaths, state: StackState, user: RunAs | None) -> None:
    """Choose where PostgreSQL's files live, once, and record it in ``state``.

    In the state directory (``stack/postgres``) unless PostgreSQL runs as another user (under
    root) who cannot pass through it: then in ``/var/lib/raydeck/<stack id>``. A recorded
    choice is kept, and a data directory already in the state directory stays there.
    ``paths.root`` must exist.
    """
    if (state.postgres_dir or user is None or data_version(paths.pgdata) is not None
            or _reaches(user, paths.root, "x")):
        return
    state.postgres_dir = str(SYSTEM_DATA_ROOT / paths.stack_id)


def prepare_directory(directory: Path, user: RunAs | None) -> None:
    """Create ``directory`` (the parent of the data directory) for ``user``, mode 0700.

    Raises:
        StackError: it cannot be created, or ``user`` cannot reach it (a directory above it
            keeps others out).
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StackError(f"postgres: cannot create {directory} ({exc.strerror}); set "
                         "RAYDECK_DATA_DIR to a directory you can write") from None
    directory.chmod(0o700)
    if user is None:
        return
    os.chown(directory, user.uid, user.gid)
    if not _reaches(user, directory, "w"):
        raise StackError(
            f"postgres: PostgreSQL refuses to run as root, so it runs as the system user "
            f"'{user.user}', which cannot reach {directory} (a directory above it keeps other "
            "users out, as /root does); let other users through that directory (chmod o+x), "
            "set RAYDECK_DATA_DIR to a directory they can pass through, e.g. /srv/raydeck, or "
            "run raydeck as a non-root user")


def remove_outside(paths: StackPaths, state: StackState) -> Path | None:
    """Delete PostgreSQL's files kept outside the state directory (``down --purge``), and
    ``/var/lib/raydeck`` once no other stack's are in it; the directory deleted, or None."""
    home = state.postgres_home(paths)
    if home.is_relative_to(paths.root):
        return None
    shutil.rmtree(home, ignore_errors=True)
    with contextlib.suppress(OSError):  # not empty: another stack's files
        SYSTEM_DATA_ROOT.rmdir()
    return home


def initdb(install: PostgresInstall, pgdata: Path, password: Secret, user: RunAs | None,
           log_path: Path) -> None:
    """Create the data directory with the stack's user and password (first ``up`` only).

    Raises:
        StackError: initdb failed; the message has its last line and the log's path.
    """
    password_file = pgdata.parent / ".initdb-password"
    fd = os.open(password_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(password.reveal() + "\n")
    if user is not None:
        os.chown(password_file, user.uid, user.gid)
    try:
        with os.fdopen(open_log(log_path), "ab") as log:
            answer = subprocess.run(
                [install.binary("initdb"), "-D", str(pgdata), "-U", POSTGRES_USER,
                 "--auth=scram-sha-256", f"--pwfile={password_file}", "--encoding=UTF8",
                 "--locale=C"],
                stdout=log, stderr=subprocess.STDOUT, timeout=COMMAND_TIMEOUT_S, check=False,
                cwd=pgdata.parent, user=user.uid if user else None,
                group=user.gid if user else None,
                extra_groups=list(user.groups) if user else None)
    finally:
        password_file.unlink(missing_ok=True)
    if answer.returncode != 0:
        raise StackError(f"postgres: initdb failed (exit {answer.returncode}); see {log_path} "
                         "(`raydeck logs postgres`)")


def server_argv(install: PostgresInstall, pgdata: Path, port: int) -> list[str]:
    """The server's command line: loopback TCP only, no Unix socket, logs to stderr."""
    return [install.binary("postgres"), "-D", str(pgdata), "-c", f"listen_addresses={LOOPBACK}",
            "-c", f"port={port}", "-c", "unix_socket_directories=", "-c",
            "logging_collector=off"]


def connect(port: int, password: Secret, dbname: str = "postgres") -> Any:
    """A psycopg (3) connection as the stack's user, in autocommit mode."""
    import psycopg

    return psycopg.connect(host=LOOPBACK, port=port, user=POSTGRES_USER,
                           password=password.reveal(), dbname=dbname,
                           connect_timeout=CONNECT_TIMEOUT_S, autocommit=True)


def ready(port: int, password: Secret) -> bool:
    """Whether the server accepts the stack's login."""
    import psycopg

    try:
        connect(port, password).close()
    except psycopg.Error:
        return False
    return True


def ensure_database(port: int, password: Secret) -> None:
    """Create MLflow's database if it does not exist yet."""
    with connect(port, password) as connection:
        found = connection.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                                   (POSTGRES_DB,)).fetchone()
        if found is None:
            connection.execute(f'CREATE DATABASE "{POSTGRES_DB}"')


def uri(port: int) -> str:
    """MLflow's backend store URI (the password reaches libpq as PGPASSWORD, never here)."""
    return f"postgresql://{POSTGRES_USER}@{LOOPBACK}:{port}/{POSTGRES_DB}"
