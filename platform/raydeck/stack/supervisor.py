"""Bringing the stack up and down, and reporting on it.

``up`` works in three phases, so a bad input never leaves anything half-running:

1. **Preflight**, nothing started: the state directory's layout, every binary, PostgreSQL's
   data version, that no other stack owns the connection file, every port free.
2. **Start in order** (compose's ``depends_on``): each service is started in its own process
   group, recorded (PID and start time) and waited on until its health check passes; a service
   that exits or does not become healthy in time stops the ``up``.
3. On success the connection file is written: from then on every raydeck command and job on
   the machine uses the stack. On failure (or Ctrl-C) every service this ``up`` started is
   stopped again, newest first, and the error names the service, its last log line and the fix.

``up`` is idempotent: services already running are left alone (a running training job is never
restarted), crashed ones are started again. ``down`` stops exactly what was recorded, then
every process still carrying the stack's marker; ``down --purge`` also deletes the state, Ray's
temp directory and PostgreSQL's files where they live outside the state directory (under root).

Progress goes to an optional event callback (the CLI draws it); this module never prints.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from raydeck.config import stack_connection
from raydeck.config import stack_credentials as credentials
from raydeck.config.settings import (
    Settings,
    TrackingSettings,
    load_settings,
    load_settings_with_origins,
)
from raydeck.config.stack_connection import MLFLOW_TRACKING_URI_ENV
from raydeck.errors import ConfigError, StackError
from raydeck.stack import postgres, processes
from raydeck.stack.launchers import LAUNCHERS, Launcher, StackContext, process_env
from raydeck.stack.processes import ProcessRecord
from raydeck.stack.services import LOOPBACK, SERVICES, default_port, service
from raydeck.stack.state import StackPaths, StackState, locked

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.25
LOG_LINE_CHARS = 300
EventSink = Callable[[str, str], None]


@dataclass(frozen=True)
class ServiceStatus:
    """One service as ``raydeck ps`` shows it.

    ``state``: ``running`` (healthy), ``unhealthy`` (alive, health check failing), ``crashed``
    (recorded as started, process gone) or ``stopped``.
    """

    name: str
    state: str
    pid: int | None
    ports: dict[str, int]
    urls: dict[str, str]
    memory_bytes: int
    uptime_s: float | None
    detail: str = ""


@dataclass(frozen=True)
class UpReport:
    """What ``up`` did: which services it started and how long it took."""

    started: tuple[str, ...]
    wall_time_s: float
    services: tuple[ServiceStatus, ...]
    connection_file: Path | None
    credentials_file: Path


@dataclass(frozen=True)
class DownReport:
    """What ``down`` did: the services that were running, the directories it deleted."""

    stopped: tuple[str, ...]
    deleted: tuple[Path, ...]


def last_log_line(path: Path, mask: Callable[[str], str]) -> str:
    """The last non-empty line of a log (secrets masked, shortened), or ``""``."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, 2)
            handle.seek(max(0, handle.tell() - 16384))
            lines = handle.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if line.strip():
            text = mask(line.strip())
            return text if len(text) <= LOG_LINE_CHARS else text[:LOG_LINE_CHARS] + "..."
    return ""


def _raise_terminated(_signum: int, _frame: object) -> None:
    raise StackError("stack: `raydeck up` received SIGTERM; stopped what it had started")


