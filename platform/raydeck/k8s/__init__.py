"""Kubernetes: the KubeRay manifests ``raydeck k8s render`` writes (:mod:`~raydeck.k8s.kuberay`)."""
