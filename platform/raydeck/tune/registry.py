"""Registering a sweep's best model in MLflow's model registry: one step, one function.

Owns: :func:`register_best`, which rebuilds the best trial's model from its best checkpoint,
logs it as an MLflow model in the trial's child run and registers it, with tags that point back
to the sweep and the trial. Does not own: choosing the best trial (:mod:`raydeck.tune.summary`).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from raydeck.config.settings import Settings
from raydeck.errors import ConfigError
from raydeck.tune.config import SweepConfig, SweepJob
from raydeck.tune.summary import TrialSummary

REGISTERED_MODEL_TAG = "raydeck.registered_model"


def register_best(grid: Any, best: TrialSummary, config: SweepConfig, job: SweepJob,
                  parent: Any, settings: Settings) -> str:
    """Log the best trial's best checkpoint as an MLflow model in its run, and register it.

    Returns:
        ``models:/<name>/<version>``.

    Raises:
        ConfigError: the best trial saved no checkpoint (single-process trials checkpoint when
            they pass ``model=`` to :func:`raydeck.tune.report`).
    """
    import mlflow
    from mlflow.tracking import MlflowClient

    from raydeck.models import METRIC_TAG_PREFIX, MODEL_ARTIFACT_PATH, RUN_TAG, save_torch_model
    from raydeck.storage import credentials_in_env
    from raydeck.train.checkpointing import load_model_state

    assert job.model_factory is not None and config.register_model_as is not None
    client = MlflowClient(settings.tracking.uri)
    result = next(r for r in grid if str(r.metrics.get("trial_id")) == best.trial_id)
    model = job.model_factory(best.config)
    checkpoint = _best_checkpoint(result, config, settings)
    if checkpoint is None:
        raise ConfigError(f"best trial {best.trial_id} saved no checkpoint to register")
    with checkpoint.as_directory() as directory:
        load_model_state(directory, model)
    with tempfile.TemporaryDirectory() as tmp, credentials_in_env(settings.storage):
        served, example = (job.serving_model(model, best.config) if job.serving_model
                           else (model.cpu(), None))
        saved = save_torch_model(served, Path(tmp), example)
        client.log_artifacts(best.run_id, str(saved), MODEL_ARTIFACT_PATH)
        mlflow.set_tracking_uri(client.tracking_uri)
        version = mlflow.register_model(
            f"runs:/{best.run_id}/{MODEL_ARTIFACT_PATH}", config.register_model_as,
            tags={"raydeck.sweep": config.key, "raydeck.sweep_run_id": parent.run_id,
                  "raydeck.trial_id": best.trial_id, RUN_TAG: best.run_id,
                  METRIC_TAG_PREFIX + config.metric: json.dumps(best.best_score)},
        )
    uri = f"models:/{config.register_model_as}/{version.version}"
    parent.set_tags({REGISTERED_MODEL_TAG: uri})
    return uri


def _best_checkpoint(result: Any, config: SweepConfig, settings: Settings) -> Any:
    """The trial's best checkpoint: Tune's (single-process trials) or, for a distributed trial,
    the Ray Train checkpoint of its best reported epoch (``checkpoint_uri`` in its results)."""
    from raydeck.storage import checkpoint_at

    # Ray raises (rather than answering None) for a trial without Tune checkpoints.
    if result.best_checkpoints:
        checkpoint = result.get_best_checkpoint(config.metric, config.mode)
        if checkpoint is not None:
            return checkpoint
    history = result.metrics_dataframe
    if history is None or "checkpoint_uri" not in history or config.metric not in history:
        return None
    rows = history.dropna(subset=[config.metric, "checkpoint_uri"])
    if rows.empty:
        return None
    index = rows[config.metric].idxmax() if config.mode == "max" else rows[config.metric].idxmin()
    return checkpoint_at(settings, str(rows.loc[index, "checkpoint_uri"]))
