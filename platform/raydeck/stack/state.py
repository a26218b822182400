"""The stack's state directory, ``<RAYDECK_DATA_DIR>/stack``: its layout and what it records.

Layout (everything the stack owns, so ``raydeck down --purge`` removes exactly this)::

    stack/
      credentials.env     the stack's secrets (0600, raydeck.config.stack_credentials)
      ray_auth_token      Ray's token alone, for RAY_AUTH_TOKEN_PATH (0600)
      state.json          ports, started processes (PID + start time), versions
      lock                held by `up` and `down` while they work
      logs/<service>.log  each service's output
      postgres/data       PostgreSQL's data directory (owned by the user PostgreSQL runs as),
                          unless state.json records it elsewhere (see below)
      s3/                 SeaweedFS' volumes and metadata
      prometheus/         its rendered config and time series
      jupyter/            Jupyter's and IPython's own config, data and runtime files
      notebooks/          JupyterLab's root: raydeck's notebooks, copied on the first `up`

plus Ray's temp dir, ``/tmp/raydeck-<hash of the state dir>``: Ray's Unix sockets live in it and
must stay under ~107 characters, which a path inside a project may not.

Under root PostgreSQL runs as the ``postgres`` system user; when that user cannot reach the
state directory (a directory above it keeps other users out, as ``/root`` does) its files live
in ``/var/lib/raydeck/<stack id>`` instead, recorded as ``postgres_dir`` so every later ``up`` uses
it and ``down --purge`` removes it.

Ports are chosen on the first ``up`` and kept, so URLs stay the same from one ``up`` to the next.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from raydeck._internal.atomic_file import atomic_write
from raydeck.errors import StackError
from raydeck.stack.processes import ProcessRecord

# Bumped when the directory's layout changes in a way an older raydeck cannot read.
STATE_LAYOUT = 1
DIR_NAME = "stack"
PGDATA_NAME = "data"
RAY_TEMP_ROOT = Path("/tmp")


@dataclass(frozen=True)
class StackPaths:
    """Where each part of the stack lives, given its state directory."""

    root: Path

    @classmethod
    def for_data_dir(cls, data_dir: Path) -> StackPaths:
        return cls(Path(data_dir).expanduser().resolve() / DIR_NAME)

    @property
    def marker(self) -> str:
        """The value of ``RAYDECK_STACK`` in every process of this stack."""
        return str(self.root)

    @property
    def credentials(self) -> Path:
        return self.root / "credentials.env"

    @property
    def ray_auth_token(self) -> Path:
        return self.root / "ray_auth_token"

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    @property
    def lock_file(self) -> Path:
        return self.root / "lock"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, service: str) -> Path:
        return self.logs / f"{service}.log"

    @property
    def postgres(self) -> Path:
        return self.root / "postgres"

    @property
    def pgdata(self) -> Path:
        """PostgreSQL's data directory in the state directory (its default place)."""
        return self.postgres / PGDATA_NAME

    @property
    def s3(self) -> Path:
        return self.root / "s3"

    @property
    def prometheus(self) -> Path:
        return self.root / "prometheus"

    @property
    def jupyter(self) -> Path:
        return self.root / "jupyter"

    @property
    def notebooks(self) -> Path:
        return self.root / "notebooks"

    @property
    def stack_id(self) -> str:
        """A short name for this stack, the same on every ``up``: it names its directories
        outside the state directory (Ray's temp dir, PostgreSQL's data under root)."""
        return hashlib.sha256(str(self.root).encode()).hexdigest()[:10]

    @property
    def ray_temp_dir(self) -> Path:
        """Ray's ``--temp-dir`` for the head (sessions, logs, sockets) and the ``TMPDIR`` of the
        stack's Ray processes (its workers, the jobs' drivers): removed by ``down``."""
        return RAY_TEMP_ROOT / f"raydeck-{self.stack_id}"


@dataclass
class StackState:
    """What ``state.json`` records. Mutable: the supervisor updates it as services start."""

    layout: int = STATE_LAYOUT
    ports: dict[str, int] = field(default_factory=dict)
    internal_ports: dict[str, dict[str, int]] = field(default_factory=dict)
    services: dict[str, ProcessRecord] = field(default_factory=dict)
    postgres_bin: str = ""
    num_cpus: int | None = None
    # PostgreSQL's files when not in ``stack/postgres`` (empty: they are there).
    postgres_dir: str = ""

    @classmethod
    def load(cls, path: Path) -> StackState:
        """The state in ``path``; a fresh state when there is none.

        Raises:
            StackError: the file is unreadable or from an incompatible raydeck.
        """
        if not path.exists():
            return cls()
        try:
            document: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise StackError(f"stack: {path} is unreadable ({exc}); stop what runs with "
                             "`raydeck down` and delete the file, or `raydeck down --purge`"
                             ) from None
        layout = document.get("layout")
        if layout != STATE_LAYOUT:
            raise StackError(
                f"stack: {path.parent} was written by a raydeck with state layout {layout}, "
                f"this raydeck reads layout {STATE_LAYOUT}; use the raydeck that created it, "
                "or start afresh with `raydeck down --purge` (deletes the stack's runs)")
        services = {name: ProcessRecord(**record)
                    for name, record in document.get("services", {}).items()}
        return cls(layout=STATE_LAYOUT, ports=dict(document.get("ports", {})),
                   internal_ports={k: dict(v) for k, v in
                                   document.get("internal_ports", {}).items()},
                   services=services, postgres_bin=str(document.get("postgres_bin", "")),
                   num_cpus=document.get("num_cpus"),
                   postgres_dir=str(document.get("postgres_dir", "")))

    def postgres_home(self, paths: StackPaths) -> Path:
        """The directory holding PostgreSQL's data directory (and nothing of anyone else's)."""
        return Path(self.postgres_dir) if self.postgres_dir else paths.postgres

    def pgdata(self, paths: StackPaths) -> Path:
        """PostgreSQL's data directory, wherever this stack keeps it."""
        return self.postgres_home(paths) / PGDATA_NAME

    def ports_in_use(self) -> set[int]:
        """Every port recorded for this stack, public and internal: a new one must differ."""
        internal = {port for ports in self.internal_ports.values() for port in ports.values()}
        return set(self.ports.values()) | internal

    def save(self, path: Path) -> None:
        """Write atomically (a crash never leaves half a file)."""
        with atomic_write(path) as handle:
            handle.write(json.dumps(asdict(self), indent=2, sort_keys=True))


@contextlib.contextmanager
def locked(paths: StackPaths) -> Iterator[None]:
    """Hold the stack's lock: one ``up`` or ``down`` at a time per state directory.

    Raises:
        StackError: another ``up``/``down`` holds it.
    """
    paths.root.mkdir(parents=True, exist_ok=True)
    fd = os.open(paths.lock_file, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StackError(f"stack: another `raydeck up` or `raydeck down` is working on "
                             f"{paths.root}; wait for it to finish") from None
        yield
    finally:
        os.close(fd)
