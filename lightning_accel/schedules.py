"""Optimizer-step accounting and LR scheduler factories that step once per optimizer step."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, OneCycleLR

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["configure_optimizers", "cosine_schedule", "onecycle_schedule", "total_optimizer_steps"]

OptimizerFactory = Callable[[Iterable[Any]], Optimizer]
SchedulerFactory = Callable[..., LRScheduler]


def total_optimizer_steps(trainer: pl.Trainer) -> int:
    """The number of optimizer steps the current fit will take, as the Trainer estimates it.

    Raises:
        ValueError: when the fit has no end (`max_steps=-1` and `max_epochs=-1`), so a schedule cannot be sized.
    """
    steps = trainer.estimated_stepping_batches
    if not math.isfinite(steps) or steps <= 0:
        raise ValueError(
            f"An LR schedule needs a finite number of optimizer steps, got {steps}; set `trainer.max_steps` or "
            "`trainer.max_epochs`, or use `scheduler=none`."
        )
    return int(steps)


def cosine_schedule(
    optimizer: Optimizer, total_steps: int, *, warmup_steps: int | float = 0, min_lr_ratio: float = 0.0
) -> LambdaLR:
    """Linear warm-up for `warmup_steps`, then cosine decay to `min_lr_ratio` x the base LR at `total_steps`.

    Args:
        optimizer: the optimizer whose base LRs are scaled.
        total_steps: optimizer steps of the whole fit.
        warmup_steps: linear warm-up from 0 to the base LR: an int counts optimizer steps, a float in [0, 1) is a
            fraction of `total_steps`.
        min_lr_ratio: final LR as a fraction of the base LR.

    Raises:
        ValueError: for a negative or too long warm-up or a ratio outside [0, 1].
    """
    if total_steps <= 0:
        raise ValueError(f"`total_steps={total_steps}` must be positive.")
    if isinstance(warmup_steps, float):
        if not 0.0 <= warmup_steps < 1.0:
            raise ValueError(f"`scheduler.warmup_steps={warmup_steps}` as a fraction of the fit must be within [0, 1).")
        warmup_steps = int(warmup_steps * total_steps)
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(
            f"`scheduler.warmup_steps={warmup_steps}` must be >= 0 and below the fit's {total_steps} optimizer steps."
        )
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"`scheduler.min_lr_ratio={min_lr_ratio}` must be within [0, 1].")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def onecycle_schedule(
    optimizer: Optimizer,
    total_steps: int,
    *,
    max_lr: float | None = None,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
    anneal_strategy: str = "cos",
) -> OneCycleLR:
    """torch's OneCycleLR sized to the fit; `max_lr` defaults to each param group's configured LR.

    Args:
        optimizer: the optimizer to schedule.
        total_steps: optimizer steps of the whole fit.
        max_lr: peak LR; None takes the optimizer's own LR per param group.
        pct_start: share of the steps spent warming up.
        div_factor: initial LR = max_lr / div_factor.
        final_div_factor: final LR = initial LR / final_div_factor.
        anneal_strategy: "cos" or "linear".
    """
    peak: float | list[float] = max_lr if max_lr is not None else [g["lr"] for g in optimizer.param_groups]
    return OneCycleLR(
        optimizer,
        max_lr=peak,
        total_steps=total_steps,
        pct_start=pct_start,
        div_factor=div_factor,
        final_div_factor=final_div_factor,
        anneal_strategy=anneal_strategy,
    )


def configure_optimizers(
    module: pl.LightningModule,
    optimizer: OptimizerFactory | None = None,
    lr_scheduler: SchedulerFactory | None = None,
    params: Iterable[Any] | None = None,
) -> Any:
    """Build what `LightningModule.configure_optimizers` returns from Hydra partials.

    The scheduler factory is called as `lr_scheduler(optimizer, total_steps=...)` and stepped every optimizer step.

    Example::

        def configure_optimizers(self):
            return lightning_accel.schedules.configure_optimizers(self, self.optimizer, self.lr_scheduler)
    """
    make_optimizer = optimizer if optimizer is not None else partial(torch.optim.AdamW, lr=1e-3)
    opt = make_optimizer(params if params is not None else module.parameters())
    if lr_scheduler is None:
        return opt
    scheduler = lr_scheduler(opt, total_steps=total_optimizer_steps(module.trainer))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}
