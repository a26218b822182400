"""KubeRay objects for raydeck, generated from the stack's service and settings definition.

``raydeck k8s render`` (:mod:`raydeck.k8s.manifests` lays the files out) writes what a
Kubernetes cluster with the KubeRay operator needs to run raydeck's Ray side: a ``RayCluster``
(head, a CPU and a GPU worker group with autoscaling bounds), the tracking spool's
``PersistentVolumeClaim``, a ``PodMonitor`` for Prometheus Operator, a ``RayJob`` for one
``raydeck submit`` job and a ``RayService`` for one ``raydeck serve`` model. MLflow, S3 and
PostgreSQL are not rendered: the pods reach them where compose names them
(``http://mlflow:5000``, ``http://minio:9000``) unless told otherwise.

What is shared, so that compose, ``raydeck up`` and these manifests cannot drift (a test
compares all three): the ports of :mod:`raydeck.stack.services`, raydeck's settings variables
(:func:`raydeck.stack.services.settings_env`), the image, the data directory and the metrics
port of ``docker/docker-compose.yml``, ``raydeck submit``'s job contract
(:class:`raydeck.jobs.submission.JobRequest`) and ``raydeck serve``'s Serve config
(:func:`raydeck.serving.serve_config`).

Credentials: never a value outside a Secret (:mod:`raydeck.k8s.secrets`). Storage: one
``ReadWriteOnce`` claim, mounted by the RayCluster's head only. The RayService's head keeps its
data directory on an ``emptyDir``: Serve's replicas write no training metrics (no tracking
proxy, so no spool) and no queue runs there; an upgrade's second cluster gets its own. A
RayJob runs on the RayCluster (``clusterSelector``), or under Kueue on a cluster of its own
(Kueue admits no RayJob on an existing cluster), whose head spools to an ``emptyDir``: that
cluster lives as long as the job, whose driver ends once its runs' data is in MLflow.

Does not own: applying anything (no Kubernetes API is called) or the credentials Secret's
values.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from raydeck.cluster.node_env import NODE_ENV
from raydeck.cluster.serve_ingress import node_env
from raydeck.errors import ConfigError
from raydeck.jobs.submission import (
    JobRequest,
    default_run_name,
    new_run_id,
    submitted_metadata,
    submitted_runtime_env,
)
from raydeck.k8s import auth, kueue
from raydeck.k8s.options import RAY_VERSION, KubeRayOptions, WorkerBounds
from raydeck.k8s.secrets import MLFLOW_ENV, TOKEN_MOUNT, credential_env, token_volume
from raydeck.observability.prometheus import CLUSTER_LABEL
from raydeck.serving import ServeOptions, serve_config
from raydeck.stack.services import SECRET_SETTINGS_ENV, service, settings_env

if TYPE_CHECKING:
    from raydeck.config.settings import Settings
    from raydeck.train.presets import Preset

KUBERAY_API_VERSION = "ray.io/v1"
PODMONITOR_API_VERSION = "monitoring.coreos.com/v1"
# Compose's paths and ports inside the image: the spool's volume, the code docker/Dockerfile
# copies (a RayJob's working dir), Ray's --metrics-export-port, Ray's shared memory.
CONTAINER_DATA_DIR = "/home/ray/raydeck-data"
IMAGE_CODE_DIR = "/home/ray/raydeck"
METRICS_EXPORT_PORT = 8080
METRICS_PORT_NAME = "metrics"
SHM_SIZE = "2Gi"
# Ray's images run as user ray in group users (100): with the pods' fsGroup, the token file is
# readable by that group only and the spool's volume writable by it.
RAY_IMAGE_GID = 100
SHM_MOUNT = {"name": "shm", "mountPath": "/dev/shm"}
SPOOL_MOUNT = {"name": "spool", "mountPath": CONTAINER_DATA_DIR}
# Compose's ray-head variables the pods get another way, and the ones only they get: the token
# is a mounted file, not a value; the Prometheus and Grafana the dashboard embeds are the
# cluster's own (none is rendered), found through the PodMonitor; MLflow's credentials come
# from the Secrets (compose puts them in the tracking URI, if anywhere).
COMPOSE_ONLY_ENV = ("RAY_AUTH_TOKEN", "RAY_PROMETHEUS_HOST", "RAY_PROMETHEUS_NAME",
                    "RAY_GRAFANA_HOST", "RAY_GRAFANA_IFRAME_HOST")
KUBERAY_ONLY_ENV = ("RAY_AUTH_TOKEN_PATH", *MLFLOW_ENV)
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
# A RayJob's own cluster (under Kueue) is deleted this long after the job ends.
JOB_CLUSTER_TTL_S = 300

def _object_name(text: str) -> str:
    """``text`` as a Kubernetes object name: lower-case letters, digits and -, at most 63."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower())[:63].strip("-")



