"""``raydeck k8s render``: KubeRay manifests generated from the stack's definition.

The manifests are written, never applied (``kubectl apply -f DIR`` does that); no Secret value
is in them, so the command reads no credentials.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.markup import escape

from raydeck.cli._console import console, setup_logging
from raydeck.cluster.serve_ingress import uses_haproxy

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
) -> None:
    """Write a RayCluster, its spool volume claim and PodMonitor, a RayJob (`raydeck submit`)
    and a RayService (`raydeck serve`), from the settings `raydeck up` and compose use.

    Non-secret settings (experiment, buckets, prefix, region, log level) are yours, as
    `raydeck config` shows them; secrets are referenced from the Secret, never written.
    Serve's ingress is HAProxy; RAY_SERVE_ENABLE_HA_PROXY=0 here renders Serve's proxy.
    """
    from raydeck.config.settings import load_settings
    from raydeck.k8s import kuberay
    from raydeck.serving import ServeOptions
    from raydeck.train.presets import get_preset

    settings = load_settings()
    setup_logging(settings.log_level)
    options = kuberay.KubeRayOptions(
        name=name, image=image or kuberay.DEFAULT_IMAGE,
        gpu_image=gpu_image or kuberay.DEFAULT_GPU_IMAGE,
        cpu_workers=kuberay.WorkerBounds.parse(cpu_workers, "--cpu-workers"),
        gpu_workers=kuberay.WorkerBounds.parse(gpu_workers, "--gpu-workers"),
        gpus_per_worker=gpus_per_worker, secret=secret, spool_size=spool_size,
        storage_class=storage_class, tracking_uri=tracking_uri, s3_endpoint=s3_endpoint,
        # raydeck's images carry HAProxy; the user's RAY_SERVE_ENABLE_HA_PROXY wins.
        haproxy_ingress=uses_haproxy(os.environ, haproxy_found=True),
    )
    request = kuberay.job_request(job, get_preset(preset, settings.presets_file).name)
    serve = ServeOptions(model_uri=model, preset=serve_preset)
    paths = kuberay.write(kuberay.render(options, settings, request, serve), out)
    for path in paths:
        console.print(f"  wrote {escape(str(path))}", soft_wrap=True)
    console.print(f"next: kubectl create secret generic {secret} ... (docs/deployment.md), "
                  f"kubectl apply -f {escape(str(out / kuberay.CLUSTER_DIR))}", soft_wrap=True)
