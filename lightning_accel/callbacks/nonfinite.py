"""Reports NaN/inf losses with their step and, if asked, drops their update, stops or raises with a checkpoint."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_accel.callbacks._lr_hold import grad_scaler, hold_lr_schedulers, release_lr_schedulers
from lightning_accel.errors import ConfigError, LightningAccelWarning, NonFiniteLossError

__all__ = ["NonFiniteGuard", "drop_gradients", "nonfinite_report"]

Action = Literal["warn", "skip", "stop", "raise"]
ACTIONS: tuple[Action, ...] = ("warn", "skip", "stop", "raise")


def nonfinite_report(step: int, epoch: int, batch_idx: int, losses: Sequence[float]) -> str:
    """The warning text for a non-finite loss: where training was and the loss of each rank."""
    shown = ", ".join(f"{loss:.6g}" for loss in losses)
    what = f"loss {shown}" if len(losses) == 1 else f"loss per rank [{shown}]"
    return f"Non-finite {what} at global step {step} (epoch {epoch}, batch {batch_idx})"


class NonFiniteGuard(Callback):
    """Checks every training loss before its backward pass and acts on NaN/inf before bad gradients reach the weights.

    On a non-finite loss it warns on rank zero (`LightningAccelWarning`) with the global step, epoch, batch index
    and the loss of every rank, counts it, and then, by `action`:

    - "warn": nothing more; the update goes ahead (under fp16 the GradScaler skips it; otherwise the weights are
      likely to become NaN).
    - "skip": drops the optimizer step of the accumulation window that saw the loss, so neither the weights nor the
      optimizer state change (`on_before_optimizer_step` sets the gradients to None, or to NaN for a fused optimizer
      under a GradScaler, which then skips the step), and keeps step-interval LR schedulers from advancing on it.
      `trainer.global_step` still counts the step, as Lightning does.
    - "stop": as "skip", and first saves a checkpoint of the last good state (the weights, optimizer, schedulers and
      loops before this window's update) with `trainer.save_checkpoint`, then sets `trainer.should_stop`.
    - "raise": saves the same checkpoint, then raises `NonFiniteLossError`.

    The decision is reduced across ranks (any rank's non-finite loss counts), so every DDP rank skips, saves (a
    collective call) and stops or raises together. Cost: one host sync per micro-batch to read the check, plus one
    all-reduce of one number per micro-batch under a multi-process strategy; the rest runs only on a bad loss.

    The loss is the one Lightning passes to backward: under fp16 the GradScaler's scale is taken out again for the
    report, and under gradient accumulation it is the micro-batch loss divided by the window length. With "skip" or
    "stop", the LightningModule's `lr_scheduler_step` is stood in for by an instance attribute during training (the
    mechanism `SkippedStepGuard` shares; restored on `on_train_end`, `on_exception` and `teardown`).

    Keeps identical: every fit whose losses stay finite (the zoo: automatic and manual optimization).
    Changes on purpose: on a NaN/inf loss, what `action` says: the step dropped ("skip", the default in accel-train),
        a checkpoint then a stop or an error, or only the warning.
    Cannot serve: a `training_step` that returns no loss (manual optimization) is checked at `manual_backward`, the
        loss it is given; what it does not backward is not seen.

    Args:
        action: "warn", "skip", "stop" or "raise", as above.
        dirpath: folder of the checkpoint of "stop" and "raise"; None takes the `ModelCheckpoint`'s `dirpath`, else
            `<default_root_dir>/checkpoints`.
        filename: checkpoint name without ".ckpt"; `{step}` (global step) and `{epoch}` are filled in.

    Raises:
        ValueError: for an unknown `action` or a `filename` with fields other than `{step}` and `{epoch}`.

    Logs:
        `train/nonfinite_losses`: micro-batches with a non-finite loss on any rank in this fit (count, cumulative,
        kept in checkpoints), after every training batch.

    Example::

        trainer = Trainer(callbacks=[NonFiniteGuard(action="stop")])
        trainer.fit(model)
        trainer.callbacks[0].last_checkpoint_path  # ".../checkpoints/nonfinite-step1234.ckpt", or None
    """

    def __init__(
        self, action: Action = "warn", dirpath: str | Path | None = None, filename: str = "nonfinite-step{step}"
    ) -> None:
        if action not in ACTIONS:
            raise ConfigError(f"`NonFiniteGuard(action={action!r})` is not supported; use one of {list(ACTIONS)}.")
        try:
            filename.format(step=0, epoch=0)
        except (KeyError, IndexError, ValueError, AttributeError) as err:
            raise ConfigError(
                f"`NonFiniteGuard(filename={filename!r})` cannot be filled in ({err!r}); use only the fields "
                "`{step}` and `{epoch}`, e.g. 'nonfinite-step{step}'."
            ) from err
        self.action: Action = action
        self.dirpath = None if dirpath is None else str(dirpath)
        self.filename = filename
        self.nonfinite_losses = 0
        self.last_checkpoint_path: str | None = None  # the checkpoint written by "stop" or "raise"
        self._batch_idx = 0
        self._drop_window = False  # a non-finite loss since the last optimizer step: drop that step
        self._hold_step = False  # this batch's optimizer step was dropped: hold the LR schedule

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # a resumed fit restores the count afterwards
            self.nonfinite_losses = 0
            self.last_checkpoint_path = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._drop_window = self._hold_step = False
        if self.action in ("skip", "stop"):
            hold_lr_schedulers(pl_module, self, lambda: self._hold_step)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_idx = batch_idx

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        local_bad = not bool(torch.isfinite(loss.detach()).all())  # the host sync
        if not trainer.strategy.reduce_boolean_decision(local_bad, all=False):
            return
        self.nonfinite_losses += 1
        report = nonfinite_report(trainer.global_step, trainer.current_epoch, self._batch_idx, _losses(trainer, loss))
        if self.action == "warn":
            rank_zero_warn(f"{report}; the update goes ahead.", category=LightningAccelWarning)
            return
        self._drop_window = True
        if self.action == "skip":
            rank_zero_warn(f"{report}; its optimizer step is skipped.", category=LightningAccelWarning)
            return
        path = self._save_last_good(trainer)
        if self.action == "raise":
            raise NonFiniteLossError(f"{report}. The state before this step is saved in {path!r}.")
        rank_zero_warn(
            f"{report}; stopping. The state before this step is saved in {path!r}.", category=LightningAccelWarning
        )
        trainer.should_stop = True

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._drop_window:
            drop_gradients(optimizer, grad_scaler(trainer) is not None)
            self._drop_window = False
            self._hold_step = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._hold_step = False  # the schedulers have stepped (or not) for this batch
        pl_module.log("train/nonfinite_losses", float(self.nonfinite_losses), on_step=True, on_epoch=False)

    def _save_last_good(self, trainer: pl.Trainer) -> str:
        """Save the state before this window's update (all ranks call it; rank zero writes) and return its path."""
        name = self.filename.format(step=trainer.global_step, epoch=trainer.current_epoch) + ".ckpt"
        path = os.path.join(_checkpoint_dir(trainer, self.dirpath), name)
        trainer.save_checkpoint(path)
        self.last_checkpoint_path = path
        return path

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
        self._drop_window = self._hold_step = False

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"nonfinite_losses": self.nonfinite_losses}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.nonfinite_losses = int(state_dict.get("nonfinite_losses", 0))


