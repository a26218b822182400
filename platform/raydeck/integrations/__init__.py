"""Integrations with training frameworks: each implements the framework's own interface on top of
raydeck's tracker and checkpoints (``raydeck.integrations.lightning`` for PyTorch Lightning;
``raydeck.integrations.mlflow_store`` and ``mlflow_runs``, MLflow's tracking-store plugin for
``raydeck://`` URIs, which MLflow loads through its entry point).

Imported explicitly, so raydeck never imports a framework a job does not use.
"""

from raydeck._internal.lazy import lazy_attributes

__getattr__, __dir__ = lazy_attributes(__name__, ("lightning", "mlflow_runs", "mlflow_store"))
