"""RunStats: counts the training samples and times the fit, for the samples/s of accel-train's summary."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_accel import _lightning
from lightning_accel.batches import data_parallel_replicas, samples_in
from lightning_accel.errors import ConfigError, LightningAccelWarning

__all__ = ["RunStats"]


class RunStats(Callback):
    """Counts the training samples of the whole run (this rank's batches times the ranks that load their own, so
    pipeline stages and tensor-parallel ranks that share a batch count it once) and times the fit. It also checks,
    after the first validation (the sanity check, before any training step), that every `ModelCheckpoint` and
    `EarlyStopping` monitor is a metric the run logs, and warns when a resumed fit accumulates otherwise than the
    checkpoint's (the optimizer-step count and the LR schedule change with it).

    Keeps identical: the whole fit (the zoo).
    Changes on purpose: nothing in training.
    Cannot serve: a `ModelCheckpoint` or `EarlyStopping` monitor the run never logs: a `ConfigError` after the first
        validation (the sanity check), before any training step where there is one.

    Logs:
        nothing; accel-train's summary reads it.

    Raises:
        ConfigError: at the first validation, for a monitor the run does not log (Lightning found it at the first
            save, after training).
    """

    def __init__(self) -> None:
        self.samples = 0
        """Training samples over all data-parallel ranks."""
        self.batches = 0
        """Training batches this rank ran."""
        self.batches_without_loss = 0
        """Of those, the ones whose `training_step` returned None (Lightning then skips their backward)."""
        self.fit_seconds = 0.0
        self._start: float | None = None
        self._monitors_checked = False
        self._saved_accumulation: str | None = None  # the accumulation of the checkpoint this fit resumed

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()
        now = _accumulation(trainer)
        if self._saved_accumulation is not None and self._saved_accumulation != now:
            rank_zero_warn(
                f"This fit resumes a checkpoint that accumulated {self._saved_accumulation} and now "
                f"accumulates {now}: the samples per optimizer step, the number of optimizer steps and "
                "so the LR schedule differ from the run it continues.",
                category=LightningAccelWarning,
            )
        self._saved_accumulation = None

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._monitors_checked or trainer.state.fn != "fit":
            return
        self._monitors_checked = True
        from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

        logged = set(trainer.callback_metrics)
        for callback in _lightning.trainer_callbacks(trainer):
            monitor = getattr(callback, "monitor", None)
            if isinstance(callback, (ModelCheckpoint, EarlyStopping)) and monitor and monitor not in logged:
                name = type(callback).__name__
                raise ConfigError(
                    f"`{name}(monitor={monitor!r})` is not a metric this run logs (it logs "
                    f"{', '.join(sorted(logged)) or 'nothing yet'}); monitor one of them, or null. "
                    "In accel-train: `callbacks.<name>.monitor`."
                )

    @override
    def state_dict(self) -> dict[str, Any]:
        trainer = getattr(self, "_trainer", None)
        accumulation = _accumulation(trainer) if trainer is not None else self._saved_accumulation
        return {} if accumulation is None else {"accumulation": accumulation}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved_accumulation = state_dict.get("accumulation")

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.samples += samples_in(batch) * data_parallel_replicas(trainer)
        self.batches += 1
        self.batches_without_loss += not outputs  # None, or Lightning's empty result of a step without a loss

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._start is not None:
            self.fit_seconds += time.perf_counter() - self._start
            self._start = None


def _accumulation(trainer: Any) -> str:
    """How the fit accumulates, in words: an accumulation callback's own settings, else `accumulate_grad_batches`."""
    from lightning_accel.callbacks.accumulation import AccumulationScheduler

    scheduler = next(
        (cb for cb in _lightning.trainer_callbacks(trainer) if isinstance(cb, AccumulationScheduler)), None
    )
    if scheduler is not None:
        how = (
            f"global_batch_size={scheduler.global_batch_size}"
            if scheduler.global_batch_size is not None
            else f"{scheduler.unit} schedule {scheduler.scheduling}"
        )
        return f"with an AccumulationScheduler ({how})"
    return f"accumulate_grad_batches={trainer.accumulate_grad_batches}"
