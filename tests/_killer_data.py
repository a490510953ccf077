"""A text DataModule whose training workers SIGKILL themselves after a number of items: what a worker killed by a
memory limit looks like to the process that feeds on it."""

from __future__ import annotations

import os
import signal
from typing import Any

from torch.utils.data import DataLoader, Dataset, get_worker_info

from lightning_accel.examples import StdlibTextDataModule


class _Killing(Dataset):
    def __init__(self, inner: Any, kill_after: int) -> None:
        self.inner, self.kill_after, self.served = inner, kill_after, 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        self.served += 1  # each worker counts its own (its copy of the dataset)
        if get_worker_info() is not None and self.served > self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner[index]


class KilledWorkerData(StdlibTextDataModule):
    """`StdlibTextDataModule` whose train loader's workers each die (SIGKILL) after serving `kill_after` items."""

    def __init__(self, kill_after: int = 256, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kill_after = kill_after

    def train_dataloader(self) -> DataLoader:
        loader = super().train_dataloader()
        return DataLoader(
            _Killing(loader.dataset, self.kill_after),
            batch_size=loader.batch_size,
            shuffle=False,
            drop_last=True,
            num_workers=self.num_workers,
        )
