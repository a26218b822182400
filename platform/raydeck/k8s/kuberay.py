"""KubeRay manifests for raydeck, generated from the stack's service and settings definition.

``raydeck k8s render`` writes what a Kubernetes cluster with the KubeRay operator needs to run
raydeck's Ray side: a ``RayCluster`` (head, a CPU and a GPU worker group with autoscaling
bounds), the tracking spool's ``PersistentVolumeClaim``, a ``PodMonitor`` for Prometheus
Operator, a ``RayJob`` for one ``raydeck submit`` job and a ``RayService`` for one
``raydeck serve`` model. MLflow, S3 and PostgreSQL are not rendered: the pods reach them where
compose names them (``http://mlflow:5000``, ``http://minio:9000``) unless told otherwise.

What is shared, so that compose, ``raydeck up`` and these manifests cannot drift (a test
compares all three): the ports of :mod:`raydeck.stack.services`, raydeck's settings variables
(:func:`raydeck.stack.services.settings_env`), the image, the data directory and the metrics
port of ``docker/docker-compose.yml``, ``raydeck submit``'s job contract
(:class:`raydeck.jobs.submission.JobRequest`) and ``raydeck serve``'s Serve config
(:func:`raydeck.serving.serve_config`).

Secrets: never a value in a manifest. Ray's token is a file mounted from the Secret
(``RAY_AUTH_TOKEN_PATH``), the S3 credentials are ``secretKeyRef`` variables; the Secret's keys
are the names of the stack's credentials file, so ``kubectl create secret generic
--from-env-file`` fills it.

Does not own: applying anything (no Kubernetes API is called) or the Secret's values.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from raydeck.cluster.serve_ingress import node_env
from raydeck.errors import ConfigError
from raydeck.jobs.submission import (
    JobRequest,
    default_run_name,
    new_run_id,
    submitted_metadata,
    submitted_runtime_env,
)
from raydeck.observability.prometheus import CLUSTER_LABEL
from raydeck.serving import ServeOptions, serve_config
from raydeck.stack.services import SECRET_SETTINGS_ENV, service, settings_env

if TYPE_CHECKING:
    from raydeck.config.settings import Settings

KUBERAY_API_VERSION = "ray.io/v1"
PODMONITOR_API_VERSION = "monitoring.coreos.com/v1"
# Compose's image (``raydeck:${RAY_IMAGE_TAG:-...}``), built from docker/Dockerfile; the GPU
# image is the same Dockerfile on Ray's GPU base image (RAY_IMAGE_TAG=...-gpu).
RAY_VERSION = "2.60.0"
DEFAULT_IMAGE = f"raydeck:{RAY_VERSION}-py311-cpu"
DEFAULT_GPU_IMAGE = f"raydeck:{RAY_VERSION}-py311-gpu"
# Compose's paths and ports inside the image: the spool's volume, the code docker/Dockerfile
# copies (a RayJob's working dir), Ray's --metrics-export-port, Ray's shared memory.
CONTAINER_DATA_DIR = "/home/ray/raydeck-data"
IMAGE_CODE_DIR = "/home/ray/raydeck"
METRICS_EXPORT_PORT = 8080
METRICS_PORT_NAME = "metrics"
SHM_SIZE = "2Gi"
# Ray's token, mounted from the Secret's RAY_AUTH_TOKEN key.
TOKEN_KEY = "RAY_AUTH_TOKEN"
TOKEN_DIR = "/etc/raydeck/ray-auth"
TOKEN_FILE = "token"
# Ray's images run as user ray in group users (100): with the pods' fsGroup, the token file is
# readable by that group only (0440) and the spool's volume writable by it.
RAY_IMAGE_GID = 100
TOKEN_FILE_MODE = 0o440
TOKEN_MOUNT = {"name": "ray-auth", "mountPath": TOKEN_DIR, "readOnly": True}
SHM_MOUNT = {"name": "shm", "mountPath": "/dev/shm"}
SPOOL_MOUNT = {"name": "spool", "mountPath": CONTAINER_DATA_DIR}
# Compose's ray-head variables the pods get another way, and the one only they get: the token
# is a mounted file, not a value; the Prometheus and Grafana the dashboard embeds are the
# cluster's own (none is rendered), found through the PodMonitor.
COMPOSE_ONLY_ENV = ("RAY_AUTH_TOKEN", "RAY_PROMETHEUS_HOST", "RAY_PROMETHEUS_NAME",
                    "RAY_GRAFANA_HOST", "RAY_GRAFANA_IFRAME_HOST")
KUBERAY_ONLY_ENV = ("RAY_AUTH_TOKEN_PATH",)
# KubeRay's names for the head's ports (its Services expose them by these names).
KUBERAY_PORT_NAMES = {"ray": "gcs-server", "ray-dashboard": "dashboard", "ray-client": "client"}
RAY_START_FLAGS = {"ray": "port", "ray-dashboard": "dashboard-port",
                   "ray-client": "ray-client-server-port"}
SERVE_PORT_NAME = "serve"
CLUSTER_DIR = "cluster"
PART_OF_LABEL = {"app.kubernetes.io/part-of": "raydeck"}
# Each pod's requests (= limits, so the autoscaler's view of a node is what it gets).
HEAD_CPU, HEAD_MEMORY = "2", "8Gi"
CPU_WORKER_CPU, CPU_WORKER_MEMORY = "4", "16Gi"
GPU_WORKER_CPU, GPU_WORKER_MEMORY = "8", "32Gi"

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
        secret: the Secret holding RAY_AUTH_TOKEN and the S3 credentials.
        spool_size: the spool's PersistentVolumeClaim size (a Kubernetes quantity).
        storage_class: its storage class; empty: the cluster's default.
        tracking_uri, s3_endpoint: MLflow and S3 as the pods reach them.
        haproxy_ingress: Serve's ingress on every Ray pod (:mod:`raydeck.cluster.serve_ingress`):
            HAProxy, which raydeck's images carry (``ray[serve]`` on Linux), or, when False,
            Serve's own proxy (``RAY_SERVE_ENABLE_HA_PROXY=0``).
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
    tracking_uri: str = ""
    s3_endpoint: str = ""
    haproxy_ingress: bool = True

    def __post_init__(self) -> None:
        for field in ("name", "secret"):
            if not _DNS_LABEL.match(getattr(self, field)):
                raise ConfigError(f"--{field} {getattr(self, field)!r}: use 1-40 lower-case "
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
        for field in ("tracking_uri", "s3_endpoint"):
            if not _HTTP_URL.match(getattr(self, field)):
                raise ConfigError(f"--{field.replace('_', '-')} {getattr(self, field)!r}: "
                                  "must be an http(s):// URL the pods reach")


def _object_name(text: str) -> str:
    """``text`` as a Kubernetes object name: lower-case letters, digits and -, at most 63."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower())[:63].strip("-")


