"""The services of the one-machine stack, defined once for ``raydeck up`` and checked against
``docker/docker-compose.yml``.

Both deployments run the same platform: PostgreSQL for MLflow, an S3 server, the MLflow server,
a Ray head with token authentication, Prometheus with raydeck's rules, and JupyterLab. This
module is what they share: each local service names its twin in the compose file, its ports
(the compose containers' ports, which are also the local defaults), what it starts after (the
compose file's ``depends_on``) and how its environment differs from the container's, if at all.
``tests/stack/test_stack_definition.py`` parses the compose file and fails when the two disagree: a
service added to one and not the other, a port or a start order that differs, or an
environment variable one side sets and the other does not.

The environments themselves are built by :mod:`raydeck.stack.launchers` with the compose file's
variable names (``RAYDECK_*`` settings, ``RAY_AUTH_TOKEN``, ``PGPASSWORD``, ...), and the
credentials file uses the names of ``docker/.env.example``
(:mod:`raydeck.config.stack_credentials`).

Does not own: starting anything (:mod:`raydeck.stack.supervisor`) or the state directory
(:mod:`raydeck.stack.state`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from raydeck.cluster.serve_ingress import HAPROXY_PORT_ENVS
from raydeck.errors import ConfigError

if TYPE_CHECKING:
    from raydeck.config.settings import Settings

# Compose's defaults for its PostgreSQL (``${POSTGRES_USER:-mlflow}``, ``${POSTGRES_DB:-mlflow}``).
POSTGRES_USER = "mlflow"
POSTGRES_DB = "mlflow"
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class PortSpec:
    """A port a user reaches (``raydeck up --port NAME=PORT`` changes it).

    Attributes:
        name: how ``--port`` and ``raydeck ps`` call it.
        default: the port the compose container listens on; the local default too.
    """

    name: str
    default: int

    def __post_init__(self) -> None:
        if not 1 <= self.default <= 65535:
            raise ConfigError(f"port {self.name}={self.default}: must be 1-65535")


@dataclass(frozen=True)
class ServiceSpec:
    """One service of the stack.

    Attributes:
        name: the service's name in ``raydeck ps`` / ``raydeck logs``.
        compose_service: its twin in ``docker/docker-compose.yml``.
        description: one line for ``raydeck ps --help`` and the docs.
        ports: the ports users reach, first one the service's main port.
        after: services that must be healthy before this one starts (compose's depends_on).
        local_env: variables only the local process gets (machine paths a container has from
            its image, or start-up knobs of a shared machine); checked, not free-form.
        compose_env: variables of the compose container that the local stack passes another
            way (to a one-off command, or under another name); checked as well.
        startup_timeout_s: how long ``raydeck up`` waits for it to become healthy.
    """

    name: str
    compose_service: str
    description: str
    ports: tuple[PortSpec, ...]
    after: tuple[str, ...] = ()
    local_env: tuple[str, ...] = ()
    compose_env: tuple[str, ...] = ()
    startup_timeout_s: float = 120.0


# Compose's ``x-raydeck-settings`` that are credentials: a process gets them from the stack's
# credentials (locally) or a Kubernetes Secret (KubeRay), never as a written value.
SECRET_SETTINGS_ENV = ("RAYDECK_S3_ACCESS_KEY_ID", "RAYDECK_S3_SECRET_ACCESS_KEY")


def settings_env(settings: Settings, *, data_dir: str, tracking_uri: str,
                 s3_endpoint: str) -> dict[str, str]:
    """Compose's ``x-raydeck-settings`` without its credentials (:data:`SECRET_SETTINGS_ENV`):
    the variables every process that runs raydeck gets, for ``raydeck up`` and the KubeRay
    manifests alike.

    Args:
        settings: the user's settings (log level, experiment, region, buckets, prefix).
        data_dir: where the tracking spool lives in that deployment.
        tracking_uri, s3_endpoint: the deployment's MLflow and S3 as its processes reach them.
    """
    storage = settings.storage
    return {
        "RAYDECK_DATA_DIR": data_dir,
        "RAYDECK_LOG_LEVEL": settings.log_level,
        "RAYDECK_TRACKING_URI": tracking_uri,
        "RAYDECK_TRACKING_EXPERIMENT": settings.tracking.experiment,
        "RAYDECK_S3_ENDPOINT": s3_endpoint,
        "RAYDECK_S3_REGION": storage.region,
        "RAYDECK_S3_ARTIFACTS_BUCKET": storage.artifacts_bucket,
        "RAYDECK_S3_CHECKPOINTS_BUCKET": storage.checkpoints_bucket,
        "RAYDECK_S3_PREFIX": storage.prefix,
    }


# Every local process also gets these (never a container: it has neither).
#   RAYDECK_STACK       the stack's marker: `raydeck down` stops exactly the processes that
#                       carry it (Ray's workers, job drivers, notebook kernels included)
#   RAYDECK_STACK_SERVICE  which service a process belongs to (memory per service in `ps`)
MARKER_ENV = "RAYDECK_STACK"
SERVICE_ENV = "RAYDECK_STACK_SERVICE"
# Processes that run raydeck or Ray get the venv's bin first on PATH (a job's `python` is the
# first one there) and the stack's connection file.
RAYDECK_PROCESS_ENV = ("PATH", "RAYDECK_STACK_FILE")

SERVICES: tuple[ServiceSpec, ...] = (
    ServiceSpec(
        name="postgres", compose_service="postgres",
        description="PostgreSQL: MLflow's runs, params, metrics and model registry",
        ports=(PortSpec("postgres", 5432),),
        # The image's first-run variables; the local stack gives the same values to initdb.
        compose_env=("POSTGRES_USER", "POSTGRES_DB", "POSTGRES_PASSWORD"),
        startup_timeout_s=120.0,
    ),
    ServiceSpec(
        name="s3", compose_service="minio",
        description="S3 (SeaweedFS here, MinIO in compose): MLflow artifacts, Ray Train "
                    "checkpoints; its buckets are created once it answers (compose: storage-init)",
        ports=(PortSpec("s3", 9000),),
        # MinIO's root user is SeaweedFS' admin identity, read from the AWS_* names.
        local_env=("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
        compose_env=("MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"),
        startup_timeout_s=120.0,
    ),
    ServiceSpec(
        name="mlflow", compose_service="mlflow",
        description="MLflow tracking server on PostgreSQL, artifacts in S3",
        ports=(PortSpec("mlflow", 5000),),
        after=("postgres", "s3"),
        startup_timeout_s=300.0,
    ),
    ServiceSpec(
        name="ray-head", compose_service="ray-head",
        description="Ray head: GCS, dashboard and job server, Ray Client, metrics export; "
                    "token authentication",
        ports=(PortSpec("ray", 6379), PortSpec("ray-dashboard", 8265),
               PortSpec("ray-client", 10001)),
        after=("mlflow",),
        # Ray's dashboard must start within 60 s by default, too short on a busy machine; the
        # drain on SIGTERM is off (RayHeadLauncher.environment says why); Serve's HAProxy gets
        # ports of this stack's own, and Ray's processes a TMPDIR that `down` removes (a
        # container has the machine's ports and temp directory to itself).
        local_env=(*RAYDECK_PROCESS_ENV, "RAY_DASHBOARD_STARTUP_TIMEOUT_S",
                   "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", *HAPROXY_PORT_ENVS, "TMPDIR"),
        startup_timeout_s=300.0,
    ),
    ServiceSpec(
        name="prometheus", compose_service="prometheus",
        description="Prometheus: scrapes the Ray head's discovery file, raydeck's alert rules",
        ports=(PortSpec("prometheus", 9090),),
        after=("ray-head",),
        startup_timeout_s=120.0,
    ),
    ServiceSpec(
        name="jupyter", compose_service="jupyter",
        description="JupyterLab with raydeck's notebooks, a client of the stack",
        ports=(PortSpec("jupyter", 8888),),
        after=("ray-head",),
        # Jupyter's and IPython's own state stays in the stack's directory, not ~/.jupyter.
        local_env=(*RAYDECK_PROCESS_ENV, "JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR",
                   "JUPYTER_RUNTIME_DIR", "IPYTHONDIR"),
        startup_timeout_s=180.0,
    ),
)

# Compose services with no local process of their own, and why.
NOT_LOCAL: dict[str, str] = {
    "storage-init": "a step of the s3 service: `raydeck up` creates and probes the buckets "
                    "once S3 answers (raydeck.storage.init_buckets, as `raydeck storage init`)",
    "ray-worker": "one machine: the head runs every task; add nodes with `ray start "
                  "--address` and the stack's token",
    "grafana": "not started (no Debian package); point a Grafana you run at the stack's "
               "Prometheus with `raydeck dashboards push`",
}



def service(name: str) -> ServiceSpec:
    """The service called ``name``.

    Raises:
        ConfigError: no such service; the message lists them.
    """
    for spec in SERVICES:
        if spec.name == name:
            return spec
    raise ConfigError(f"no stack service {name!r}; the services are "
                      f"{', '.join(spec.name for spec in SERVICES)}")


def port_names() -> tuple[str, ...]:
    """Every ``--port`` name, in start order."""
    return tuple(port.name for spec in SERVICES for port in spec.ports)


def default_port(name: str) -> int:
    """The default of the port called ``name`` (compose's container port)."""
    for spec in SERVICES:
        for port in spec.ports:
            if port.name == name:
                return port.default
    raise ConfigError(f"--port {name}=...: no such port; the ports are {', '.join(port_names())}")
