"""Kubernetes: the manifests ``raydeck k8s render`` writes (:mod:`~raydeck.k8s.manifests`):
KubeRay's objects (:mod:`~raydeck.k8s.kuberay`, options in :mod:`~raydeck.k8s.options`),
credentials in Secrets (:mod:`~raydeck.k8s.secrets`), Kueue (:mod:`~raydeck.k8s.kueue`) and
Kubernetes token auth with RBAC (:mod:`~raydeck.k8s.auth`)."""