def _compose_url(name: str) -> str:
    spec = service(name)
    return f"http://{spec.compose_service}:{spec.ports[0].default}"


# --- pieces every pod shares ------------------------------------------------------------------
def _pod_environment(options: KubeRayOptions, settings: Settings) -> list[dict[str, Any]]:
    """The environment of every Ray container: raydeck's settings (the credentials by
    reference), Ray's token authentication with the token as a file, and Serve's ingress."""
    values = settings_env(settings, data_dir=CONTAINER_DATA_DIR,
                          tracking_uri=options.tracking_uri, s3_endpoint=options.s3_endpoint)
    env: list[dict[str, Any]] = [{"name": name, "value": value} for name, value in values.items()]
    env += [{"name": name, "valueFrom": {"secretKeyRef": {"name": options.secret, "key": name}}}
            for name in SECRET_SETTINGS_ENV]
    env += [{"name": name, "value": value}
            for name, value in node_env(options.haproxy_ingress).items()]
    return env + _auth_environment()


def _auth_environment() -> list[dict[str, Any]]:
    """Compose's ``x-ray-auth``, the token read from the mounted Secret."""
    return [{"name": "RAY_AUTH_MODE", "value": "token"},
            {"name": "RAY_AUTH_TOKEN_PATH", "value": f"{TOKEN_DIR}/{TOKEN_FILE}"},
            {"name": "RAY_USAGE_STATS_ENABLED", "value": "0"}]


def _token_volume(options: KubeRayOptions) -> dict[str, Any]:
    return {"name": TOKEN_MOUNT["name"], "secret": {
        "secretName": options.secret, "defaultMode": TOKEN_FILE_MODE,
        "items": [{"key": TOKEN_KEY, "path": TOKEN_FILE}]}}



def _resources(cpu: str, memory: str, gpus: int = 0) -> dict[str, Any]:
    amounts: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if gpus:
        amounts["nvidia.com/gpu"] = gpus
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _pod(image: str, env: list[dict[str, Any]], ports: list[dict[str, Any]],
         resources: dict[str, Any], volumes: list[dict[str, Any]],
         mounts: list[dict[str, Any]], gpu: bool = False) -> dict[str, Any]:
    """A Ray pod template: one container named ``ray`` (KubeRay's first container). A copy of
    everything passed in, which pods share: no part of one pod is another's (nor a YAML alias).
    """
    spec: dict[str, Any] = {
        "securityContext": {"fsGroup": RAY_IMAGE_GID},
        "containers": [{"name": "ray", "image": image, "env": env, "ports": ports,
                        "resources": resources, "volumeMounts": mounts}],
        "volumes": volumes,
    }
    if gpu:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists",
                                "effect": "NoSchedule"}]
    return copy.deepcopy({"metadata": {"labels": dict(PART_OF_LABEL)}, "spec": spec})


