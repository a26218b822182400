"""What ``raydeck k8s render`` is told: :class:`KubeRayOptions`, validated where it is made.

Everything else in the manifests comes from the stack's definition and the user's settings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from raydeck._internal.redaction import redact_url
from raydeck.errors import ConfigError
from raydeck.k8s.auth import AUTH_MODES
from raydeck.k8s.kueue import Capacity, TeamSpec, check_priority, check_teams, top_priority
from raydeck.k8s.secrets import URI_SECRET_SUFFIX, Credentials, split_credentials
from raydeck.stack.services import service

# Compose's image (``raydeck:${RAY_IMAGE_TAG:-...}``), built from docker/Dockerfile; the GPU
# image is the same Dockerfile on Ray's GPU base image (RAY_IMAGE_TAG=...-gpu).
RAY_VERSION = "2.60.0"
DEFAULT_IMAGE = f"raydeck:{RAY_VERSION}-py311-cpu"
DEFAULT_GPU_IMAGE = f"raydeck:{RAY_VERSION}-py311-gpu"
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")
_HTTP_URL = re.compile(r"^https?://[^/\s]+\S*$")


@dataclass(frozen=True)
class WorkerBounds:
    """A worker group's autoscaling bounds; it starts at ``min_replicas``."""

    min_replicas: int
    max_replicas: int

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas > 1000:
            raise ConfigError(f"worker bounds {self.min_replicas}:{self.max_replicas}: need "
                              "0 <= MIN <= MAX <= 1000")

    @classmethod
    def parse(cls, text: str, option: str) -> WorkerBounds:
        """``MIN:MAX`` as the CLI takes it. Raises ConfigError naming ``option``."""
        low, sep, high = text.partition(":")
        if not (sep and low.isdigit() and high.isdigit()):
            raise ConfigError(f"{option} {text!r}: expected MIN:MAX, e.g. 0:4")
        return cls(int(low), int(high))


