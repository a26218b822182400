"""The MLflow tracking URIs raydeck's MLflow plugin serves, and the backend each names.

Owns: the ``raydeck`` scheme. ``raydeck://`` is raydeck's configured backend (settings, stack,
embedded default); ``raydeck+<backend URI>`` wraps that backend. Below the settings, so the
settings, the runtime env fill and the plugin (:mod:`raydeck.integrations.mlflow_store`) read
these URIs one way.
"""

from __future__ import annotations

RAYDECK_URI_SCHEME = "raydeck"


def unwrap_tracking_uri(uri: str) -> str:
    """The backend an MLflow tracking URI names for raydeck.

    Returns ``""`` for ``raydeck://`` (raydeck's own resolution: settings, stack, embedded
    default), ``<backend>`` for ``raydeck+<backend>`` (``raydeck+http://h:5000`` ->
    ``http://h:5000``), and any other URI unchanged. So every process that inherits
    ``MLFLOW_TRACKING_URI=raydeck+...`` (Ray workers, the proxy's actors) resolves one backend.
    """
    prefix = RAYDECK_URI_SCHEME + "+"
    if uri.startswith(prefix):
        return uri[len(prefix):]
    if uri.rstrip("/") == f"{RAYDECK_URI_SCHEME}:":
        return ""
    return uri
