"""The MLflow tracking URIs raydeck's MLflow plugin serves, and the backend each names.

Owns: the ``raydeck`` scheme. ``raydeck://`` is raydeck's configured backend (settings, stack,
embedded default); ``raydeck+<backend URI>`` wraps that backend. Below the settings, so the
settings, the runtime env fill and the plugin (:mod:`raydeck.integrations.mlflow_store`) read
these URIs one way. Also owns where a run is in MLflow's UI (:func:`run_url`,
:func:`run_page`), so the CLI's links, a job's ``RunLink`` and a sweep's link to its best trial
are built one way.
"""

from __future__ import annotations

from raydeck._internal.redaction import redact_url

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


# Where `mlflow ui` serves by default: the page a person opens for a file or database store.
LOCAL_UI_PORT = 5000
LOCAL_UI_URL = f"http://127.0.0.1:{LOCAL_UI_PORT}"


def run_page(experiment_id: str, run_id: str) -> str:
    """A run's page in MLflow's UI, relative to wherever the UI is served
    (``#/experiments/<id>/runs/<run id>``): a link in a run's description opens it on the same
    UI, whichever address the reader's browser uses for it."""
    return f"#/experiments/{experiment_id}/runs/{run_id}"


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """A run's page on the MLflow server ``tracking_uri`` names, without credentials.

    ``""`` when ``tracking_uri`` is no server (a file or database store has a UI only once
    ``mlflow ui`` serves it: :func:`ui_command` says how).
    """
    backend = unwrap_tracking_uri(tracking_uri)
    if not backend.startswith(("http://", "https://")):
        return ""
    return f"{redact_url(backend).rstrip('/')}/{run_page(experiment_id, run_id)}"


def ui_command(tracking_uri: str) -> str:
    """The command that serves MLflow's UI over a file or database store, at
    :data:`LOCAL_UI_URL` (credentials left out of the URI)."""
    backend = redact_url(unwrap_tracking_uri(tracking_uri))
    return f"mlflow ui --backend-store-uri {backend} --port {LOCAL_UI_PORT}"
