"""Counts the optimizer steps fp16's GradScaler skipped and keeps the LR schedule from advancing on them."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_accel.callbacks._lr_hold import grad_scaler, hold_lr_schedulers, release_lr_schedulers

__all__ = ["SkippedStepGuard", "scale_dropped"]


def scale_dropped(scale_before: float, scale_after: float) -> bool:
    """Whether a GradScaler skipped the optimizer step, from its scale before `step()` and after `update()`.

    `GradScaler.update()` multiplies the scale by `backoff_factor` (< 1) exactly when the step found inf/NaN
    gradients and was skipped; otherwise the scale stays or grows.
    """
    return scale_after < scale_before


class SkippedStepGuard(Callback):
    """Holds step-interval LR schedulers on optimizer steps that the fp16 GradScaler skipped, and counts those steps.

    With `precision="16-mixed"` the GradScaler skips `optimizer.step()` when the gradients hold inf/NaN (it then
    lowers its scale), but Lightning still steps the LR schedulers, so every skipped step moves the schedule one
    step ahead of the weights: warm-up ends early and the decay finishes before training does (Lightning issues
    #5558, #21339). With this callback a skipped step leaves the schedulers of interval "step" where they were; those
    of interval "epoch" step as usual. `trainer.global_step` still counts the skipped step, as Lightning does.

    A step was skipped exactly when the scale after `update()` is lower than before the step (`scale_before` is read
    in `on_before_optimizer_step`, after unscaling and before `scaler.step`). This costs two host syncs
    (`GradScaler.get_scale()`) per optimizer step and nothing per micro-batch, so gradient accumulation adds no cost.
    Without a GradScaler (fp32, bf16) the callback does nothing and logs nothing.

    The schedulers are held through an instance attribute `lr_scheduler_step` on the LightningModule that stands in
    for the hook from `on_train_start` to the end of training (restored on `on_train_end`, `on_exception` and
    `teardown`); a module that overrides `lr_scheduler_step` keeps its override, which runs on the steps not held.
    Nothing is set on the schedulers, so their `state_dict` and checkpoints are unchanged. Made for automatic
    optimization; under manual optimization your code steps the schedulers and only the last optimizer step of each
    batch is checked.

    Keeps identical: every fit without fp16's GradScaler (fp32, bf16: it does nothing), and every step the scaler
        does not skip (the zoo).
    Changes on purpose: a step-interval LR scheduler no longer advances on a step the fp16 GradScaler skipped.
    Cannot serve: under manual optimization your code steps the schedulers; only the last optimizer step of each batch
        is checked.

    Logs:
        `train/skipped_steps`: optimizer steps skipped by the GradScaler in this fit (count, cumulative, kept
        in checkpoints and restored on resume), after every optimizer step.

    Example::

        trainer = Trainer(precision="16-mixed", callbacks=[SkippedStepGuard()])
        ...
        trainer.callbacks[0].skipped_steps  # e.g. 3 of the first steps, while the scale finds its level
    """

    def __init__(self) -> None:
        self.skipped_steps = 0
        self._scaler: torch.amp.GradScaler | None = None
        self._scale_before: float | None = None  # set between an optimizer step and the end of its batch
        self._skipped: bool | None = None  # this step's answer, once asked

    def _step_skipped(self) -> bool:
        """Whether the optimizer step of the current batch was skipped; asked after the step, answered once."""
        if self._scale_before is None or self._scaler is None:
            return False
        if self._skipped is None:
            self._skipped = scale_dropped(self._scale_before, self._scaler.get_scale())
        return self._skipped

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # a resumed fit restores the count afterwards
            self.skipped_steps = 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._scaler = grad_scaler(trainer)
        self._scale_before = None
        if self._scaler is not None:
            hold_lr_schedulers(pl_module, self, self._step_skipped)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._scaler is not None:
            self._scale_before = self._scaler.get_scale()
            self._skipped = None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._scale_before is None:  # no scaler, or a batch that only accumulated gradients
            return
        if self._step_skipped():
            self.skipped_steps += 1
        self._scale_before = self._skipped = None
        pl_module.log("train/skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._release(pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._release(pl_module)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release(pl_module)

    def _release(self, pl_module: pl.LightningModule) -> None:
        release_lr_schedulers(pl_module, self)
        self._scaler = None
        self._scale_before = None
        self._skipped = None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
