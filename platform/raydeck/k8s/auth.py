"""``--auth k8s``: Ray's Kubernetes token authentication (Ray 2.55+, KubeRay 1.6+) and the RBAC
that says who may use a RayCluster.

With ``spec.authOptions: {mode: token, enableK8sTokenAuth: true}`` KubeRay sets
``RAY_AUTH_MODE=token`` and ``RAY_ENABLE_K8S_TOKEN_AUTH=true`` in every Ray container (the
autoscaler's and the RayJob submitter's too) and mounts the pod's projected ServiceAccount
token at :data:`SA_TOKEN_DIR`, which Ray reads when no ``RAY_AUTH_TOKEN``/``_PATH`` is set.
Ray then accepts a request whose bearer token the Kubernetes API server authenticates
(TokenReview) and allows ``ray:write`` on that RayCluster (SubjectAccessReview). So:

- the Ray pods run as a ServiceAccount of their own, which may create TokenReviews and
  SubjectAccessReviews (a ClusterRole, bound cluster-wide) and has ``ray:write`` on its
  RayCluster (Ray's own processes authenticate with its token);
- a Role grants ``ray:write`` on the team's RayCluster, and a RoleBinding gives it to the
  team's members (Kubernetes users of the same names), the teams file's admins and the pods'
  ServiceAccount; a team without members is open to every authenticated user
  (``system:authenticated``), as raydeck's queue lets anyone submit to it.

KubeRay v1.7.0 refuses Kubernetes token auth in a RayJob's or RayService's own cluster
(``validation.go``: "K8s token auth mode is currently not supported"), so those keep the
shared token of the credentials Secret; a RayJob on the RayCluster (``clusterSelector``) runs
its submitter as the ServiceAccount and authenticates with its token.

Owns: these objects and the pod settings that differ under Kubernetes auth.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

AUTH_MODES = ("token", "k8s")
AUTH_OPTIONS = {"mode": "token", "enableK8sTokenAuth": True}
# Where KubeRay mounts the pod's projected ServiceAccount token (utils.RayTokenMountPath) and
# where Ray reads it (its kK8sSaTokenPath).
SA_TOKEN_DIR = "/var/run/secrets/ray.io/serviceaccount"
SA_TOKEN_PATH = f"{SA_TOKEN_DIR}/token"
# raydeck's own clients in the pods (raydeck submit from the head) send that token
# (raydeck.jobs.submission.K8S_TOKEN_FILE_ENV; a test checks the two agree).
K8S_TOKEN_FILE_ENV = "RAYDECK_K8S_TOKEN_FILE"
RAY_WRITE_VERB = "ray:write"
AUTHENTICATOR = "raydeck-ray-authenticator"
RBAC_API_VERSION = "rbac.authorization.k8s.io/v1"
ALL_AUTHENTICATED = "system:authenticated"
PART_OF_LABEL = {"app.kubernetes.io/part-of": "raydeck"}


def _metadata(name: str, namespace: str = "") -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": dict(PART_OF_LABEL)}
    if namespace:
        metadata["namespace"] = namespace
    return metadata


def service_account_name(cluster: str) -> str:
    return f"{cluster}-ray"


def role_name(cluster: str) -> str:
    return f"{cluster}-ray-write"


def service_account(cluster: str, namespace: str = "") -> dict[str, Any]:
    """The Ray pods' ServiceAccount."""
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": _metadata(service_account_name(cluster), namespace)}


def _service_account_subject(cluster: str, namespace: str) -> dict[str, Any]:
    # A ServiceAccount subject names its namespace; without teams, kubectl's (-n) is unknown
    # here: "default" is what `kubectl apply` without -n uses.
    return {"kind": "ServiceAccount", "name": service_account_name(cluster),
            "namespace": namespace or "default"}


def authenticator_role() -> dict[str, Any]:
    """What Ray's processes need to ask the API server about a token."""
    return {"apiVersion": RBAC_API_VERSION, "kind": "ClusterRole",
            "metadata": _metadata(AUTHENTICATOR),
            "rules": [{"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
                       "verbs": ["create"]},
                      {"apiGroups": ["authorization.k8s.io"],
                       "resources": ["subjectaccessreviews"], "verbs": ["create"]}]}


def authenticator_binding(cluster: str, namespaces: Sequence[str]) -> dict[str, Any]:
    """The authenticator role for the Ray pods' ServiceAccount in each namespace."""
    return {"apiVersion": RBAC_API_VERSION, "kind": "ClusterRoleBinding",
            "metadata": _metadata(AUTHENTICATOR),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": AUTHENTICATOR},
            "subjects": [_service_account_subject(cluster, ns) for ns in namespaces]}


def writer_role(cluster: str, namespace: str = "") -> dict[str, Any]:
    """``ray:write`` on this one RayCluster: submitting jobs, reaching its dashboard and GCS."""
    return {"apiVersion": RBAC_API_VERSION, "kind": "Role",
            "metadata": _metadata(role_name(cluster), namespace),
            "rules": [{"apiGroups": ["ray.io"], "resources": ["rayclusters"],
                       "resourceNames": [cluster], "verbs": [RAY_WRITE_VERB]}]}


def writer_binding(cluster: str, users: Sequence[str], namespace: str = "", *,
                   everyone: bool = False) -> dict[str, Any]:
    """The writer role for the pods' ServiceAccount, ``users`` and, when ``everyone``, every
    authenticated user."""
    subjects = [_service_account_subject(cluster, namespace)]
    subjects += [{"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": user}
                 for user in sorted(set(users))]
    if everyone:
        subjects.append({"kind": "Group", "apiGroup": "rbac.authorization.k8s.io",
                         "name": ALL_AUTHENTICATED})
    return {"apiVersion": RBAC_API_VERSION, "kind": "RoleBinding",
            "metadata": _metadata(role_name(cluster), namespace),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                        "name": role_name(cluster)},
            "subjects": subjects}
