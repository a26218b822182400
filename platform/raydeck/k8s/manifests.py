"""Every manifest ``raydeck k8s render`` writes, by file: which objects exist for the options
given (teams, Kueue, Kubernetes auth, credentialed URIs) and where each goes.

Without ``--teams``: ``cluster/`` (the RayCluster, its spool claim, its PodMonitor and, with
``--auth k8s``, its ServiceAccount and RBAC), ``rayjob.yaml``, ``rayservice.yaml``, and
``secrets/`` when a URI carried a credential. With ``--teams``: ``namespaces/`` (a namespace
per team), ``teams/<team>/`` (what ``cluster/`` holds, in the team's namespace, and its
LocalQueue under ``--kueue``), ``kueue/`` (the cluster-scoped Kueue objects), ``auth/`` (the
authenticator ClusterRole and its binding), and the RayJob and RayService in ``--team``'s
namespace.

Owns: the layout and writing the files (a Secret's readable by its owner only).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from raydeck.k8s import auth, kuberay, kueue
from raydeck.k8s.secrets import uri_secret
from raydeck.train.presets import get_preset

if TYPE_CHECKING:
    from raydeck.config.settings import Settings
    from raydeck.jobs.submission import JobRequest
    from raydeck.k8s.kueue import TeamSpec
    from raydeck.k8s.options import KubeRayOptions
    from raydeck.serving import ServeOptions

CLUSTER_DIR = kuberay.CLUSTER_DIR
SECRET_FILE_MODE = 0o600


def _cluster_objects(options: KubeRayOptions, settings: Settings, folder: str,
                     team: TeamSpec | None) -> dict[str, dict[str, Any]]:
    """A RayCluster with its claim, PodMonitor and (``--auth k8s``) RBAC, in ``team``'s
    namespace (None: kubectl's)."""
    namespace = team.namespace if team else ""
    objects = {
        f"{folder}/spool-pvc.yaml": kuberay.spool_claim(options, namespace),
        f"{folder}/raycluster.yaml": kuberay.ray_cluster(options, settings, namespace),
        f"{folder}/podmonitor.yaml": kuberay.pod_monitor(options, namespace),
    }
    if options.auth == "k8s":
        users = (*team.members, *options.admins) if team else ()
        objects |= {
            f"{folder}/serviceaccount.yaml": auth.service_account(options.name, namespace),
            f"{folder}/role.yaml": auth.writer_role(options.name, namespace),
            f"{folder}/rolebinding.yaml": auth.writer_binding(
                options.name, users, namespace, everyone=bool(team and not team.members)),
        }
    return objects


def render(options: KubeRayOptions, settings: Settings, request: JobRequest,
           serve: ServeOptions) -> dict[str, dict[str, Any]]:
    """Every manifest, by relative path (see the module's docstring)."""
    manifests: dict[str, dict[str, Any]] = {}
    labels = dict(kuberay.PART_OF_LABEL)
    if not options.teams:
        manifests |= _cluster_objects(options, settings, CLUSTER_DIR, None)
        secret = uri_secret(options.credentials, labels)
        if secret:
            manifests["secrets/uri-credentials.yaml"] = secret
        if options.auth == "k8s":
            manifests[f"{CLUSTER_DIR}/authenticator-clusterrole.yaml"] = (
                auth.authenticator_role())
            manifests[f"{CLUSTER_DIR}/authenticator-clusterrolebinding.yaml"] = (
                auth.authenticator_binding(options.name, [""]))
    for team in options.teams:
        namespace = team.namespace
        manifests[f"namespaces/{namespace}.yaml"] = {
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": namespace, "labels": dict(labels)}}
        manifests |= _cluster_objects(options, settings, f"teams/{namespace}", team)
        if options.kueue:
            manifests[f"teams/{namespace}/localqueue.yaml"] = kueue.local_queue(team)
        secret = uri_secret(options.credentials, labels, namespace)
        if secret:
            manifests[f"teams/{namespace}/secrets/uri-credentials.yaml"] = secret
    if options.teams and options.auth == "k8s":
        manifests["auth/clusterrole.yaml"] = auth.authenticator_role()
        manifests["auth/clusterrolebinding.yaml"] = auth.authenticator_binding(
            options.name, [team.namespace for team in options.teams])
    if options.kueue and options.capacity:
        for flavor in kueue.resource_flavors():
            manifests[f"kueue/resourceflavor-{flavor['metadata']['name']}.yaml"] = flavor
        for queue in kueue.cluster_queues(options.teams, options.capacity):
            manifests[f"kueue/clusterqueue-{queue['metadata']['name']}.yaml"] = queue
        for priority_class in kueue.priority_classes(kueue.top_priority(options.teams)):
            name = priority_class["metadata"]["name"]
            manifests[f"kueue/workloadpriorityclass-{name}.yaml"] = priority_class
    manifests["rayjob.yaml"] = kuberay.ray_job(
        options, request, settings, get_preset(request.preset, settings.presets_file))
    manifests["rayservice.yaml"] = kuberay.ray_service(
        options, serve, settings, get_preset(serve.preset, settings.presets_file))
    return manifests


class _ManifestDumper(yaml.SafeDumper):
    """Multi-line strings (the RayJob's runtime env, the RayService's Serve config) as YAML
    blocks, readable in review."""


def _block_strings(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text,
                                   style="|" if "\n" in text else None)


_ManifestDumper.add_representer(str, _block_strings)


def write(manifests: dict[str, dict[str, Any]], out_dir: Path) -> list[Path]:
    """Write each manifest as YAML under ``out_dir`` (folders created); returns the paths. A
    Secret's file is created readable and writable by its owner only (0600)."""
    paths = []
    for relative, manifest in manifests.items():
        path = out_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        text = (f"# Generated by `raydeck k8s render`; edit the options, not this file.\n"
                f"{yaml.dump(manifest, Dumper=_ManifestDumper, sort_keys=False)}")
        if manifest["kind"] == "Secret":
            path.unlink(missing_ok=True)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, SECRET_FILE_MODE)
            with os.fdopen(descriptor, "w") as handle:
                handle.write(text)
        else:
            path.write_text(text)
        paths.append(path)
    return paths
