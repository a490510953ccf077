"""Scale the learning rate with the global batch (linear or square-root rule) at the start of the fit."""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_accel import _lightning
from lightning_accel.batches import data_parallel_replicas, loader_batch_size
from lightning_accel.errors import ConfigError

__all__ = ["LRScaling", "lr_scale_factor"]

Rule = Literal["none", "linear", "sqrt"]
_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")  # a param group's LRs (OneCycleLR keeps max/min/initial)


def lr_scale_factor(rule: Rule, global_batch: int, reference_global_batch: int) -> float:
    """The LR factor for `global_batch` against `reference_global_batch`: 1 (`none`), their ratio (`linear`, Goyal
    et al. 2017, for SGD) or its square root (`sqrt`, the usual rule for Adam-type optimizers).

    Raises:
        ValueError: for an unknown rule or a batch < 1.
    """
    if rule not in ("none", "linear", "sqrt"):
        raise ConfigError(f"`rule={rule!r}` must be 'none', 'linear' or 'sqrt'.")
    for name, value in (("global_batch", global_batch), ("reference_global_batch", reference_global_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"`{name}={value!r}` must be an integer >= 1.")
    ratio = global_batch / reference_global_batch
    return 1.0 if rule == "none" else ratio if rule == "linear" else math.sqrt(ratio)


class LRScaling(Callback):
    """Scale every optimizer's learning rate by the global batch over a reference global batch.

    The global batch is the train DataLoader's batch size x the data-parallel replicas (the distributed sampler's,
    else the world size) x `accumulate_grad_batches`. At `on_fit_start` (optimizers and schedulers exist) each
    param group's `lr`, `initial_lr`, `max_lr` and `min_lr` and each scheduler's `base_lrs` are multiplied by
    `lr_scale_factor(rule, global_batch, reference_global_batch)`, so warm-up, cosine and OneCycle schedules follow.
    A fit resumed from a checkpoint of a scaled fit is not scaled again (its optimizer state holds the scaled LRs).
    An accumulation schedule (AccumulationScheduler) counts at its first window.

    Keeps identical: the optimizer steps, the data and the schedules' shapes.
    Changes on purpose: every learning rate (and `initial_lr`, `max_lr`, `min_lr`, schedulers' `base_lrs`) times the
        rule's factor, so warm-up, decay and param groups added later by a fine-tuning callback follow (the zoo: every
        LR of every step is exactly twice the plain fit's with `linear` from half the batch).
    Cannot serve: a module that builds a new optimizer or resets its LR during the fit: the later LRs are its own.

    Logs:
        nothing; the scaled learning rate is reported at INFO.

    Args:
        rule: `none`, `linear` or `sqrt`.
        reference_global_batch: the global batch the configured LR was tuned for (one process, no accumulation: the
            DataLoader's batch size).

    Raises:
        ValueError: for an unknown rule or a reference < 1.

    Example::

        trainer = Trainer(devices=4, strategy="ddp", callbacks=[LRScaling("sqrt", reference_global_batch=32)])
    """

    def __init__(self, rule: Rule = "linear", reference_global_batch: int = 32) -> None:
        lr_scale_factor(rule, 1, reference_global_batch)  # checks both
        self.rule, self.reference_global_batch = rule, reference_global_batch
        self.factor: float | None = None
        """The factor applied in this fit (None before it, or when a resumed fit kept its checkpoint's)."""
        self.global_batch: int | None = None
        self._applied: float | None = None

    def _global_batch(self, trainer: pl.Trainer) -> int | None:
        batch = loader_batch_size(trainer.train_dataloader)
        if batch is None:
            return None
        return batch * data_parallel_replicas(trainer) * max(1, int(trainer.accumulate_grad_batches))

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._applied is not None and trainer.ckpt_path:  # resumed: the optimizer state holds the scaled LRs
            self.factor = None
            return
        if _lightning.loop_combined_loader(trainer.fit_loop, "LRScaling (counting the global batch)") is None:
            from lightning_accel.tuning.dataloader.timing import frozen_rng

            with frozen_rng():  # the fit loop's own call finds the loaders set up, its RNG draws undone
                trainer.fit_loop.setup_data()
        self.global_batch = self._global_batch(trainer)
        if self.global_batch is None:
            raise ConfigError(
                "`LRScaling` could not read the train DataLoader's batch size; set `batch_size` on it, or remove "
                "the callback."
            )
        factor = lr_scale_factor(self.rule, self.global_batch, self.reference_global_batch)
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                for key in _LR_KEYS:
                    if isinstance(group.get(key), (int, float)):
                        group[key] *= factor
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
            if hasattr(scheduler, "_last_lr"):
                scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
        self.factor = self._applied = factor
        rank_zero_info(
            f"LRScaling ({self.rule}): global batch {self.global_batch} vs reference "
            f"{self.reference_global_batch}: learning rates x {factor:.4g}"
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"applied": self._applied, "rule": self.rule, "reference_global_batch": self.reference_global_batch}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._applied = state_dict.get("applied")
