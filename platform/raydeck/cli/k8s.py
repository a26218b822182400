"""``raydeck k8s render``: KubeRay (and Kueue, RBAC) manifests generated from the stack's
definition and, with ``--teams``, the queue's teams file.

The manifests are written, never applied (``kubectl apply -f DIR`` does that). The command
reads no credentials: the only ones it writes are those given in ``--tracking-uri`` or
``--queue-database-url``, into a Secret's file readable by its owner only, and it prints none.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape

from raydeck.cli._console import console, setup_logging
from raydeck.cluster.serve_ingress import uses_haproxy

if TYPE_CHECKING:
    from raydeck.k8s.kueue import TeamSpec

app = typer.Typer(help="Kubernetes (KubeRay) manifests for raydeck.", no_args_is_help=True)

DEFAULT_OUT = Path("deploy/kuberay")
DEFAULT_JOB = "jobs/digits_torch.py"
DEFAULT_JOB_PRESET = "cpu-2"
DEFAULT_MODEL = "models:/digits@champion"


@app.command("render")
def render(
    out: Path = typer.Option(DEFAULT_OUT, "--out", help="Folder the manifests are written to."),
    name: str = typer.Option("raydeck", help="The RayCluster's name (a DNS label)."),
    image: str = typer.Option(None, show_default=False,
                              help="Image of the head and CPU workers (docker/Dockerfile, "
                                   "pushed where the cluster pulls). Default: compose's."),
    gpu_image: str = typer.Option(None, "--gpu-image", show_default=False,
                                  help="Image of the GPU workers (docker/Dockerfile built with "
                                       "RAY_IMAGE_TAG=...-gpu)."),
    cpu_workers: str = typer.Option("0:4", "--cpu-workers", metavar="MIN:MAX",
                                    help="CPU worker group's autoscaling bounds."),
    gpu_workers: str = typer.Option("0:2", "--gpu-workers", metavar="MIN:MAX",
                                    help="GPU worker group's autoscaling bounds."),
    gpus_per_worker: int = typer.Option(1, "--gpus-per-worker", help="GPUs of each GPU worker."),
    secret: str = typer.Option("raydeck-credentials",
                               help="Secret with RAY_AUTH_TOKEN, RAYDECK_S3_ACCESS_KEY_ID and "
                                    "RAYDECK_S3_SECRET_ACCESS_KEY (created with kubectl)."),
    spool_size: str = typer.Option("20Gi", "--spool-size", help="Tracking spool volume size."),
    storage_class: str = typer.Option("", "--storage-class",
                                      help="Spool volume's storage class (default: the "
                                           "cluster's)."),
    tracking_uri: str = typer.Option("", "--tracking-uri", show_default=False,
                                     help="MLflow as the pods reach it. Default: "
                                          "http://mlflow:5000, as in compose."),
    s3_endpoint: str = typer.Option("", "--s3-endpoint", show_default=False,
                                    help="S3 as the pods reach it. Default: http://minio:9000, "
                                         "as in compose."),
    job: str = typer.Option(DEFAULT_JOB, help="Job file of the RayJob (relative to the "
                                              "repository, which the image carries)."),
    preset: str = typer.Option(DEFAULT_JOB_PRESET, help="The RayJob's scaling preset."),
    model: str = typer.Option(DEFAULT_MODEL, help="Model URI the RayService serves."),
    serve_preset: str = typer.Option("cpu-1", "--serve-preset",
                                     help="The RayService's scaling preset."),
    queue_database_url: str = typer.Option(
        "", "--queue-database-url", show_default=False,
        help="The queue's PostgreSQL (postgresql://USER[:PASSWORD]@HOST/DB) for the head; "
             "a password goes into a Secret. Default: SQLite on the spool."),
    auth_mode: str = typer.Option("token", "--auth",
                                  help="token: the Secret's shared Ray token; k8s: Kubernetes "
                                       "token auth on the RayCluster, with RBAC (ray:write)."),
    teams: Path = typer.Option(None, "--teams", show_default=False,
                               help="The teams file of `raydeck queue --teams`: a namespace, "
                                    "RayCluster and RBAC per team."),
    use_kueue: bool = typer.Option(False, "--kueue",
                                   help="Kueue objects from --teams (flavors, a ClusterQueue "
                                        "per team in one cohort, LocalQueues, priority "
                                        "classes); the RayJob and RayService queue there."),
    capacity: str = typer.Option("", "--capacity", metavar="CPUS:GPUS", show_default=False,
                                 help="With --kueue: the CPUs and GPUs the teams share."),
    team: str = typer.Option("", "--team", show_default=False,
                             help="With --teams: the RayJob's and RayService's team "
                                  "(default: the first)."),
    priority: int = typer.Option(0, "--priority",
                                 help="With --kueue: the RayJob's and RayService's priority "
                                      "(a WorkloadPriorityClass)."),
) -> None:
    """Write a RayCluster, its spool volume claim and PodMonitor, a RayJob (`raydeck submit`)
    and a RayService (`raydeck serve`), from the settings `raydeck up` and compose use; with
    --teams one RayCluster per team's namespace, with --kueue the teams' Kueue queues, with
    --auth k8s Kubernetes token auth and who may use each RayCluster.

    Non-secret settings (experiment, buckets, prefix, region, log level) are yours, as
    `raydeck config` shows them; credentials are referenced from Secrets, never written
    elsewhere. Serve's ingress is HAProxy; RAY_SERVE_ENABLE_HA_PROXY=0 here renders Serve's
    proxy.
    """
    from raydeck.config.settings import load_settings
    from raydeck.k8s import kuberay, manifests
    from raydeck.k8s.kueue import Capacity
    from raydeck.k8s.options import (
        DEFAULT_GPU_IMAGE,
        DEFAULT_IMAGE,
        KubeRayOptions,
        WorkerBounds,
    )
    from raydeck.serving import ServeOptions
    from raydeck.train.presets import get_preset

    settings = load_settings()
    setup_logging(settings.log_level)
    team_specs, admins = _teams(teams) if teams is not None else ((), ())
    options = KubeRayOptions(
        name=name, image=image or DEFAULT_IMAGE,
        gpu_image=gpu_image or DEFAULT_GPU_IMAGE,
        cpu_workers=WorkerBounds.parse(cpu_workers, "--cpu-workers"),
        gpu_workers=WorkerBounds.parse(gpu_workers, "--gpu-workers"),
        gpus_per_worker=gpus_per_worker, secret=secret, spool_size=spool_size,
        storage_class=storage_class, tracking_uri=tracking_uri, s3_endpoint=s3_endpoint,
        queue_database_url=queue_database_url,
        # raydeck's images carry HAProxy; the user's RAY_SERVE_ENABLE_HA_PROXY wins.
        haproxy_ingress=uses_haproxy(os.environ, haproxy_found=True),
        auth=auth_mode, teams=team_specs, admins=admins, kueue=use_kueue,
        capacity=Capacity.parse(capacity) if capacity else None, team=team, priority=priority,
    )
    request = kuberay.job_request(job, get_preset(preset, settings.presets_file).name)
    serve = ServeOptions(model_uri=model, preset=serve_preset)
    paths = manifests.write(manifests.render(options, settings, request, serve), out)
    for path in paths:
        console.print(f"  wrote {escape(str(path))}", soft_wrap=True)
    if options.credentials.rendered:
        console.print("  the secrets/ files hold the credentials of the URIs given (mode "
                      "0600): apply them, never commit them", soft_wrap=True)
    folders = [folder for folder in ("namespaces", "kueue", "auth", "teams", "secrets",
                                     manifests.CLUSTER_DIR) if (out / folder).is_dir()]
    console.print(f"next: kubectl create secret generic {secret} ... (docs/deployment.md), "
                  "kubectl apply -R " + " ".join(f"-f {escape(str(out / f))}" for f in folders),
                  soft_wrap=True)


def _teams(path: Path) -> tuple[tuple[TeamSpec, ...], tuple[str, ...]]:
    """The teams file as ``raydeck queue --teams`` reads it (validated by the queue's own
    parser), as the Kubernetes manifests need it."""
    import yaml

    from raydeck.errors import ConfigError
    from raydeck.k8s.kueue import TeamSpec
    from raydeck.scheduling.queue.jobspec import TeamsFile

    if not path.is_file():
        raise ConfigError(f"--teams {path}: no such file")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--teams {path}: must map team names to {{weight, gpus, cpus}}")
    parsed = TeamsFile.parse(raw)

    def bound(value: float) -> float | None:
        return None if math.isinf(value) else value

    specs = tuple(TeamSpec(
        name=t.name, weight=t.weight,
        cpus=bound(t.quota.cpus) if t.quota else None,
        gpus=bound(t.quota.gpus) if t.quota else None,
        members=tuple(sorted(t.members)), max_priority=t.max_priority)
        for t in parsed.teams.values())
    if not specs:
        raise ConfigError(f"--teams {path}: names no team")
    return specs, tuple(sorted(parsed.admins))
