"""MLflow's proxied-artifacts repository (``mlflow-artifacts:`` locations) under raydeck's
tracking URIs.

A run on an ``mlflow server`` that serves artifacts (``--artifacts-destination``) stores its
artifacts at ``mlflow-artifacts:/...``, and MLflow resolves that location against the tracking
URI, accepting only ``http(s)://``: with ``MLFLOW_TRACKING_URI=raydeck+http://h:5000``,
``mlflow.log_artifact`` (and autolog's model summaries, ``log_model``) raised "the tracking URI
must be a valid http or https URI". This package registers :class:`RaydeckArtifactsRepository`
under MLflow's ``mlflow.artifact_repository`` entry point for the ``mlflow-artifacts`` scheme
(``pyproject.toml``): MLflow's own repository, given the backend a raydeck URI names. Any other
tracking URI passes through unchanged, so plain MLflow code in the same environment behaves as
before. Artifacts still go to the server directly and synchronously, as plain MLflow's do
(``docs/mlflow-plugin.md``).
"""

from __future__ import annotations

from mlflow.store.artifact import artifact_repository_registry
from mlflow.store.artifact.mlflow_artifacts_repo import MlflowArtifactsRepository
from mlflow.tracking._tracking_service.utils import get_tracking_uri

from raydeck.config.tracking_uri import RAYDECK_URI_SCHEME
from raydeck.integrations.mlflow_store import backend_settings


class RaydeckArtifactsRepository(MlflowArtifactsRepository):
    """MLflow's ``mlflow-artifacts:`` repository, resolved against the backend of a raydeck
    tracking URI (``raydeck://``: raydeck's configured backend)."""

    def __init__(self, artifact_uri: str, tracking_uri: str | None = None,
                 registry_uri: str | None = None) -> None:
        uri = tracking_uri or get_tracking_uri()
        if uri.startswith(RAYDECK_URI_SCHEME):
            uri = backend_settings(uri).tracking.uri
        super().__init__(artifact_uri, tracking_uri=uri, registry_uri=registry_uri)


# When this module is the first to import MLflow's artifact registry (a process that imports it
# before MLflow), the registry loads its entry points while this module is half imported, cannot
# find the class (MLflow warns "partially initialized module"), and keeps its own repository for
# the scheme: register it now that the class exists. (In the usual order, MLflow's registry is
# the one half imported here, loading this entry point; ``_artifact_repository_registry`` exists
# by then, its module-level helpers below it do not.)
artifact_repository_registry._artifact_repository_registry.register(
    "mlflow-artifacts", RaydeckArtifactsRepository)