@dataclass(frozen=True)
class KubeRayOptions:
    """What differs between Kubernetes clusters; everything else comes from the stack's
    definition and the user's settings.

    Attributes:
        name: the RayCluster's name (a DNS label, at most 40 characters: KubeRay appends
            suffixes to it); the RayJob and RayService are named after it.
        image, gpu_image: the raydeck images (docker/Dockerfile) of the CPU pods and GPU workers.
        cpu_workers, gpu_workers: each worker group's autoscaling bounds.
        gpus_per_worker: ``nvidia.com/gpu`` of each GPU worker.
        secret: the credentials Secret (:mod:`raydeck.k8s.secrets`).
        spool_size: the spool's PersistentVolumeClaim size (a Kubernetes quantity).
        storage_class: its storage class; empty: the cluster's default.
        tracking_uri, s3_endpoint: MLflow and S3 as the pods reach them; a password in
            ``tracking_uri`` is split off into the URI credentials Secret (afterwards
            ``tracking_uri`` holds the URI without it, and ``credentials`` says where each
            credential is).
        queue_database_url: the queue's PostgreSQL (``RAYDECK_QUEUE_DATABASE_URL`` on the head;
            empty: SQLite on the spool), its password split off likewise.
        haproxy_ingress: Serve's ingress on every Ray pod (:mod:`raydeck.cluster.serve_ingress`):
            HAProxy, which raydeck's images carry (``ray[serve]`` on Linux), or, when False,
            Serve's own proxy (``RAY_SERVE_ENABLE_HA_PROXY=0``).
        auth: ``token`` (the credentials Secret's shared token) or ``k8s`` (Kubernetes token
            auth on the RayCluster, :mod:`raydeck.k8s.auth`).
        teams: the teams file's teams: a namespace, RayCluster and RBAC each (empty: one set,
            namespace left to kubectl).
        admins: the teams file's admins (allowed on every team's RayCluster).
        kueue: put the RayJob, RayService and RayClusters in the teams' Kueue queues
            (:mod:`raydeck.k8s.kueue`); needs ``teams`` and ``capacity``.
        capacity: the CPUs and GPUs the teams' ClusterQueues share.
        team: the team (namespace) of the RayJob and RayService; default: the first team.
        priority: the RayJob's and RayService's raydeck priority (a WorkloadPriorityClass).
    """

    name: str = "raydeck"
    image: str = DEFAULT_IMAGE
    gpu_image: str = DEFAULT_GPU_IMAGE
    cpu_workers: WorkerBounds = WorkerBounds(0, 4)
    gpu_workers: WorkerBounds = WorkerBounds(0, 2)
    gpus_per_worker: int = 1
    secret: str = "raydeck-credentials"
    spool_size: str = "20Gi"
    storage_class: str = ""
    tracking_uri: str = field(default="", repr=False)
    s3_endpoint: str = ""
    queue_database_url: str = field(default="", repr=False)
    haproxy_ingress: bool = True
    auth: str = "token"
    teams: tuple[TeamSpec, ...] = ()
    admins: tuple[str, ...] = ()
    kueue: bool = False
    capacity: Capacity | None = None
    team: str = ""
    priority: int = 0
    credentials: Credentials = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("name", "secret"):
            if not _DNS_LABEL.match(getattr(self, name)):
                raise ConfigError(f"--{name} {getattr(self, name)!r}: use 1-40 lower-case "
                                  "letters, digits and -, starting with a letter")
        if not 1 <= self.gpus_per_worker <= 16:
            raise ConfigError(f"--gpus-per-worker={self.gpus_per_worker}: must be 1-16")
        if not _QUANTITY.match(self.spool_size):
            raise ConfigError(f"--spool-size {self.spool_size!r}: a Kubernetes quantity, "
                              "e.g. 20Gi")
        # Compose's addresses of MLflow and S3, from the services' definitions.
        if not self.tracking_uri:
            object.__setattr__(self, "tracking_uri", _compose_url("mlflow"))
        if not self.s3_endpoint:
            object.__setattr__(self, "s3_endpoint", _compose_url("s3"))
        for name in ("tracking_uri", "s3_endpoint"):
            if not _HTTP_URL.match(getattr(self, name)):
                raise ConfigError(f"--{name.replace('_', '-')} "
                                  f"{redact_url(getattr(self, name))!r}: must be an http(s):// "
                                  "URL the pods reach")
        if self.queue_database_url and not self.queue_database_url.startswith("postgresql"):
            raise ConfigError(f"--queue-database-url {redact_url(self.queue_database_url)!r}: "
                              "a postgresql:// URL (without it the queue uses SQLite on the "
                              "head's spool)")
        tracking = split_credentials(self.tracking_uri, "--tracking-uri", keep_username=False)
        database = split_credentials(self.queue_database_url, "--queue-database-url",
                                     keep_username=True)
        object.__setattr__(self, "tracking_uri", tracking.uri)
        object.__setattr__(self, "queue_database_url", database.uri)
        object.__setattr__(self, "credentials", Credentials(
            self.secret, tracking, database, f"{self.name}{URI_SECRET_SUFFIX}"))
        self._check_teams()

    def _check_teams(self) -> None:
        if self.auth not in AUTH_MODES:
            raise ConfigError(f"--auth {self.auth!r}: one of {', '.join(AUTH_MODES)}")
        check_teams(self.teams)
        if self.kueue and not (self.teams and self.capacity):
            raise ConfigError("--kueue needs --teams FILE (the teams file `raydeck queue "
                              "--teams` takes) and --capacity CPUS:GPUS (what they share)")
        if self.team and self.team not in {t.name for t in self.teams}:
            raise ConfigError(f"--team {self.team!r}: not in the teams file ("
                              f"{', '.join(t.name for t in self.teams) or 'no --teams given'})")
        if self.kueue:
            check_priority(self.priority, self.job_team(), top_priority(self.teams))
        elif self.priority:
            raise ConfigError("--priority is Kueue's (a WorkloadPriorityClass): add --kueue")

    def job_team(self) -> TeamSpec:
        """The team of the RayJob and RayService (``team``, else the first)."""
        return next(t for t in self.teams if t.name == self.team) if self.team else (
            self.teams[0])

    @property
    def job_namespace(self) -> str:
        return self.job_team().namespace if self.teams else ""



def _compose_url(name: str) -> str:
    spec = service(name)
    return f"http://{spec.compose_service}:{spec.ports[0].default}"
