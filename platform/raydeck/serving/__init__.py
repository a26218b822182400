"""Serving registered models on Ray Serve behind MLflow's scoring protocol (``raydeck serve``).

Modules: :mod:`~raydeck.serving.protocol` (request formats and validation),
:mod:`~raydeck.serving.options` (:class:`ServeOptions`, shared by the two below),
:mod:`~raydeck.serving.server` (the replica: batching, following an alias, health),
:mod:`~raydeck.serving.app` (deploy, status, stop, Serve config files).
"""

from raydeck.serving.app import deploy, serve_config, status, stop
from raydeck.serving.options import ServeOptions

__all__ = ["ServeOptions", "deploy", "serve_config", "status", "stop"]
