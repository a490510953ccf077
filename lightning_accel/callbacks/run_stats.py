"""RunStats: counts the training samples and times the fit, for the samples/s of accel-train's summary."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_accel.batches import data_parallel_replicas, samples_in

__all__ = ["RunStats"]


class RunStats(Callback):
    """Counts the training samples of the whole run (this rank's batches times the ranks that load their own, so
    pipeline stages and tensor-parallel ranks that share a batch count it once) and times the fit.

    Logs:
        nothing; accel-train's summary reads it.
    """

    def __init__(self) -> None:
        self.samples = 0
        """Training samples over all data-parallel ranks."""
        self.fit_seconds = 0.0
        self._start: float | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.samples += samples_in(batch) * data_parallel_replicas(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._start is not None:
            self.fit_seconds += time.perf_counter() - self._start
            self._start = None