@dataclass(frozen=True)
class ClusterShape:
    """How one Ray cluster differs from another: the RayCluster's, the RayService's and a
    Kueue RayJob's.

    Attributes:
        groups: each worker group's name (``cpu``, ``gpu``) and bounds.
        autoscaling: KubeRay's in-tree autoscaler between the bounds (under Kueue only as an
            elastic job; otherwise each group runs at its bounds' one size).
        spool_claim: the head's data directory on this PersistentVolumeClaim; empty: on an
            ``emptyDir`` (a cluster whose data need not outlive its head pod).
        k8s_auth: Kubernetes token auth (:mod:`raydeck.k8s.auth`); else the shared token.
    """

    groups: tuple[tuple[str, WorkerBounds], ...]
    autoscaling: bool = True
    spool_claim: str = ""
    k8s_auth: bool = False


# --- pieces every pod shares ------------------------------------------------------------------
def _pod_environment(options: KubeRayOptions, settings: Settings, *, head: bool,
                     k8s_auth: bool) -> list[dict[str, Any]]:
    """The environment of every Ray container: raydeck's settings (the credentials by
    reference), Ray's token authentication, the variables of every Ray node and Serve's
    ingress."""
    env = _variables(settings_env(settings, data_dir=CONTAINER_DATA_DIR,
                                  tracking_uri=options.tracking_uri,
                                  s3_endpoint=options.s3_endpoint))
    env += credential_env(options.credentials, SECRET_SETTINGS_ENV, head=head)
    env += _variables({**NODE_ENV, **node_env(options.haproxy_ingress)})
    return env + _auth_environment(k8s_auth)


def _variables(values: Mapping[str, str]) -> list[dict[str, Any]]:
    return [{"name": name, "value": value} for name, value in values.items()]


def _auth_environment(k8s_auth: bool) -> list[dict[str, Any]]:
    """Compose's ``x-ray-auth``, the token read from the mounted Secret; under Kubernetes auth
    the pod's ServiceAccount token (KubeRay mounts it, Ray finds it), which raydeck's own
    clients in the pod send too."""
    token = ({"name": auth.K8S_TOKEN_FILE_ENV, "value": auth.SA_TOKEN_PATH} if k8s_auth else
             {"name": "RAY_AUTH_TOKEN_PATH", "value": f"{TOKEN_MOUNT['mountPath']}/token"})
    return [{"name": "RAY_AUTH_MODE", "value": "token"}, token]


def _ray_process_environment() -> list[dict[str, Any]]:
    """A Ray process outside the node containers (the autoscaler, the job submitter): Ray's
    token and the variables of every Ray node (:data:`NODE_ENV`)."""
    return _auth_environment(False) + _variables(NODE_ENV)


def _resources(cpu: str, memory: str, gpus: int = 0) -> dict[str, Any]:
    amounts: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if gpus:
        amounts["nvidia.com/gpu"] = gpus
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _pod(image: str, env: list[dict[str, Any]], ports: list[dict[str, Any]],
         resources: dict[str, Any], volumes: list[dict[str, Any]],
         mounts: list[dict[str, Any]], gpu: bool = False,
         service_account: str = "") -> dict[str, Any]:
    """A Ray pod template: one container named ``ray`` (KubeRay's first container). A copy of
    everything passed in, which pods share: no part of one pod is another's (nor a YAML alias).
    """
    spec: dict[str, Any] = {
        "securityContext": {"fsGroup": RAY_IMAGE_GID},
        "containers": [{"name": "ray", "image": image, "env": env, "ports": ports,
                        "resources": resources, "volumeMounts": mounts}],
        "volumes": volumes,
    }
    if service_account:
        spec["serviceAccountName"] = service_account
    if gpu:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists",
                                "effect": "NoSchedule"}]
    return copy.deepcopy({"metadata": {"labels": dict(PART_OF_LABEL)}, "spec": spec})


