"""Gradient accumulation keyed by epoch, by optimizer step, or derived from a target global batch size."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel.errors import ConfigError, LightningAccelWarning
from lightning_accel.schedules import AccumulationPlan

__all__ = ["AccumulationScheduler"]


class AccumulationScheduler(Callback):
    """Accumulate gradients over a number of micro-batches that changes with the epoch or the optimizer step.

    A drop-in for Lightning's `GradientAccumulationScheduler` (epoch keys) that also takes optimizer-step keys
    (`unit="step"`, e.g. a batch-size ramp) or a target global batch size. Each window of micro-batches ends in one
    optimizer step; its loss is averaged over the window's real length, so the last, partial window of an epoch
    weighs each sample like a full one. Under DDP the gradients are not all-reduced on the micro-batches inside a
    window (`no_sync`), and under `ModelParallelStrategy` FSDP2 modules skip their reduce-scatter likewise.
    `lightning_accel.estimated_optimizer_steps(trainer)` counts the optimizer steps of a fit under this schedule, so
    LR schedules sized with it end where they should. The window position is saved in checkpoints.

    Args:
        scheduling: `{key: micro_batches}`; the key is an epoch (`unit="epoch"`) or the optimizer step at which a
            window starts (`unit="step"`). Keys before the first one accumulate 1 micro-batch.
        unit: "epoch" or "step".
        global_batch_size: instead of `scheduling`, accumulate `global_batch_size / (micro_batch_size x world_size)`
            micro-batches per step.
        micro_batch_size: per-device batch size for `global_batch_size`; None reads the train DataLoader's
            `batch_size`.

    Raises:
        ValueError: for a bad schedule, both or neither of `scheduling` and `global_batch_size`, or a global batch
            the micro-batches do not divide.

    Logs:
        `train/accumulation`: micro-batches of the current optimizer step's window (count).

    Example::

        trainer = Trainer(callbacks=[AccumulationScheduler({0: 1, 100: 4}, unit="step")])
    """

    def __init__(
        self,
        scheduling: Mapping[int, int] | None = None,
        *,
        unit: Literal["epoch", "step"] = "epoch",
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
    ) -> None:
        if (scheduling is None) == (global_batch_size is None):
            raise ValueError(
                f"Give exactly one of `scheduling` and `global_batch_size`; got scheduling={scheduling!r}, "
                f"global_batch_size={global_batch_size!r}."
            )
        if unit not in ("epoch", "step"):
            raise ValueError(f"`unit={unit!r}` is not supported; use 'epoch' or 'step'.")
        for name, value in (("global_batch_size", global_batch_size), ("micro_batch_size", micro_batch_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"`{name}={value!r}` must be a positive integer.")
        self.unit = unit
        self.scheduling = None if scheduling is None else _check_scheduling(scheduling, unit)
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self._plan: AccumulationPlan | None = None
        self._window_size = 0  # micro-batches of the current window
        self._window_pos = 0  # micro-batches of the current window started so far
        self._saved_accumulate = 1
        self._restore: list[Callable[[], None]] = []
        self._fsdp_modules: list[Any] = []
        self._loaded_plan: dict[str, Any] | None = None  # the plan of a loaded checkpoint, until this one resolves

    def accumulation_plan(self, trainer: pl.Trainer) -> AccumulationPlan:
        """The plan this callback follows in `trainer`, resolving `global_batch_size` against its DataLoader.

        Raises:
            ConfigError: when the global batch is not a multiple of micro-batch size x world size.
        """
        if self._plan is not None:
            return self._plan
        if self.scheduling is not None:
            points = dict(self.scheduling)
            points.setdefault(0, 1)
            self._plan = AccumulationPlan(self.unit, tuple(sorted(points.items())))
        else:
            assert self.global_batch_size is not None
            micro = self.micro_batch_size or _loader_batch_size(trainer)
            self._plan = AccumulationPlan.constant(micro_batches_for(self.global_batch_size, micro, trainer.world_size))
            rank_zero_info(
                f"AccumulationScheduler: global batch {self.global_batch_size} = {micro} per device x "
                f"{trainer.world_size} device(s) x {self._plan.points[0][1]} micro-batches per optimizer step."
            )
        return self._plan

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.accumulate_grad_batches != 1:
            raise ConfigError(
                f"`trainer.accumulate_grad_batches={trainer.accumulate_grad_batches}` cannot be combined with "
                "AccumulationScheduler, which sets it per window; leave it at 1 (`accumulation=none`) or drop "
                "the callback."
            )
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
            raise ConfigError("Use one accumulation callback: drop Lightning's GradientAccumulationScheduler.")
        if not pl_module.automatic_optimization:
            raise ConfigError(
                "AccumulationScheduler needs automatic optimization; with `automatic_optimization=False` step the "
                "optimizer yourself every N micro-batches."
            )
        if trainer.strategy.handles_gradient_accumulation:
            raise ConfigError(
                f"`strategy={type(trainer.strategy).__name__}` accumulates gradients itself; configure accumulation "
                "in the strategy instead of AccumulationScheduler."
            )
        self._plan = None
        self._window_size = self._window_pos = 0
        self._saved_accumulate = trainer.accumulate_grad_batches
        self._restore = _take_over_loop(trainer, self)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        for undo in self._restore:
            undo()
        self._restore = []
        for module in self._fsdp_modules:
            module.set_requires_gradient_sync(True, recurse=False)
        self._fsdp_modules = []
        trainer.accumulate_grad_batches = self._saved_accumulate

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fsdp_modules = _fsdp_modules(pl_module)  # configure_model has run by now

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._window_size = self._window_pos = 0  # Lightning steps at an epoch's end: windows restart each epoch

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._window_pos >= self._window_size:
            micro_batches = self.accumulation_plan(trainer).at(trainer.current_epoch, trainer.global_step)
            left_in_epoch = trainer.num_training_batches - batch_idx
            self._window_size = int(min(micro_batches, left_in_epoch)) if left_in_epoch > 0 else micro_batches
            self._window_pos = 0
            trainer.accumulate_grad_batches = self._window_size  # Lightning divides the loss by it
        self._window_pos += 1
        for module in self._fsdp_modules:
            module.set_requires_gradient_sync(self.window_complete, recurse=False)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.window_complete:
            pl_module.log("train/accumulation", float(self._window_size), on_step=True, on_epoch=False)

    @property
    def window_complete(self) -> bool:
        """Whether the current micro-batch ends its window (then the optimizer steps)."""
        return self._window_pos >= self._window_size

    @override
    def state_dict(self) -> dict[str, Any]:
        plan = self._plan
        described = None if plan is None else {"unit": plan.unit, "points": [list(p) for p in plan.points]}
        return {
            "window_size": self._window_size,
            "window_pos": self._window_pos,
            "plan": described if described is not None else self._loaded_plan,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._window_size = int(state_dict.get("window_size", 0))
        self._window_pos = int(state_dict.get("window_pos", 0))
        saved = self._loaded_plan = state_dict.get("plan")
        if saved is not None and self.scheduling is not None:
            mine = sorted({0: 1, **self.scheduling}.items())
            if saved["unit"] != self.unit or [tuple(p) for p in saved["points"]] != mine:
                rank_zero_warn(
                    f"Resuming with accumulation schedule {self.unit}:{dict(mine)} over a checkpoint written with "
                    f"{saved['unit']}:{dict(tuple(p) for p in saved['points'])}; the new schedule applies from here.",
                    category=LightningAccelWarning,
                )


def _check_scheduling(scheduling: Mapping[int, int], unit: str) -> dict[int, int]:
    if not isinstance(scheduling, Mapping) or not scheduling:
        raise ValueError(f"`scheduling={scheduling!r}` must be a non-empty dict of {{{unit}: micro_batches}}.")
    checked: dict[int, int] = {}
    for key, value in scheduling.items():
        key_int = int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else key
        if isinstance(key_int, bool) or not isinstance(key_int, int) or key_int < 0:
            raise ValueError(f"`scheduling` key {key!r} must be a {unit} number >= 0.")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`scheduling[{key_int}]={value!r}` must be a positive number of micro-batches.")
        checked[key_int] = value
    return dict(sorted(checked.items()))


def micro_batches_for(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-batches per optimizer step that make `global_batch_size` from `micro_batch_size` on `world_size` devices.

    Raises:
        ConfigError: when the product does not divide the global batch.
    """
    per_window = micro_batch_size * world_size
    if global_batch_size % per_window:
        lower = max(per_window, global_batch_size // per_window * per_window)
        raise ConfigError(
            f"`global_batch_size={global_batch_size}` is not a multiple of micro-batch size {micro_batch_size} x "
            f"world size {world_size} = {per_window}; use {lower} or {lower + per_window}, or change the batch size."
        )
    return global_batch_size // per_window


def _loader_batch_size(trainer: pl.Trainer) -> int:
    if trainer.train_dataloader is None:
        trainer.fit_loop.setup_data()
    loader = trainer.train_dataloader
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    if not isinstance(size, int):
        raise ConfigError(
            f"AccumulationScheduler cannot read a batch size from the train DataLoader ({type(loader).__name__}); "
            "pass `micro_batch_size=`."
        )
    return size


def _take_over_loop(trainer: pl.Trainer, scheduler: AccumulationScheduler) -> list[Callable[[], None]]:
    """Make Lightning's training loop step and zero gradients at this scheduler's window boundaries.

    Lightning decides both with `batch_idx % accumulate_grad_batches` within an epoch, which only holds for windows
    of one size aligned to the epoch start. Two methods of the loop objects are shadowed on the instances (restored
    by the returned callables): `_TrainingEpochLoop._accumulated_batches_reached` and
    `_AutomaticOptimization._make_zero_grad_fn` (Lightning 2.x).
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    automatic = epoch_loop.automatic_optimization
    for obj, name in ((epoch_loop, "_accumulated_batches_reached"), (automatic, "_make_zero_grad_fn")):
        if not callable(getattr(obj, name, None)):
            raise RuntimeError(
                f"AccumulationScheduler needs `{type(obj).__name__}.{name}`, which this Lightning "
                f"{pl.__version__} lacks; use Lightning 2.x or Lightning's GradientAccumulationScheduler."
            )

    def make_zero_grad_fn(batch_idx: int, optimizer: torch.optim.Optimizer) -> Callable[[], None] | None:
        if automatic._skip_backward or scheduler._window_pos != 1:
            return None

        def zero_grad_fn() -> None:
            automatic._on_before_zero_grad(optimizer)
            automatic._optimizer_zero_grad(batch_idx, optimizer)

        return zero_grad_fn

    epoch_loop._accumulated_batches_reached = lambda: scheduler.window_complete
    automatic._make_zero_grad_fn = make_zero_grad_fn

    def undo() -> None:
        for obj, name in ((epoch_loop, "_accumulated_batches_reached"), (automatic, "_make_zero_grad_fn")):
            obj.__dict__.pop(name, None)

    return [undo]


def _fsdp_modules(pl_module: pl.LightningModule) -> list[Any]:
    """FSDP2 (`fully_shard`) modules, which reduce-scatter gradients on every backward unless told otherwise."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6 keeps it under _composable
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return []
    return [module for module in pl_module.modules() if isinstance(module, FSDPModule)]