def _shm_volume() -> dict[str, Any]:
    """Compose's ``shm_size``: Ray's object store lives in /dev/shm."""
    return {"name": SHM_MOUNT["name"], "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}}


def _spool_claim_name(options: KubeRayOptions) -> str:
    return f"{options.name}-spool"


# --- the objects ------------------------------------------------------------------------------
def cluster_spec(options: KubeRayOptions, settings: Settings) -> dict[str, Any]:
    """The RayCluster's ``spec``, also the RayService's ``rayClusterConfig``."""
    env = _pod_environment(options, settings)
    metrics = {"name": METRICS_PORT_NAME, "containerPort": METRICS_EXPORT_PORT}
    head_ports = [{"name": KUBERAY_PORT_NAMES[port.name], "containerPort": port.default}
                  for port in service("ray-head").ports]
    head_ports += [metrics, {"name": SERVE_PORT_NAME, "containerPort": ServeOptions.port}]
    start_params = {RAY_START_FLAGS[port.name]: str(port.default)
                    for port in service("ray-head").ports}
    head = {
        "rayStartParams": {**start_params, "dashboard-host": "0.0.0.0",
                           "metrics-export-port": str(METRICS_EXPORT_PORT)},
        "template": _pod(options.image, env, head_ports, _resources(HEAD_CPU, HEAD_MEMORY),
                         [_token_volume(options), _shm_volume(),
                          {"name": SPOOL_MOUNT["name"], "persistentVolumeClaim": {
                              "claimName": _spool_claim_name(options)}}],
                         [TOKEN_MOUNT, SHM_MOUNT, SPOOL_MOUNT]),
    }
    workers = []
    for group, bounds, image, resources in (
        ("cpu", options.cpu_workers, options.image,
         _resources(CPU_WORKER_CPU, CPU_WORKER_MEMORY)),
        ("gpu", options.gpu_workers, options.gpu_image,
         _resources(GPU_WORKER_CPU, GPU_WORKER_MEMORY, options.gpus_per_worker)),
    ):
        workers.append({
            "groupName": group, "replicas": bounds.min_replicas,
            "minReplicas": bounds.min_replicas, "maxReplicas": bounds.max_replicas,
            "rayStartParams": {"metrics-export-port": str(METRICS_EXPORT_PORT)},
            "template": _pod(image, env, [metrics], resources,
                             [_token_volume(options), _shm_volume()],
                             [TOKEN_MOUNT, SHM_MOUNT], gpu=group == "gpu"),
        })
    return {
        "rayVersion": RAY_VERSION,
        "enableInTreeAutoscaling": True,
        # The autoscaler talks to the GCS too: it needs the token like every Ray process.
        "autoscalerOptions": {"env": _auth_environment(), "volumeMounts": [dict(TOKEN_MOUNT)]},
        "headGroupSpec": head,
        "workerGroupSpecs": workers,
    }


def _metadata(name: str) -> dict[str, Any]:
    return {"name": name, "labels": dict(PART_OF_LABEL)}


def ray_cluster(options: KubeRayOptions, settings: Settings) -> dict[str, Any]:
    return {"apiVersion": KUBERAY_API_VERSION, "kind": "RayCluster",
            "metadata": _metadata(options.name), "spec": cluster_spec(options, settings)}


def spool_claim(options: KubeRayOptions) -> dict[str, Any]:
    """The head's tracking spool: points not yet in MLflow survive a restart of the head pod."""
    spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"],
                            "resources": {"requests": {"storage": options.spool_size}}}
    if options.storage_class:
        spec["storageClassName"] = options.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": _metadata(_spool_claim_name(options)), "spec": spec}


def pod_monitor(options: KubeRayOptions) -> dict[str, Any]:
    """Prometheus Operator scrapes every Ray pod's metrics port (Ray's and raydeck's metrics),
    each series labelled with its cluster as the dashboards' ``cluster`` variable reads it."""
    relabel = {"sourceLabels": ["__meta_kubernetes_pod_label_ray_io_cluster"],
               "targetLabel": CLUSTER_LABEL}
    return {"apiVersion": PODMONITOR_API_VERSION, "kind": "PodMonitor",
            "metadata": _metadata(options.name),
            "spec": {"selector": {"matchLabels": {"ray.io/cluster": options.name}},
                     "podMetricsEndpoints": [{"port": METRICS_PORT_NAME,
                                              "relabelings": [relabel]}]}}