def _shm_volume() -> dict[str, Any]:
    """Compose's ``shm_size``: Ray's object store lives in /dev/shm."""
    return {"name": SHM_MOUNT["name"], "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}}


def _spool_volume(options: KubeRayOptions, claim: str) -> dict[str, Any]:
    if claim:
        return {"name": SPOOL_MOUNT["name"], "persistentVolumeClaim": {"claimName": claim}}
    return {"name": SPOOL_MOUNT["name"], "emptyDir": {"sizeLimit": options.spool_size}}


def spool_claim_name(options: KubeRayOptions) -> str:
    return f"{options.name}-spool"


# --- the clusters -----------------------------------------------------------------------------
def cluster_spec(options: KubeRayOptions, settings: Settings, shape: ClusterShape
                 ) -> dict[str, Any]:
    """A Ray cluster's spec: the RayCluster's ``spec``, the RayService's ``rayClusterConfig``,
    a Kueue RayJob's ``rayClusterSpec``."""
    account = auth.service_account_name(options.name) if shape.k8s_auth else ""
    secret_volumes = [] if shape.k8s_auth else [token_volume(options.secret)]
    secret_mounts = [] if shape.k8s_auth else [TOKEN_MOUNT]
    metrics = {"name": METRICS_PORT_NAME, "containerPort": METRICS_EXPORT_PORT}
    head_ports = [{"name": KUBERAY_PORT_NAMES[port.name], "containerPort": port.default}
                  for port in service("ray-head").ports]
    head_ports += [metrics, {"name": SERVE_PORT_NAME, "containerPort": ServeOptions.port}]
    start_params = {RAY_START_FLAGS[port.name]: str(port.default)
                    for port in service("ray-head").ports}
    head = {
        "rayStartParams": {**start_params, "dashboard-host": "0.0.0.0",
                           "metrics-export-port": str(METRICS_EXPORT_PORT)},
        "template": _pod(options.image,
                         _pod_environment(options, settings, head=True,
                                          k8s_auth=shape.k8s_auth),
                         head_ports, _resources(HEAD_CPU, HEAD_MEMORY),
                         [*secret_volumes, _shm_volume(),
                          _spool_volume(options, shape.spool_claim)],
                         [*secret_mounts, SHM_MOUNT, SPOOL_MOUNT], service_account=account),
    }
    worker_env = _pod_environment(options, settings, head=False, k8s_auth=shape.k8s_auth)
    workers = []
    for group, bounds in shape.groups:
        gpu = group == "gpu"
        image, resources = ((options.gpu_image, _resources(
            GPU_WORKER_CPU, GPU_WORKER_MEMORY, options.gpus_per_worker)) if gpu
            else (options.image, _resources(CPU_WORKER_CPU, CPU_WORKER_MEMORY)))
        workers.append({
            "groupName": group, "replicas": bounds.min_replicas,
            "minReplicas": bounds.min_replicas, "maxReplicas": bounds.max_replicas,
            "rayStartParams": {"metrics-export-port": str(METRICS_EXPORT_PORT)},
            "template": _pod(image, worker_env, [metrics], resources,
                             [*secret_volumes, _shm_volume()], [*secret_mounts, SHM_MOUNT],
                             gpu=gpu, service_account=account),
        })
    spec: dict[str, Any] = {"rayVersion": RAY_VERSION,
                            "enableInTreeAutoscaling": shape.autoscaling}
    if shape.k8s_auth:
        spec["authOptions"] = dict(auth.AUTH_OPTIONS)
    elif shape.autoscaling:
        # The autoscaler talks to the GCS too: it needs the token like every Ray process.
        spec["autoscalerOptions"] = {"env": _ray_process_environment(),
                                     "volumeMounts": [dict(TOKEN_MOUNT)]}
    return {**spec, "headGroupSpec": head, "workerGroupSpecs": workers}


def _cluster_shape(options: KubeRayOptions) -> ClusterShape:
    """The RayCluster's: both groups within the user's bounds, the spool on its claim."""
    groups = (("cpu", options.cpu_workers), ("gpu", options.gpu_workers))
    # Under Kueue a RayCluster autoscales only as an elastic job (workload slices).
    autoscaling = not options.kueue or _elastic(groups)
    return ClusterShape(groups, autoscaling, spool_claim_name(options), options.auth == "k8s")


def _elastic(groups: tuple[tuple[str, WorkerBounds], ...]) -> bool:
    return any(b.min_replicas < b.max_replicas for _, b in groups)


def sized_groups(preset: Preset, workers: tuple[int, int], gpus_per_pod: int
                 ) -> tuple[tuple[str, WorkerBounds], ...]:
    """The one worker group a preset's ``workers`` (fewest, most) need: its GPU or CPU
    workers' pods, enough for their CPUs, GPUs and memory (the head runs the driver)."""
    gpu = preset.use_gpu
    pod_cpus = float(GPU_WORKER_CPU if gpu else CPU_WORKER_CPU)
    pod_memory_gb = float((GPU_WORKER_MEMORY if gpu else CPU_WORKER_MEMORY).removesuffix("Gi"))

    def pods(count: int) -> int:
        needs = [count * preset.cpus_per_worker / pod_cpus,
                 count * preset.memory_per_worker_gb / pod_memory_gb]
        if gpu:
            needs.append(count * preset.gpus_per_worker / gpus_per_pod)
        return max(1, math.ceil(max(needs) - 1e-9))

    bounds = WorkerBounds(pods(workers[0]), pods(workers[1]))
    return (("gpu" if gpu else "cpu", bounds),)


# --- the objects ------------------------------------------------------------------------------
def _metadata(name: str, namespace: str = "", labels: dict[str, str] | None = None,
              annotations: dict[str, str] | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": {**PART_OF_LABEL, **(labels or {})}}
    if namespace:
        metadata["namespace"] = namespace
    if annotations:
        metadata["annotations"] = annotations
    return metadata


def _elastic_annotation(elastic: bool) -> dict[str, str]:
    return {kueue.ELASTIC_ANNOTATION: "true"} if elastic else {}


def ray_cluster(options: KubeRayOptions, settings: Settings, namespace: str = ""
                ) -> dict[str, Any]:
    """The RayCluster; under Kueue in its namespace's LocalQueue, elastic (workload slices)
    when a group's bounds leave room to scale."""
    shape = _cluster_shape(options)
    elastic = options.kueue and _elastic(shape.groups)
    return {"apiVersion": KUBERAY_API_VERSION, "kind": "RayCluster",
            "metadata": _metadata(options.name, namespace,
                                  kueue.queue_labels() if options.kueue else None,
                                  _elastic_annotation(elastic)),
            "spec": cluster_spec(options, settings, shape)}


def spool_claim(options: KubeRayOptions, namespace: str = "") -> dict[str, Any]:
    """The RayCluster head's tracking spool: points not yet in MLflow, and the queue's SQLite
    database, survive a restart of the head pod. Mounted by that head only (ReadWriteOnce)."""
    spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"],
                            "resources": {"requests": {"storage": options.spool_size}}}
    if options.storage_class:
        spec["storageClassName"] = options.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": _metadata(spool_claim_name(options), namespace), "spec": spec}


def pod_monitor(options: KubeRayOptions, namespace: str = "") -> dict[str, Any]:
    """Prometheus Operator scrapes every Ray pod's metrics port (Ray's and raydeck's metrics),
    each series labelled with its cluster as the dashboards' ``cluster`` variable reads it."""
    relabel = {"sourceLabels": ["__meta_kubernetes_pod_label_ray_io_cluster"],
               "targetLabel": CLUSTER_LABEL}
    return {"apiVersion": PODMONITOR_API_VERSION, "kind": "PodMonitor",
            "metadata": _metadata(options.name, namespace),
            "spec": {"selector": {"matchLabels": {"ray.io/cluster": options.name}},
                     "podMetricsEndpoints": [{"port": METRICS_PORT_NAME,
                                              "relabelings": [relabel]}]}}


def _submitter_template(options: KubeRayOptions, k8s_auth: bool) -> dict[str, Any]:
    """The pod that runs ``ray job submit``: the image and Ray's token (KubeRay adds the
    command and the dashboard's address). Under Kubernetes auth, the RayCluster's
    ServiceAccount, whose token KubeRay mounts."""
    container: dict[str, Any] = {"name": "ray-job-submitter", "image": options.image}
    spec: dict[str, Any] = {"restartPolicy": "Never",
                            "securityContext": {"fsGroup": RAY_IMAGE_GID},
                            "containers": [container]}
    if k8s_auth:
        spec["serviceAccountName"] = auth.service_account_name(options.name)
    else:
        container.update(env=_ray_process_environment(), volumeMounts=[dict(TOKEN_MOUNT)])
        spec["volumes"] = [token_volume(options.secret)]
    return {"metadata": {"labels": dict(PART_OF_LABEL)}, "spec": spec}


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


def ray_job(options: KubeRayOptions, request: JobRequest, settings: Settings,
            preset: Preset) -> dict[str, Any]:
    """A RayJob that submits ``request`` as ``raydeck submit`` would: to the RayCluster, or
    under Kueue on a cluster of its own sized to ``preset`` (elastic when the preset is),
    deleted after the job, in the team's LocalQueue at ``options.priority``."""
    spec: dict[str, Any] = {
        "entrypoint": request.entrypoint, "jobId": request.submission_id,
        "metadata": submitted_metadata(request),
        "runtimeEnvYAML": yaml.safe_dump(submitted_runtime_env(request), sort_keys=True),
        "submissionMode": "K8sJobMode"}
    labels: dict[str, str] = {}
    elastic = False
    if options.kueue:
        groups = sized_groups(preset, (preset.min_workers, preset.max_workers),
                              options.gpus_per_worker)
        elastic = _elastic(groups)
        # Kueue refuses Kubernetes auth here too (KubeRay does): the shared token.
        shape = ClusterShape(groups, autoscaling=elastic)
        spec.update(rayClusterSpec=cluster_spec(options, settings, shape),
                    shutdownAfterJobFinishes=True, ttlSecondsAfterFinished=JOB_CLUSTER_TTL_S,
                    submitterPodTemplate=_submitter_template(options, k8s_auth=False))
        labels = kueue.queue_labels(options.priority)
    else:
        spec.update(clusterSelector={"ray.io/cluster": options.name},
                    submitterPodTemplate=_submitter_template(options, options.auth == "k8s"))
    return {"apiVersion": KUBERAY_API_VERSION, "kind": "RayJob",
            "metadata": _metadata(_object_name(request.submission_id), options.job_namespace,
                                  labels, _elastic_annotation(elastic)),
            "spec": spec}


def ray_service(options: KubeRayOptions, serve: ServeOptions, settings: Settings,
                preset: Preset) -> dict[str, Any]:
    """A RayService serving ``serve``'s model with ``raydeck serve``'s Serve config, on a
    cluster of its own: shaped like the RayCluster, or under Kueue sized to the most replicas
    Serve may run (``preset``; Kueue's elastic jobs do not cover RayServices). Its head's data
    directory is an ``emptyDir`` (see the module's docstring); its auth the shared token
    (KubeRay refuses Kubernetes auth on a RayService)."""
    config = serve_config(replace(serve, host="0.0.0.0", port=ServeOptions.port), settings)
    if options.kueue:
        replicas = max(preset.max_workers, serve.max_replicas or 0)
        groups = sized_groups(preset, (replicas, replicas), options.gpus_per_worker)
        shape = ClusterShape(groups, autoscaling=False)
    else:
        shape = replace(_cluster_shape(options), spool_claim="", k8s_auth=False)
    return {"apiVersion": KUBERAY_API_VERSION, "kind": "RayService",
            "metadata": _metadata(_object_name(f"{options.name}-{serve.name}"),
                                  options.job_namespace,
                                  kueue.queue_labels(options.priority) if options.kueue
                                  else None),
            "spec": {"serveConfigV2": yaml.safe_dump(config, sort_keys=False),
                     "rayClusterConfig": cluster_spec(options, settings, shape)}}
