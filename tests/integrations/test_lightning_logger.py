"""raydeck's Lightning logger on its own (no Ray Train): what a Lightning user sees in MLflow.

(Inside Ray Train, with worker failures: test_fault_tolerance.py.)
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.processes import wait_until


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
    train, val = _loaders(config)
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


# --- What a Lightning user logs every day must never abort fit (issue 14, items 1 and 5) --------
LONG_NOTES = "".join(str(i % 10) for i in range(10_000))
STEPS_PER_EPOCH = 4


def _ranker(fail_at_step: int | None = None) -> Any:
    """A tiny model that logs ``recall@5`` every step and has a 10,000-character hyperparameter
    (a config dump or prompt, as users pass); raises at ``fail_at_step`` if given."""
    import pytorch_lightning as pl
    import torch
    from torch import nn

    class Ranker(pl.LightningModule):
        def __init__(self, notes: str, lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = nn.Linear(4, 2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.global_step == fail_at_step:
                raise RuntimeError("the model diverged")
            x, y = batch
            logits = self.layer(x)
            self.log("recall@5", (logits.argmax(dim=1) == y).float().mean())
            return nn.functional.cross_entropy(logits, y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])

    return Ranker(LONG_NOTES)


def _fit(module: Any, logger: Any, default_root_dir: Path) -> Any:
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16 * STEPS_PER_EPOCH, 4, generator=generator),
                         torch.randint(0, 2, (16 * STEPS_PER_EPOCH,), generator=generator))
    trainer = pl.Trainer(max_epochs=2, logger=logger, callbacks=[ModelCheckpoint()],
                         default_root_dir=default_root_dir, log_every_n_steps=1,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(data, batch_size=16))
    return trainer


@pytest.mark.timeout(300)
def test_fit_completes_with_keys_and_hyperparameters_mlflow_would_refuse(
    ray_cluster: None, mlflow_client: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import raydeck
    from raydeck.integrations.lightning import RaydeckLogger

    key = f"lightning-sanitize-{uuid.uuid4().hex[:8]}"
    save_dir = tmp_path / "logs"
    with caplog.at_level("WARNING", logger="raydeck.integrations.lightning"), \
            raydeck.get_tracker(key, run_name="lightning-sanitize") as tracker:
        logger = RaydeckLogger(tracker, save_dir=save_dir)
        trainer = _fit(_ranker(), logger, tmp_path / "root")
        # Values Lightning's own self.log refuses, but code calling the logger may pass.
        logger.log_metrics({"comment": "not a number", "val/acc(top-1)": 0.5}, step=0)

    run = mlflow_client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    recall = mlflow_client.get_metric_history(run.info.run_id, "recall5")
    assert len(recall) == 2 * STEPS_PER_EPOCH
    assert "recall@5" not in run.data.metrics and "comment" not in run.data.metrics
    assert run.data.metrics["val/acctop-1"] == 0.5
    assert run.data.params["notes"] == LONG_NOTES[:6000] and run.data.params["lr"] == "0.1"
    full = mlflow_client.download_artifacts(run.info.run_id, "lightning/truncated_params.json")
    assert json.loads(Path(full).read_text()) == {"notes": LONG_NOTES}
    # Every recall@5 value, the cut param and the renamed val/acc(top-1); the string dropped.
    assert run.data.tags["raydeck.sanitized_values"] == str(len(recall) + 2)
    assert run.data.tags["raydeck.dropped_values"] == "1"
    warned = [r.getMessage() for r in caplog.records if "'recall@5'" in r.getMessage()]
    assert len(warned) == 1 and "'recall5'" in warned[0]
    # Lightning's paths: trainer.log_dir is the logger's save_dir, and a ModelCheckpoint
    # without dirpath writes under <save_dir>/<experiment id>/<run id>/checkpoints.
    assert trainer.log_dir == str(save_dir)
    assert Path(trainer.checkpoint_callback.best_model_path).parent == (
        save_dir / run.info.experiment_id / run.info.run_id / "checkpoints")


@pytest.mark.timeout(300)
def test_a_failed_fit_ends_the_run_failed(
    ray_cluster: None, mlflow_client: Any, tmp_path: Path
) -> None:
    import raydeck
    from raydeck.integrations.lightning import RaydeckLogger

    # No `with` block and no finish(): only Lightning's finalize("failed") can end the run.
    tracker = raydeck.get_tracker(f"lightning-failed-{uuid.uuid4().hex[:8]}",
                                  run_name="lightning-failed")
    fail_at = STEPS_PER_EPOCH + 2
    with pytest.raises(RuntimeError, match="the model diverged"):
        _fit(_ranker(fail_at_step=fail_at), RaydeckLogger(tracker), tmp_path)

    wait_until(lambda: mlflow_client.get_run(tracker.run_id).info.status == "FAILED", 120,
               "run ended FAILED by finalize('failed')")
    wait_until(lambda: len(mlflow_client.get_metric_history(tracker.run_id, "recall5"))
               == fail_at, 60, "the steps before the failure landed")
    # As MLFlowLogger with a tracking server: no log_dir, checkpoints in the Trainer's root.
    run = mlflow_client.get_run(tracker.run_id)
    checkpoints = tmp_path / run.info.experiment_id / run.info.run_id / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == [f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"]