def _submitter_template(options: KubeRayOptions) -> dict[str, Any]:
    """The pod that runs ``ray job submit``: the image, Ray's token, nothing else (KubeRay
    adds the command and the dashboard's address)."""
    return {"metadata": {"labels": dict(PART_OF_LABEL)}, "spec": {
        "restartPolicy": "Never", "securityContext": {"fsGroup": RAY_IMAGE_GID},
        "containers": [{"name": "ray-job-submitter", "image": options.image,
                        "env": _auth_environment(), "volumeMounts": [dict(TOKEN_MOUNT)]}],
        "volumes": [_token_volume(options)]}}


def job_request(job_file: str, preset: str) -> JobRequest:
    """``raydeck submit``'s request for ``job_file`` as it runs from the image: the job
    contract's variables, the image's copy of the repository as the working dir (raydeck's
    settings are the nodes' environment).

    Raises:
        ConfigError: ``job_file`` is not a relative path inside the working dir.
    """
    if Path(job_file).is_absolute() or ".." in Path(job_file).parts:
        raise ConfigError(f"--job {job_file!r}: give it relative to the repository (the image "
                          f"copies it to {IMAGE_CODE_DIR}), e.g. jobs/digits_torch.py")
    name = default_run_name(job_file)
    return JobRequest(job_file=job_file, preset=preset, run_name=name,
                      run_id=new_run_id(name), runtime_env={"working_dir": IMAGE_CODE_DIR})


def ray_job(options: KubeRayOptions, request: JobRequest) -> dict[str, Any]:
    """A RayJob that submits ``request`` to the RayCluster, as ``raydeck submit`` would."""
    return {"apiVersion": KUBERAY_API_VERSION, "kind": "RayJob",
            "metadata": _metadata(_object_name(request.submission_id)),
            "spec": {"entrypoint": request.entrypoint, "jobId": request.submission_id,
                     "metadata": submitted_metadata(request),
                     "runtimeEnvYAML": yaml.safe_dump(submitted_runtime_env(request),
                                                      sort_keys=True),
                     "clusterSelector": {"ray.io/cluster": options.name},
                     "submissionMode": "K8sJobMode",
                     "submitterPodTemplate": _submitter_template(options)}}


def ray_service(options: KubeRayOptions, serve: ServeOptions, settings: Settings
                ) -> dict[str, Any]:
    """A RayService serving ``serve``'s model with ``raydeck serve``'s Serve config, on a
    cluster of its own shaped like the RayCluster."""
    config = serve_config(replace(serve, host="0.0.0.0", port=ServeOptions.port), settings)
    return {"apiVersion": KUBERAY_API_VERSION, "kind": "RayService",
            "metadata": _metadata(_object_name(f"{options.name}-{serve.name}")),
            "spec": {"serveConfigV2": yaml.safe_dump(config, sort_keys=False),
                     "rayClusterConfig": cluster_spec(options, settings)}}


def render(options: KubeRayOptions, settings: Settings, request: JobRequest,
           serve: ServeOptions) -> dict[str, dict[str, Any]]:
    """Every manifest, by relative path: ``cluster/`` is applied once (``kubectl apply -f``),
    the RayJob created per job, the RayService applied on its own (it brings its own cluster).
    """
    return {
        f"{CLUSTER_DIR}/spool-pvc.yaml": spool_claim(options),
        f"{CLUSTER_DIR}/raycluster.yaml": ray_cluster(options, settings),
        f"{CLUSTER_DIR}/podmonitor.yaml": pod_monitor(options),
        "rayjob.yaml": ray_job(options, request),
        "rayservice.yaml": ray_service(options, serve, settings),
    }


class _ManifestDumper(yaml.SafeDumper):
    """Multi-line strings (the RayJob's runtime env, the RayService's Serve config) as YAML
    blocks, readable in review."""


def _block_strings(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text,
                                   style="|" if "\n" in text else None)


_ManifestDumper.add_representer(str, _block_strings)


def write(manifests: dict[str, dict[str, Any]], out_dir: Path) -> list[Path]:
    """Write each manifest as YAML under ``out_dir`` (folders created); returns the paths."""
    paths = []
    for relative, manifest in manifests.items():
        path = out_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# Generated by `raydeck k8s render`; edit the options, not this file."
                        f"\n{yaml.dump(manifest, Dumper=_ManifestDumper, sort_keys=False)}")
        paths.append(path)
    return paths
