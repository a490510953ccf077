"""The template's MNIST pieces, offline: a datamodule that divides its batch by the world size and takes no
`persistent_workers`, and a module whose configure_optimizers calls `self.hparams.scheduler`."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel


class ToyDataModule(pl.LightningDataModule):
    def __init__(self, batch_size: int = 32, num_workers: int = 0, pin_memory: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.batch_size_per_device = batch_size

    def setup(self, stage: str | None = None) -> None:
        if self.trainer is not None:  # as the template: the configured batch is the global one
            self.batch_size_per_device = self.hparams.batch_size // self.trainer.world_size
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(512, 8, generator=gen)
        self.train_set = TensorDataset(x, (x.sum(1) > 0).long())
        self.val_set = TensorDataset(x[:64], (x[:64].sum(1) > 0).long())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size_per_device, shuffle=True,
                          num_workers=self.hparams.num_workers, pin_memory=self.hparams.pin_memory)  # fmt: skip

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size_per_device, num_workers=self.hparams.num_workers)


class ToyModule(pl.LightningModule):
    def __init__(self, optimizer: Any, scheduler: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = self.hparams.optimizer(params=self.trainer.model.parameters())
        if self.hparams.scheduler is None:
            return {"optimizer": optimizer}
        # the one change lightning_accel's `scheduler` group needs: the fit's length, and a per-step interval
        total_steps = lightning_accel.estimated_optimizer_steps(self.trainer)
        scheduler = self.hparams.scheduler(optimizer=optimizer, total_steps=total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
