"""Trained models in MLflow's format, so the MLflow UI, the registry and Ray Serve can load them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

MODEL_ARTIFACT_PATH = "model"


def save_torch_model(model: Any, directory: Path, input_example: Any | None = None) -> Path:
    """Save a torch module in MLflow's pytorch flavor under ``directory/model``.

    The pickle format keeps saving fast and needs no example input (the module's class must be
    importable where it is loaded); an ``input_example`` adds a signature shown in the MLflow UI.
    Pinning the requirements skips MLflow's requirement inference, which imports the world.

    Returns:
        The model directory, ready for ``tracker.log_artifact`` or ``log_artifacts``.
    """
    import mlflow.pytorch
    import torch

    target = directory / MODEL_ARTIFACT_PATH
    # MLflow warns on every pickle save; the choice is deliberate (see above), so say it once
    # here instead of in every job log.
    mlflow_logger = logging.getLogger("mlflow.pytorch")
    level = mlflow_logger.level
    mlflow_logger.setLevel(logging.ERROR)
    try:
        mlflow.pytorch.save_model(
            model, str(target), serialization_format="pickle", input_example=input_example,
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
        )
    finally:
        mlflow_logger.setLevel(level)
    return target
