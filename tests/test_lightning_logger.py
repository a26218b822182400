"""raydeck's Lightning logger on its own (no Ray Train): what a Lightning user sees in MLflow.

(Inside Ray Train, with worker failures: test_fault_tolerance.py.)
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest


@pytest.mark.timeout(300)
def test_lightning_logs_hparams_metrics_and_checkpoints_through_the_tracker(
    ray_cluster: None, mlflow_client: Any, tmp_path: Path
) -> None:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    import raydeck
    from raydeck.examples.digits_lightning import DigitsModule, _loaders
    from raydeck.integrations.lightning import RaydeckLogger

    key = f"lightning-logger-{uuid.uuid4().hex[:8]}"
    config = {"seed": 0, "batch_size": 64}
    train, val, _ = _loaders(config)
    with raydeck.get_tracker(key, run_name="lightning-logger") as tracker:
        logger = RaydeckLogger(tracker, log_checkpoints=True)
        assert logger.experiment is tracker and logger.version == tracker.run_id
        checkpoints = ModelCheckpoint(dirpath=tmp_path, monitor="val_accuracy", mode="max")
        trainer = pl.Trainer(max_epochs=2, logger=logger, callbacks=[checkpoints],
                             enable_progress_bar=False, enable_model_summary=False,
                             log_every_n_steps=5, num_sanity_val_steps=0)
        trainer.fit(DigitsModule(hidden=32, dropout=0.0, lr=0.01), train, val)
    run = mlflow_client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert {"hidden": "32", "dropout": "0.0", "lr": "0.01"}.items() <= run.data.params.items()
    val_steps = [m.step for m in mlflow_client.get_metric_history(run.info.run_id,
                                                                   "val_accuracy")]
    assert len(val_steps) == 2 and len(set(val_steps)) == 2
    train_steps = [m.step for m in mlflow_client.get_metric_history(run.info.run_id,
                                                                     "train_loss_step")]
    assert train_steps == sorted(set(train_steps)) and train_steps[0] == 4
    best = Path(checkpoints.best_model_path)
    assert run.data.tags["raydeck.lightning.best_model_path"] == str(best)
    assert float(run.data.tags["raydeck.lightning.best_model_score"]) == pytest.approx(
        float(checkpoints.best_model_score))
    uploaded = {a.path for a in mlflow_client.list_artifacts(run.info.run_id, "checkpoints")}
    assert f"checkpoints/{best.name}" in uploaded
