"""The digits classifier in PyTorch Lightning on Ray Train: raydeck's Lightning reference job.

The same model, data and driver as :mod:`raydeck.examples.digits`; only the per-worker loop
differs. It is the part to copy: Ray Train's Lightning utilities (``RayDDPStrategy``,
``RayLightningEnvironment``, ``prepare_trainer``) set up distributed training, and raydeck's
Lightning integration (:mod:`raydeck.integrations.lightning`) tracks the run and makes it
resume after a worker dies with each step logged once: ``RaydeckLogger`` as the logger,
``RaydeckReportCallback`` instead of Ray's ``RayTrainReportCallback``, and ``resume`` around
``trainer.fit``. ``jobs/digits_lightning.py`` runs it.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raydeck.examples.digits import DEFAULT_CONFIG, DigitsMLP, load_split, servable

# Each worker sees ~12 batches per epoch; log every 4th so step curves have points.
LOG_EVERY_N_STEPS = 4


class DigitsModule(pl.LightningModule):
    """The digits MLP as a LightningModule: cross-entropy, Adam, accuracy on validation."""

    def __init__(self, hidden: int = 128, dropout: float = 0.1, lr: float = 0.003) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = DigitsMLP(hidden, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
                      ) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log_dict({
            "val_loss": nn.functional.cross_entropy(logits, y),
            "val_accuracy": (logits.argmax(dim=1) == y).float().mean(),
        }, on_epoch=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])


def _loaders(config: dict[str, Any]) -> tuple[DataLoader, DataLoader]:
    x_train, y_train, x_val, y_val = load_split(config["seed"])
    train = DataLoader(TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
                       batch_size=config["batch_size"], shuffle=True)
    val = DataLoader(TensorDataset(torch.from_numpy(x_val), torch.from_numpy(y_val)),
                     batch_size=256)
    return train, val


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Train the digits module with Lightning on one Ray Train worker; every worker runs this."""
    import ray.train
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer

    import raydeck
    from raydeck.integrations.lightning import RaydeckLogger, RaydeckReportCallback, resume
    from raydeck.models import save_torch_model

    # One CPU process per worker: Lightning's hint to add dataloader workers does not apply.
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    config = {**DEFAULT_CONFIG, **config}
    with raydeck.get_tracker() as tracker:
        tracker.log_params({k: config[k] for k in DEFAULT_CONFIG})
        torch.manual_seed(config["seed"])
        train_loader, val_loader = _loaders(config)
        module = DigitsModule(config["hidden"], config["dropout"], config["lr"])
        trainer = pl.Trainer(
            max_epochs=config["epochs"],
            accelerator="auto", devices="auto",
            # Ray Train owns the processes: DDP over Ray's worker group.
            strategy=RayDDPStrategy(), plugins=[RayLightningEnvironment()],
            # raydeck reports checkpoints to Ray Train (Lightning's own are not needed).
            logger=RaydeckLogger(tracker), callbacks=[RaydeckReportCallback(tracker)],
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, log_every_n_steps=LOG_EVERY_N_STEPS,
        )
        trainer = prepare_trainer(trainer)
        # After a failure: the latest committed checkpoint (weights, optimizer, loop state).
        with resume(tracker) as ckpt_path:
            trainer.fit(module, train_loader, val_loader, ckpt_path=ckpt_path)
        if tracker.should_preempt():
            return  # the queue resumes the job from its last checkpoint
        if ray.train.get_context().get_world_rank() == 0:
            with tempfile.TemporaryDirectory() as tmp:
                served, example = servable(module.model, config["seed"])
                tracker.log_artifact(save_torch_model(served, Path(tmp), example))
