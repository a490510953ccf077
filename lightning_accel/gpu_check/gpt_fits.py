"""The GPT example's fits that the parts time on CUDA: a small fit with a CSV logger, and a fit timed from its
warm-up to its end."""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import Strategy

    from examples.gpt import GPTLanguageModel

__all__ = ["Precision", "gpt_class", "next_byte_pairs", "timed_fit", "tiny_fit"]

Precision = Literal["32-true", "bf16-mixed"]
"""The precisions the check trains in."""


def gpt_class() -> type[GPTLanguageModel]:
    """The GPT example: `lightning_accel.examples` in a wheel, `examples/` beside the package in a checkout."""
    try:
        from lightning_accel.examples.gpt import GPTLanguageModel
    except ImportError:
        from examples.gpt import GPTLanguageModel
    return GPTLanguageModel


def next_byte_pairs(data: torch.Tensor) -> torch.utils.data.TensorDataset:
    """(input, target) samples of the GPT example, one per row of `data`: the target is the input shifted by one."""
    return torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:])


def tiny_fit(
    callbacks: list[pl.Callback],
    steps: int,
    precision: Precision = "32-true",
    model: pl.LightningModule | None = None,
    batch_size: int = 16,
    strategy: str | Strategy = "auto",
) -> float:
    """Seconds per training step of a small CUDA fit (the first 5 steps left out), logging to a throwaway CSV logger
    (DeviceStatsMonitor refuses a Trainer without one)."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    class _Timer(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_end(self, *args: object) -> None:
            torch.cuda.synchronize()
            self.times.append(time.perf_counter())

    timer = _Timer()
    module = model or gpt_class()(block_size=256, n_layer=4, n_head=8, n_embd=512)
    block = module.hparams.get("block_size", 256)
    data = torch.randint(0, 256, (steps * batch_size, block + 1))
    loader = torch.utils.data.DataLoader(next_byte_pairs(data), batch_size=batch_size)
    with tempfile.TemporaryDirectory() as logs:
        trainer = pl.Trainer(
            accelerator="cuda",
            devices=1,
            max_steps=steps,
            precision=precision,
            strategy=strategy,
            callbacks=[*callbacks, timer],
            logger=CSVLogger(logs),
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, loader)
    gaps = [b - a for a, b in zip(timer.times[5:], timer.times[6:], strict=False)]
    return statistics.median(gaps)


def timed_fit(
    model: pl.LightningModule,
    callbacks: list[pl.Callback],
    steps: int,
    warmup: int,
    precision: Precision,
    batch_size: int,
) -> float:
    """Seconds per training step of a CUDA fit, from the end of batch `warmup` to the end of training (the device
    synchronised only there, so the host queues work as it does in training); no logger, no checkpoint."""
    import lightning.pytorch as pl

    class _Clock(pl.Callback):
        def __init__(self) -> None:
            self.start = self.end = 0.0

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            if trainer.global_step == warmup:
                torch.cuda.synchronize()
                self.start = time.perf_counter()

        def on_train_end(self, *args: object) -> None:
            torch.cuda.synchronize()
            self.end = time.perf_counter()

    clock = _Clock()
    block = model.hparams["block_size"]
    data = torch.randint(0, 256, (steps * batch_size, block + 1), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(next_byte_pairs(data), batch_size=batch_size, pin_memory=True)
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=steps,
        precision=precision,
        callbacks=[*callbacks, clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    return (clock.end - clock.start) / (steps - warmup)