@contextlib.contextmanager
def _terminate_raises() -> Iterator[None]:
    """While ``up`` starts services, SIGTERM raises (like Ctrl-C), so the clean-up runs and no
    service outlives an ``up`` that was killed (a CI timeout, ``timeout 60 raydeck up``)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _terminate_ignored() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Stack:
    """The one-machine stack whose state lives in ``<settings.data_dir>/stack``."""

    def __init__(self, settings: Settings | None = None, *, env: Mapping[str, str] | None = None,
                 events: EventSink | None = None) -> None:
        self.settings = settings or load_settings(env=env)
        self.paths = StackPaths.for_data_dir(self.settings.data_dir)
        self.stack_file = stack_connection.stack_file(env)
        self._env = env
        self._events = events or (lambda _service, _message: None)

    # --- up -----------------------------------------------------------------------------------
    def up(self, *, ports: Mapping[str, int] | None = None, free_ports: bool = False,
           postgres_bin: Path | None = None, num_cpus: int | None = None) -> UpReport:
        """Start every service that is not running; see the module docstring.

        Args:
            ports: port name -> port, for ports not chosen yet (``--port``).
            free_ports: use free ports instead of the defaults for ports not chosen yet (and
                for recorded ones something else now holds).
            postgres_bin: PostgreSQL's bin directory (kept for later ``up``\\ s).
            num_cpus: CPUs the Ray head offers (default: Ray's own count).

        Raises:
            StackError: a preflight check failed or a service did not start; nothing this
                call started is left running.
            ConfigError: an unknown port name or a bad value.
        """
        started_at = time.perf_counter()
        with locked(self.paths):
            # Only its owner may list it; under root, PostgreSQL's user must pass through it.
            self.paths.root.chmod(0o711 if os.geteuid() == 0 else 0o700)
            self._check_other_stack()
            state = StackState.load(self.paths.state_file)
            running = {launcher.spec.name for launcher in LAUNCHERS
                       if (record := state.services.get(launcher.spec.name)) and record.alive()}
            self._assign_ports(state, dict(ports or {}), free_ports, running)
            if postgres_bin is not None:
                state.postgres_bin = str(Path(postgres_bin).expanduser().resolve())
            if num_cpus is not None:
                if num_cpus < 1:
                    raise ConfigError(f"--num-cpus={num_cpus}: must be >= 1")
                state.num_cpus = num_cpus
            ctx = StackContext(paths=self.paths, state=state,
                               credentials=credentials.load_or_create(self.paths.credentials),
                               settings=self.settings, stack_file=self.stack_file)
            pending = [launcher for launcher in LAUNCHERS if launcher.spec.name not in running]
            for launcher in pending:
                launcher.check(ctx)
            for launcher in pending:
                self._check_ports(launcher, ctx)
                launcher.choose_internal_ports(state)
            state.save(self.paths.state_file)

            started: list[tuple[Launcher, ProcessRecord]] = []
            with _terminate_raises():
                try:
                    for launcher in LAUNCHERS:
                        if launcher.spec.name in running:
                            self._events(launcher.spec.name, "already running")
                            continue
                        self._start(launcher, ctx, started)
                except BaseException:
                    # A second SIGTERM must not cut the clean-up short.
                    with _terminate_ignored():
                        for launcher, record in reversed(started):
                            name = launcher.spec.name
                            self._events(name, "stopping (this `up` failed)")
                            processes.stop(record, self.paths.marker, name,
                                           launcher.stop_signal)
                            state.services.pop(name, None)
                        state.save(self.paths.state_file)
                    raise
            self._write_connection(ctx)
        return UpReport(started=tuple(launcher.spec.name for launcher, _ in started),
                        wall_time_s=time.perf_counter() - started_at,
                        services=tuple(self.status()), connection_file=self.stack_file,
                        credentials_file=self.paths.credentials)

    def _check_other_stack(self) -> None:
        other = stack_connection.read(self._env)
        if other is None or other.state_dir == self.paths.root:
            return
        if processes.marked(str(other.state_dir)):
            raise StackError(
                f"stack: another stack is up ({other.state_dir}) and owns the connection file "
                f"{self.stack_file}; bring it down first (RAYDECK_DATA_DIR="
                f"{other.state_dir.parent} raydeck down), or give this one its own: "
                f"{stack_connection.STACK_FILE_ENV}=PATH raydeck up")

    def _assign_ports(self, state: StackState, requested: dict[str, int], free_ports: bool,
                      running: set[str]) -> None:
        for name, port in requested.items():
            default_port(name)  # the name exists
            if not 1 <= port <= 65535:
                raise ConfigError(f"--port {name}={port}: must be 1-65535")
        for spec in SERVICES:
            for port_spec in spec.ports:
                name = port_spec.name
                recorded = state.ports.get(name)
                if name in requested:
                    if spec.name in running and recorded != requested[name]:
                        raise StackError(
                            f"{spec.name}: runs on port {recorded}; to move it to "
                            f"{requested[name]}, stop the stack first (`raydeck down`)")
                    state.ports[name] = requested[name]
                elif recorded is None:
                    state.ports[name] = (processes.free_port(state.ports_in_use())
                                         if free_ports else port_spec.default)
                elif free_ports and spec.name not in running and not processes.port_free(recorded):
                    state.ports[name] = processes.free_port(state.ports_in_use())
        owners: dict[int, str] = {}
        for name, port in state.ports.items():
            if port in owners:
                raise ConfigError(f"--port {name}={port}: {owners[port]} uses that port too; "
                                  "give each its own")
            owners[port] = name

    def _check_ports(self, launcher: Launcher, ctx: StackContext) -> None:
        for port_spec in launcher.spec.ports:
            port = ctx.port(port_spec.name)
            if not processes.port_free(port):
                raise StackError(
                    f"{launcher.spec.name}: port {port} on {LOOPBACK} is in use by "
                    f"{processes.port_holder(port)}; stop that program, or choose another "
                    f"port: raydeck up --port {port_spec.name}=PORT (or --free-ports)")

    def _start(self, launcher: Launcher, ctx: StackContext,
               started: list[tuple[Launcher, ProcessRecord]]) -> None:
        name = launcher.spec.name
        began = time.perf_counter()
        log = self.paths.log(name)
        self._events(name, "starting")
        launcher.prepare(ctx)
        for attempt in range(1, launcher.start_attempts + 1):
            popen, record = processes.start(
                launcher.argv(ctx), env=process_env(launcher, ctx), log_path=log,
                cwd=self.paths.root, run_as=launcher.run_as(ctx))
            ctx.state.services[name] = record
            ctx.state.save(self.paths.state_file)
            if attempt == 1:
                started.append((launcher, record))
            else:
                started[-1] = (launcher, record)
            code = self._wait_ready(launcher, ctx, popen)
            if code is None:
                break
            if attempt == launcher.start_attempts:
                raise StackError(
                    f"{name}: exited while starting (exit code {code}): "
                    f"{last_log_line(log, ctx.credentials.mask)}; fix that and run `raydeck "
                    f"up` again (full log: {log}, `raydeck logs {name}`)")
            self._events(name, f"exited while starting (exit code {code}); starting again")
            processes.stop(record, self.paths.marker, name, launcher.stop_signal)
        launcher.after_ready(ctx)
        self._events(name, f"ready in {time.perf_counter() - began:.1f} s")

    def _wait_ready(self, launcher: Launcher, ctx: StackContext,
                    popen: subprocess.Popen[bytes]) -> int | None:
        """Wait until the service is healthy (None) or its process exits (its exit code).

        Raises:
            StackError: not healthy within the service's start-up timeout.
        """
        name = launcher.spec.name
        deadline = time.monotonic() + launcher.spec.startup_timeout_s
        while not launcher.ready(ctx):
            code = popen.poll()
            if code is not None:
                return code
            if time.monotonic() > deadline:
                raise StackError(
                    f"{name}: not healthy after {launcher.spec.startup_timeout_s:.0f} s (last "
                    f"log line: {last_log_line(self.paths.log(name), ctx.credentials.mask)}); "
                    f"see `raydeck logs {name}`, then run `raydeck up` again")
            time.sleep(POLL_INTERVAL_S)
        return None

    def _write_connection(self, ctx: StackContext) -> None:
        if self.stack_file is None:
            return
        storage = ctx.storage()
        urls: dict[str, str] = {}
        for launcher in LAUNCHERS:
            urls.update(launcher.urls(ctx))
        ray_address = f"{LOOPBACK}:{ctx.port('ray')}"
        stack_connection.StackConnection(
            state_dir=self.paths.root, credentials_file=self.paths.credentials,
            ray_auth_token_file=self.paths.ray_auth_token, ray_address=ray_address,
            job_server=ctx.url("ray-dashboard"), urls=urls,
            settings={
                "data_dir": str(self.settings.data_dir),
                "ray_address": ray_address,
                "tracking": {"uri": ctx.url("mlflow")},
                "storage": {"endpoint": storage.endpoint, "region": storage.region,
                            "access_key_id": storage.access_key_id,
                            "artifacts_bucket": storage.artifacts_bucket,
                            "checkpoints_bucket": storage.checkpoints_bucket,
                            "prefix": storage.prefix},
            },
        ).write(self.stack_file)

    def overridden(self) -> list[str]:
        """Settings whose value (from the environment or raydeck.toml) wins over the stack's,
        so raydeck commands here would not use the stack for them."""
        conn = stack_connection.read(self._env)
        if conn is None:
            return []
        mine, origins = load_settings_with_origins(env=self._env)
        found = []
        if mine.ray_address != conn.ray_address:
            found.append(f"Ray address {mine.ray_address or '(auto)'} (RAYDECK_RAY_ADDRESS or "
                         "RAY_ADDRESS)")
        if mine.tracking.uri != conn.settings["tracking"]["uri"]:
            uri_origin = origins[TrackingSettings.env_name("uri")]
            found.append(uri_origin if uri_origin == MLFLOW_TRACKING_URI_ENV
                         else "RAYDECK_TRACKING_URI")
        if mine.storage.endpoint != conn.settings["storage"]["endpoint"]:
            found.append("RAYDECK_S3_ENDPOINT")
        return found

    # --- down ---------------------------------------------------------------------------------
    def down(self, *, purge: bool = False) -> DownReport:
        """Stop every service of the stack (and everything carrying its marker). ``purge`` also
        deletes the state directory, Ray's temp directory and PostgreSQL's files kept outside
        the state directory. The connection file is removed if it names this stack.
        """
        if not self.paths.root.exists():
            return DownReport(stopped=(), deleted=())
        stopped = []
        deleted = []
        with locked(self.paths):
            try:
                state = StackState.load(self.paths.state_file)
            except StackError:
                if not purge:
                    raise
                state = StackState()
            for launcher in reversed(LAUNCHERS):
                name = launcher.spec.name
                record = state.services.get(name)
                if (record is None or not record.alive()) and not processes.marked(
                        self.paths.marker, name):
                    continue
                self._events(name, "stopping")
                processes.stop(record, self.paths.marker, name, launcher.stop_signal)
                stopped.append(name)
            processes.reap(self.paths.marker)
            state.services.clear()
            if not purge:
                state.save(self.paths.state_file)
            self._remove_connection()
            # What Ray, HAProxy and the jobs' processes left in the temp dir: nothing there
            # outlives the stack (the services' logs stay in the state directory).
            shutil.rmtree(self.paths.ray_temp_dir, ignore_errors=True)
            if purge:
                shutil.rmtree(self.paths.root)
                deleted.append(self.paths.root)
                outside = postgres.remove_outside(self.paths, state)
                if outside is not None:
                    deleted.append(outside)
        return DownReport(stopped=tuple(stopped), deleted=tuple(deleted))

    def _remove_connection(self) -> None:
        try:
            conn = stack_connection.read(self._env)
        except ConfigError:
            return
        if conn is not None and conn.state_dir == self.paths.root and self.stack_file:
            self.stack_file.unlink(missing_ok=True)

    # --- status -------------------------------------------------------------------------------
    def status(self) -> list[ServiceStatus]:
        """Every service's state, PID, ports, URLs, memory and uptime."""
        state = StackState.load(self.paths.state_file) if self.paths.root.exists() else (
            StackState())
        if not self.paths.credentials.exists():
            return [ServiceStatus(spec.name, "stopped", None, {}, {}, 0, None)
                    for spec in SERVICES]
        ctx = StackContext(paths=self.paths, state=state,
                           credentials=credentials.read(self.paths.credentials),
                           settings=self.settings, stack_file=self.stack_file)
        memory = processes.memory_bytes(self.paths.marker)
        rows = []
        for launcher in LAUNCHERS:
            name = launcher.spec.name
            record = state.services.get(name)
            ports = {p.name: state.ports[p.name] for p in launcher.spec.ports
                     if p.name in state.ports}
            urls = launcher.urls(ctx) if len(ports) == len(launcher.spec.ports) else {}
            detail = ""
            if record is None:
                current, pid, uptime = "stopped", None, None
            elif record.alive():
                current = "running" if launcher.ready(ctx) else "unhealthy"
                pid, uptime = record.pid, time.time() - record.started_at
            else:
                current, pid, uptime = "crashed", record.pid, None
                detail = last_log_line(self.paths.log(name), ctx.credentials.mask)
            rows.append(ServiceStatus(name, current, pid, ports, urls, memory.get(name, 0),
                                      uptime, detail))
        return rows

    def postgres_data(self) -> Path:
        """PostgreSQL's data directory: in the state directory, or where ``up`` recorded it."""
        state = StackState.load(self.paths.state_file) if self.paths.root.exists() else (
            StackState())
        return state.pgdata(self.paths)

    def log_file(self, name: str) -> Path:
        """The log of service ``name``.

        Raises:
            ConfigError: no such service.
        """
        return self.paths.log(service(name).name)

    def mask(self, text: str) -> str:
        """``text`` with the stack's credentials masked (nothing to mask without them)."""
        if not self.paths.credentials.exists():
            return text
        return credentials.read(self.paths.credentials).mask(text)