def drop_gradients(optimizer: torch.optim.Optimizer, scaled: bool) -> None:
    """Make the coming optimizer step change neither the weights nor the optimizer state.

    Gradients set to None leave their parameters alone in `step()` (a zero gradient would still move them through
    momentum or weight decay). Under a GradScaler, an optimizer that unscales inside `GradScaler.step` (fused Adam)
    needs gradients to check, so they are set to NaN instead, which makes the scaler skip the step.
    """
    if scaled and getattr(optimizer, "_step_supports_amp_scaling", False):
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.fill_(float("nan"))
    else:
        optimizer.zero_grad(set_to_none=True)


def _losses(trainer: pl.Trainer, loss: torch.Tensor) -> list[float]:
    """Every rank's loss as passed to backward, with the GradScaler's scale taken out (a collective call)."""
    value = loss.detach().float().sum()  # a scalar on every rank, NaN/inf if any element is
    scaler = grad_scaler(trainer)
    if scaler is not None:
        value = value / scaler.get_scale()
    gathered = trainer.strategy.all_gather(value)
    return [float(v) for v in torch.as_tensor(gathered).reshape(-1).tolist()]


def _checkpoint_dir(trainer: pl.Trainer, dirpath: str | None) -> str:
    """`dirpath`, else the ModelCheckpoint's folder, else `<default_root_dir>/checkpoints`."""
    if dirpath is not None:
        return dirpath
    folder = getattr(trainer.checkpoint_callback, "dirpath", None)
    return str(folder) if folder else os.path.join(trainer.default_root_dir, "checkpoints")
