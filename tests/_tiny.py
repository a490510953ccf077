"""The tiny model and data of the callback tests: a linear regression on random pairs, quick on any CPU.

A test that needs something more (a NaN loss at one batch, the LR each step used) subclasses `TinyRegression` and
overrides one hook. Subprocess scripts (torchrun cases) import this module too: `tests/` is on their PYTHONPATH
(see `_torchrun.torchrun`).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def tiny_data(length: int = 16, features: int = 4, seed: int | None = 0) -> TensorDataset:
    """`length` pairs (x of `features` normal values, y one normal value); the same pairs for the same `seed`."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return TensorDataset(torch.randn(length, features, generator=gen), torch.randn(length, 1, generator=gen))


def tiny_loader(length: int = 16, features: int = 4, batch_size: int = 4, seed: int | None = 0) -> DataLoader:
    """`tiny_data` in batches of `batch_size`, in order."""
    return DataLoader(tiny_data(length, features, seed), batch_size=batch_size)


def decaying_lr(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`configure_optimizers`' answer for `optimizer` under a step-interval LambdaLR: LR x 1 / (k + 1) on optimizer
    step k, so the LR a step used names the scheduler's position."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 / (k + 1))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class TinyRegression(pl.LightningModule):
    """`y ~ layer(x)` with `layer = nn.Linear(features, 1)`: MSE loss, SGD; counts its training steps.

    Args:
        features: inputs per sample.
        lr: SGD's learning rate.
        momentum: SGD's momentum.
        lr_decay: step the LR down as `decaying_lr` does.
        seed: seeds torch before the layer is built (the same weights in every process and every run).

    Attributes:
        initial: the layer's weights before training (copies).
        training_steps: `training_step` calls so far.
    """

    def __init__(
        self,
        features: int = 4,
        lr: float = 0.01,
        momentum: float = 0.0,
        lr_decay: bool = False,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        self.layer = nn.Linear(features, 1)
        self.initial = {k: v.detach().clone() for k, v in self.layer.state_dict().items()}
        self.lr, self.momentum, self.lr_decay = lr, momentum, lr_decay
        self.training_steps = 0

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """MSE in float32 (the layer's output may be float16 under autocast)."""
        x, y = batch
        return nn.functional.mse_loss(self.layer(x).float(), y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.training_steps += 1
        return self.loss(batch)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        return decaying_lr(optimizer) if self.lr_decay else optimizer
