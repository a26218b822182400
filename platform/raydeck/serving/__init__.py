"""Serving registered models on Ray Serve behind MLflow's scoring protocol (``raydeck serve``).

Modules: :mod:`~raydeck.serving.protocol` (request formats and validation),
:mod:`~raydeck.serving.options` (:class:`ServeOptions`, shared by the two below),
:mod:`~raydeck.serving.server` (the replica: batching, following an alias, health),
:mod:`~raydeck.serving.app` (deploy, status, stop, Serve config files),
:mod:`~raydeck.serving.deploy_config` (Serve's declarative config with one application changed,
which the queue also uses to bound a deployment's replicas) and
:mod:`~raydeck.serving.batching`. The ingress every Ray node raydeck starts serves through
(HAProxy) is a node setting: :mod:`raydeck.cluster.serve_ingress`.
"""

from raydeck.serving.app import deploy, serve_config, status, stop
from raydeck.serving.options import ServeOptions

__all__ = ["ServeOptions", "deploy", "serve_config", "status", "stop"]
