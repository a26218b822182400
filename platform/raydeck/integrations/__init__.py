"""Integrations with training frameworks: each implements the framework's own interface on top of
raydeck's tracker and checkpoints (``raydeck.integrations.lightning`` for PyTorch Lightning;
``raydeck.integrations.mlflow_store`` and ``mlflow_runs``, MLflow's tracking-store plugin for
``raydeck://`` URIs, and ``mlflow_artifacts``, its artifact-repository plugin for the
``mlflow-artifacts`` locations of those runs; MLflow loads both through their entry points).

Imported explicitly, so raydeck never imports a framework a job does not use.
"""

from raydeck._internal.lazy import lazy_attributes

__getattr__, __dir__ = lazy_attributes(__name__, ("lightning", "mlflow_artifacts", "mlflow_runs",
                                                    "mlflow_store"))
