"""Gradient accumulation keyed by epoch, by optimizer step, or derived from a target global batch size."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any, Literal, TypeGuard

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lightning_accel import _lightning
from lightning_accel.batches import data_parallel_replicas, loader_batch_size, samples_in
from lightning_accel.errors import ConfigError, LightningAccelWarning
from lightning_accel.schedules import AccumulationPlan, estimated_optimizer_steps

__all__ = [
    "AccumulationScheduler",
    "ScheduleError",
    "ScheduleTypeError",
    "UnsupportedAccumulationError",
    "micro_batches_for",
]


# Lightning's GradientAccumulationScheduler raises these types; ours are both those and lightning_accel's ConfigError,
# so code (and tests) written against either catches them.
class ScheduleError(ConfigError, MisconfigurationException):
    """A bad schedule key or value (Lightning: `MisconfigurationException`)."""


class ScheduleTypeError(ConfigError, TypeError):
    """An empty schedule, or one that is no dict (Lightning: `TypeError`)."""


class UnsupportedAccumulationError(ConfigError, RuntimeError):
    """Manual optimization, or a strategy that fixes accumulation itself (Lightning: `RuntimeError`)."""


class AccumulationScheduler(Callback):
    """Accumulate gradients over a number of micro-batches that changes with the epoch or the optimizer step.

    A drop-in superset of Lightning's `GradientAccumulationScheduler` (epoch keys: the same arguments, public
    attributes `scheduling` with the implicit `{0: 1}` and `epochs`, methods `going_to_accumulate_grad_batches()` and
    `get_accumulate_grad_batches(epoch)`, checks and warning in `on_train_start`, and exception types: ours subclass
    Lightning's and `ConfigError`) that also takes optimizer-step keys (`unit="step"`, e.g. a batch-size ramp) or a
    target global batch size. Each window of micro-batches ends in one optimizer step; its loss is averaged over
    the window's real length, so the last, partial window of an epoch weighs each sample like a full one. Under DDP
    the gradients are not all-reduced on the micro-batches inside a window (`no_sync`), and under
    `ModelParallelStrategy` FSDP2 modules skip their reduce-scatter likewise. During the fit
    `trainer.estimated_stepping_batches` counts the optimizer steps this schedule takes, as
    `lightning_accel.estimated_optimizer_steps(trainer)` does, so LR schedules sized with either end where they
    should. The window position is saved in checkpoints.

    Keeps identical: for a constant factor k (`{0: k}`, or a global batch that resolves to k), the fit of
    `Trainer(accumulate_grad_batches=k)`, where no epoch ends in a partial window: the samples and their order, each
    loss divided by k, the optimizer step, `zero_grad` and step-interval LR scheduler step at each window's end, the
    weights, and the LR at every step of a schedule sized by `trainer.estimated_stepping_batches`; Lightning's
    `GradientAccumulationScheduler` API and exception types; `trainer.accumulate_grad_batches` and
    `estimated_stepping_batches` after the fit.

    Changes on purpose: a last, partial window of an epoch is averaged over its real length (Lightning divides by
    the full factor, so those samples weigh less). A loader without `__len__` (an `IterableDataset`) has it from the
    batch Lightning fetches ahead: a window that starts on the epoch's last batch divides it by 1, and one that
    started earlier (its losses divided by the full factor) has its gradients multiplied by full / real length in
    `on_before_optimizer_step`, after DDP's or FSDP's reduction and the GradScaler's unscaling, before gradient
    clipping and the LightningModule's hook (callbacks listed before this one see them unscaled). During the fit
    `trainer.accumulate_grad_batches` holds the window's size and `trainer.estimated_stepping_batches` the schedule's
    optimizer steps (Lightning's own answer where no step runs or the fit has no end). The checks also run in
    `setup`; string keys of digits (`{"2": 1}`, as Hydra passes them) are read as numbers.

    Cannot serve: manual optimization and strategies that accumulate themselves (DeepSpeed):
    `UnsupportedAccumulationError`. A Trainer with `accumulate_grad_batches` != 1, or Lightning's
    `GradientAccumulationScheduler` beside it: `ConfigError`. A `training_step` that takes `dataloader_iter` over a
    loader without `__len__`: nothing fetches ahead, so a partial last window of an epoch takes no step (as under
    Lightning's own accumulation); a `LightningAccelWarning` at train start. A factor that varies over the fit:
    `estimated_stepping_batches` still counts its optimizer steps, but code that turns them into batches or samples
    with `accumulate_grad_batches` does not hold; a `LightningAccelWarning` names
    `lightning_accel.estimated_optimizer_steps` when the property is read. A module that sizes its schedule from
    `trainer.accumulate_grad_batches` or `num_training_batches` itself in `configure_optimizers` reads 1 there (the
    first window sets the factor) and gets no warning: size it with `trainer.estimated_stepping_batches`. Overridden
    `optimizer_step`/`optimizer_zero_grad` run once per window, with a warning, as Lightning's.

    Args:
        scheduling: `{key: micro_batches}`, or a list of `[key, micro_batches]` pairs (what a Hydra config holds, so
            `callbacks.accumulation.scheduling=[[0,1],[50,2]]` replaces it from the command line); the key is an
            epoch (`unit="epoch"`) or the optimizer step at which a window starts (`unit="step"`). Keys before the
            first one accumulate 1 micro-batch.
        unit: "epoch" or "step".
        global_batch_size: instead of `scheduling`, accumulate `global_batch_size / (micro_batch_size x world_size)`
            micro-batches per step.
        micro_batch_size: per-device batch size for `global_batch_size`; None reads the train DataLoader's
            `batch_size`.

    Raises:
        ScheduleError: (a `MisconfigurationException`) for a negative or non-integer key, or a value below 1.
        ScheduleTypeError: (a `TypeError`) for an empty schedule or one that is no dict.
        ValueError: for both or neither of `scheduling` and `global_batch_size`, or a bad `unit`; a global batch
            the micro-batches do not divide (`ConfigError`, at fit start).
        UnsupportedAccumulationError: (a `RuntimeError`, at fit start) under manual optimization or a strategy that
            accumulates itself (DeepSpeed).

    Logs:
        `train/accumulation`: micro-batches of the current optimizer step's window (count).

    Example::

        trainer = Trainer(callbacks=[AccumulationScheduler({0: 1, 100: 4}, unit="step")])
    """

    def __init__(
        self,
        scheduling: Mapping[int, int] | Sequence[Sequence[int]] | None = None,
        *,
        unit: Literal["epoch", "step"] = "epoch",
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
    ) -> None:
        if (scheduling is None) == (global_batch_size is None):
            raise ConfigError(
                f"Give exactly one of `scheduling` and `global_batch_size`; got scheduling={scheduling!r}, "
                f"global_batch_size={global_batch_size!r}."
            )
        if unit not in ("epoch", "step"):
            raise ConfigError(f"`unit={unit!r}` is not supported; use 'epoch' or 'step'.")
        if micro_batch_size is not None and global_batch_size is None:
            raise ConfigError(
                f"`micro_batch_size={micro_batch_size!r}` is read only with `global_batch_size`, which is not set; "
                "remove it, or set `global_batch_size` instead of `scheduling`."
            )
        for name, value in (("global_batch_size", global_batch_size), ("micro_batch_size", micro_batch_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"`{name}={value!r}` must be a positive integer.")
        self.unit = unit
        self.scheduling = None if scheduling is None else _check_scheduling(scheduling, unit)
        """`{key: micro_batches}` with the implicit `{0: 1}` when the first key is later (as Lightning's)."""
        self.epochs = sorted(self.scheduling) if self.scheduling is not None else []
        """The schedule's keys, sorted (epochs, or optimizer steps under `unit="step"`), as Lightning's."""
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self._plan: AccumulationPlan | None = None
        self._window_size = 0  # micro-batches of the current window
        self._window_pos = 0  # micro-batches of the current window started so far
        self._saved_accumulate = 1
        self._restore = ExitStack()  # the loop patches; closed in teardown and on_exception
        self._fsdp_modules: list[Any] = []
        self._loaded_plan: dict[str, Any] | None = None  # the plan of a loaded checkpoint, until this one resolves
        self._verified = False  # the first batch was checked against the global batch
        self._rescale = 1.0  # the window's gradients x this before its optimizer step (a window cut short)
        self._warned_estimate = False  # the varying-factor warning of `estimated_stepping_batches`, once a fit

    def accumulation_plan(self, trainer: pl.Trainer) -> AccumulationPlan:
        """The plan this callback follows in `trainer`, resolving `global_batch_size` against its DataLoader.

        Raises:
            ConfigError: when the global batch is not a multiple of micro-batch size x world size.
        """
        if self._plan is not None:
            return self._plan
        if self.scheduling is not None:
            self._plan = AccumulationPlan(self.unit, tuple(sorted(self.scheduling.items())))
        else:
            assert self.global_batch_size is not None
            loader_size = _loader_batch_size(trainer, required=self.micro_batch_size is None)
            if self.micro_batch_size is not None and loader_size not in (None, self.micro_batch_size):
                raise ConfigError(
                    f"`micro_batch_size={self.micro_batch_size}`, but the train DataLoader the Trainer built yields "
                    f"{loader_size} samples per device (a datamodule that divides its batch by the world size, as "
                    f"lightning-hydra-template's does?): a step would train on {loader_size} x {trainer.world_size} "
                    f"device(s) x micro-batches, not the {self.global_batch_size} logged. Drop `micro_batch_size` (it "
                    "is read from the loader)."
                )
            micro = loader_size or self.micro_batch_size
            assert micro is not None
            ranks = data_parallel_replicas(trainer)  # pipeline stages and tensor-parallel ranks share their batches
            self._plan = AccumulationPlan.constant(micro_batches_for(self.global_batch_size, micro, ranks))
            rank_zero_info(
                f"AccumulationScheduler: global batch {self.global_batch_size} = {micro} per device x "
                f"{_ranks_text(trainer, ranks)} x {self._plan.points[0][1]} micro-batches per optimizer step."
            )
        return self._plan

    def going_to_accumulate_grad_batches(self) -> bool:
        """Whether any window holds more than one micro-batch (a global batch not yet resolved counts as yes)."""
        if self.scheduling is not None:
            return any(v > 1 for v in self.scheduling.values())
        return self._plan is None or any(v > 1 for _, v in self._plan.points)

    def get_accumulate_grad_batches(self, epoch: int, step: int = 0) -> int:
        """Micro-batches per optimizer step at `epoch` (and optimizer `step`, for `unit="step"`), as Lightning's.

        Raises:
            RuntimeError: for `global_batch_size` before fit start resolved it against the DataLoader.
        """
        if self.scheduling is not None:
            return AccumulationPlan(self.unit, tuple(sorted(self.scheduling.items()))).at(epoch, step)
        if self._plan is None:
            raise RuntimeError(
                "`global_batch_size` is resolved against the train DataLoader at fit start; call "
                "`accumulation_plan(trainer)` first."
            )
        return self._plan.at(epoch, step)

    def _check_trainer(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Lightning's checks, at Lightning's point (`on_train_start`) and earlier (`setup`)."""
        if not pl_module.automatic_optimization:
            raise UnsupportedAccumulationError(
                "Automatic gradient accumulation and the `GradientAccumulationScheduler` (here AccumulationScheduler) "
                "are not supported under manual optimization (`automatic_optimization=False`); step the optimizer "
                "yourself every N micro-batches, or remove the callback."
            )
        if trainer.strategy.handles_gradient_accumulation:
            raise UnsupportedAccumulationError(
                f"The `{type(trainer.strategy).__name__}` does not support `accumulate_grad_batches` changing between "
                "epochs (it accumulates gradients itself); configure accumulation in the strategy and remove "
                "AccumulationScheduler."
            )
        if trainer.accumulate_grad_batches != 1:
            raise ConfigError(
                "You have set `accumulate_grad_batches` and are using the `GradientAccumulationScheduler` "
                f"(AccumulationScheduler, which sets it per window): the Trainer's `accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches}`; leave it at 1 or remove the callback."
            )
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in _lightning.trainer_callbacks(trainer)):
            raise ConfigError("Use one accumulation callback: drop Lightning's GradientAccumulationScheduler.")

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._check_trainer(trainer, pl_module)
        self._plan = None
        self._verified = False
        self._window_size = self._window_pos = 0
        self._saved_accumulate = trainer.accumulate_grad_batches
        self._rescale = 1.0
        self._warned_estimate = False
        self._restore.close()
        self._restore = _take_over_loop(trainer, self)
        self._restore.callback(
            _lightning.patch_estimated_stepping_batches(
                trainer, lambda lightning: self._estimated_stepping_batches(trainer, lightning), _WHY
            )
        )

    def _estimated_stepping_batches(self, trainer: pl.Trainer, lightning: Callable[[], int | float]) -> int | float:
        """`trainer.estimated_stepping_batches` during the fit: the optimizer steps this schedule takes
        (`estimated_optimizer_steps`), where Lightning's counts as if each step took one micro-batch; Lightning's own
        answer where no step runs or the fit has no end (0 steps, `inf`)."""
        plan = self.accumulation_plan(trainer)  # a global batch that does not divide is an error, not a fallback
        try:
            steps = estimated_optimizer_steps(trainer)
        except ConfigError:  # no end: Lightning's `inf` (or its `max_steps`) is as good as any
            return lightning()
        if steps <= 0:
            return lightning()
        if not self._warned_estimate and _factor_varies(plan, trainer.max_epochs, steps):
            self._warned_estimate = True
            rank_zero_warn(
                f"AccumulationScheduler: the accumulation factor varies over this fit ({_plan_text(plan)}), so "
                f"`trainer.estimated_stepping_batches` returns {steps}, the optimizer steps of the whole fit as "
                f"`lightning_accel.estimated_optimizer_steps(trainer)` counts them (Lightning's own count: "
                f"{lightning()}). An LR schedule sized with it ends at the fit's last step; code that turns it into "
                "batches or samples with `trainer.accumulate_grad_batches` does not hold while the factor varies: "
                "call `lightning_accel.estimated_optimizer_steps(trainer)` for steps and count samples per window.",
                category=LightningAccelWarning,
            )
        return steps

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._undo(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._undo(trainer)  # Lightning skips teardown after an exception

    def _undo(self, trainer: pl.Trainer) -> None:
        self._restore.close()
        for module in self._fsdp_modules:
            module.set_requires_gradient_sync(True, recurse=False)
        self._fsdp_modules = []
        self._rescale = 1.0
        trainer.accumulate_grad_batches = self._saved_accumulate

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_trainer(trainer, pl_module)
        if self.going_to_accumulate_grad_batches() and (
            is_overridden("optimizer_step", pl_module) or is_overridden("optimizer_zero_grad", pl_module)
        ):
            rank_zero_warn(
                "When using `Trainer(accumulate_grad_batches != 1)` and overriding "
                "`LightningModule.optimizer_{step,zero_grad}`, the hooks will not be called on every batch "
                "(rather, they are called on every optimization step); AccumulationScheduler calls them once per "
                "window.",
                category=LightningAccelWarning,
            )
        self._fsdp_modules = _fsdp_modules(pl_module)  # configure_model has run by now
        if (
            self.going_to_accumulate_grad_batches()
            and not math.isfinite(trainer.num_training_batches)
            and _lightning.train_fetcher_prefetches(trainer, _WHY) is False
        ):
            rank_zero_warn(
                "AccumulationScheduler: `training_step` takes `dataloader_iter` and the train DataLoader has no "
                "`__len__`, so an epoch's last batch is known only when `next(dataloader_iter)` raises inside "
                "`training_step`: the last window of an epoch, when partial, takes no optimizer step and its "
                "gradients are zeroed at the next window's start (as under `Trainer(accumulate_grad_batches=k)`). "
                "Give the dataset a `__len__`, set `limit_train_batches` to a number of batches, or take `batch` "
                "instead of `dataloader_iter` in `training_step`.",
                category=LightningAccelWarning,
            )

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._window_size = self._window_pos = 0  # Lightning steps at an epoch's end: windows restart each epoch

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._window_pos >= self._window_size:
            micro_batches = self.accumulation_plan(trainer).at(trainer.current_epoch, trainer.global_step)
            if self.global_batch_size is not None and not self._verified:
                self._verify_global_batch(trainer, batch, micro_batches)
            # the loop's own count: a `training_step` taking `dataloader_iter` is handed the previous batch's index
            left_in_epoch = trainer.num_training_batches - _lightning.epoch_loop_batch_idx(trainer)
            self._window_size = int(min(micro_batches, left_in_epoch)) if left_in_epoch > 0 else micro_batches
            self._window_pos = 0
            self._rescale = 1.0  # a window cut short whose optimizer step was skipped rescales nothing after it
            trainer.accumulate_grad_batches = self._window_size  # Lightning divides the loss by it
        self._window_pos += 1
        if not self.window_complete and _last_of_unsized_epoch(trainer):
            self._cut_window_short(trainer)
        for module in self._fsdp_modules:
            module.set_requires_gradient_sync(self.window_complete, recurse=False)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.window_complete:
            # batch_size: a step-only value needs none, but Lightning asks for it under `dataloader_iter`
            pl_module.log("train/accumulation", float(self._window_size), on_step=True, on_epoch=False, batch_size=1)

    def _cut_window_short(self, trainer: pl.Trainer) -> None:
        """End the window at the micro-batch in hand, the last of an epoch whose length the loader does not say.

        A window it starts has that one micro-batch, its loss divided by 1. A window started earlier divided its
        losses by the full factor; `on_before_optimizer_step` multiplies its gradients by full / real length (after
        DDP's all-reduce or FSDP's reduce-scatter and the GradScaler's unscaling, before gradient clipping), which is
        the real length's average.
        """
        if self._window_pos == 1:
            trainer.accumulate_grad_batches = 1
        else:
            self._rescale = self._window_size / self._window_pos
        self._window_size = self._window_pos

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._rescale == 1.0:
            return
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.grad.mul_(self._rescale)
        self._rescale = 1.0
        trainer.accumulate_grad_batches = self._window_size

    def _verify_global_batch(self, trainer: pl.Trainer, batch: Any, micro_batches: int) -> None:
        """The first batch's real size against the one the global batch was computed from: a mismatch is an error,
        never a run that trains on another batch than it logs."""
        self._verified = True
        real = samples_in(batch, default=1)
        ranks = data_parallel_replicas(trainer)
        assert self.global_batch_size is not None, "verified only with a global batch size"
        micro = self.global_batch_size // (micro_batches * ranks)
        if real not in (1, micro) and real < micro * 2:  # 1: no tensor to count; a first batch is a full one
            actual = real * ranks * micro_batches
            raise ConfigError(
                f"AccumulationScheduler: global batch {self.global_batch_size} was computed from {micro} samples per "
                f"device, but the first batch holds {real}: the real global batch is {actual}. Drop "
                "`micro_batch_size` (it is read from the loader), or fix the datamodule's batch size."
            )

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


_WHY = "AccumulationScheduler (or use Lightning's GradientAccumulationScheduler)"


def _last_of_unsized_epoch(trainer: pl.Trainer) -> bool:
    """Whether the batch in hand ends an epoch whose length the train DataLoader does not say (an IterableDataset
    without `__len__`): Lightning's data fetcher has fetched one batch ahead and found none."""
    if math.isfinite(trainer.num_training_batches) or not _lightning.train_fetcher_prefetches(trainer, _WHY):
        return False
    return _lightning.train_fetcher_done(trainer, _WHY)


def _factor_varies(plan: AccumulationPlan, max_epochs: int | None, steps: int) -> bool:
    """Whether a fit of `steps` optimizer steps and `max_epochs` epochs reaches a second factor of `plan`."""
    if plan.unit == "step":
        horizon: float = steps
    else:
        horizon = max_epochs if max_epochs is not None and max_epochs > 0 else math.inf
    return len({factor for key, factor in plan.points if key == 0 or key < horizon}) > 1


def _plan_text(plan: AccumulationPlan) -> str:
    return f"{plan.unit} -> micro-batches {dict(plan.points)}"


def _check_scheduling(scheduling: Mapping[int, int] | Sequence[Sequence[int]], unit: str) -> dict[int, int]:
    """The schedule with int keys, sorted, and `{0: 1}` added when it starts later (as Lightning's).

    Raises:
        ScheduleTypeError: for an empty schedule or one that is no dict.
        ScheduleError: for a key that is no integer >= 0, or a value that is no integer >= 1.
    """
    if _is_pair_list(scheduling):  # [[key, micro_batches], ...]: a Hydra list the command line replaces whole
        keys = [pair[0] for pair in scheduling]
        if len(set(map(str, keys))) != len(keys):
            raise ScheduleError(f"`scheduling={list(map(list, scheduling))!r}` names a key twice; list each once.")
        scheduling = {pair[0]: pair[1] for pair in scheduling}
    if not isinstance(scheduling, Mapping) or not scheduling:
        raise ScheduleTypeError(
            f"`scheduling={scheduling!r}` must be a non-empty dict of {{{unit}: micro_batches}} "
            "(or a list of [key, micro_batches] pairs)."
        )
    checked: dict[int, int] = {}
    for key, value in scheduling.items():
        key_int = int(key) if isinstance(key, str) and key.isdigit() else key
        if isinstance(key_int, bool) or not isinstance(key_int, int) or key_int < 0:
            what = "Epoch" if unit == "epoch" else "Optimizer step"
            raise ScheduleError(
                f"{what} should be an int greater than or equal to 0: `scheduling` key {key!r} in "
                f"{dict(scheduling)!r}; use {unit} numbers from 0."
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(
                f"Accumulation factor should be an int greater than 0: `scheduling[{key_int}]="
                f"{value!r}`; use a number of micro-batches >= 1."
            )
        checked[key_int] = value
    checked.setdefault(0, 1)
    return dict(sorted(checked.items()))


def _is_pair_list(value: Any) -> TypeGuard[Sequence[Sequence[Any]]]:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, (str, bytes))
        and len(value) > 0
        and all(isinstance(p, Sequence) and not isinstance(p, (str, bytes)) and len(p) == 2 for p in value)
    )


def micro_batches_for(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-batches per optimizer step that make `global_batch_size` from `micro_batch_size` on `world_size` devices.

    Raises:
        ConfigError: when the product does not divide the global batch.
    """
    per_window = micro_batch_size * world_size
    if global_batch_size % per_window:
        lower = max(per_window, global_batch_size // per_window * per_window)
        raise ConfigError(
            f"`global_batch_size={global_batch_size}` is not a multiple of `micro_batch_size={micro_batch_size}` x "
            f"world size {world_size} = {per_window}; use {lower} or {lower + per_window}, or change the batch size."
        )
    return global_batch_size // per_window


def _ranks_text(trainer: pl.Trainer, ranks: int) -> str:
    """`2 device(s)`, or `2 data-parallel replica(s) of 4 device(s)` where pipeline/TP ranks share batches."""
    if ranks == trainer.world_size:
        return f"{ranks} device(s)"
    return f"{ranks} data-parallel replica(s) of {trainer.world_size} device(s)"


def _loader_batch_size(trainer: pl.Trainer, required: bool = True) -> int | None:
    if trainer.train_dataloader is None:
        trainer.fit_loop.setup_data()
    loader = trainer.train_dataloader
    size = loader_batch_size(loader)
    if size is None:
        if not required:
            return None
        raise ConfigError(
            f"AccumulationScheduler cannot read a batch size from the train DataLoader ({type(loader).__name__}); "
            "pass `micro_batch_size=`."
        )
    return size


def _take_over_loop(trainer: pl.Trainer, scheduler: AccumulationScheduler) -> ExitStack:
    """Make Lightning's training loop step and zero gradients at this scheduler's window boundaries.

    Lightning decides both with `batch_idx % accumulate_grad_batches` within an epoch, which only holds for windows
    of one size aligned to the epoch start. Where a window ends and when gradients are zeroed are replaced on the
    loop instances through the fence around Lightning's internals (`_lightning`). The returned stack undoes both.
    """
    automatic = trainer.fit_loop.epoch_loop.automatic_optimization

    def make_zero_grad_fn(batch_idx: int, optimizer: torch.optim.Optimizer) -> Callable[[], None] | None:
        if _lightning.backward_skipped(automatic) or scheduler._window_pos != 1:
            return None
        return lambda: _lightning.zero_grad_now(automatic, batch_idx, optimizer)

    stack = ExitStack()
    stack.callback(_lightning.patch_accumulation_boundary(trainer, lambda: scheduler.window_complete, _WHY))
    stack.callback(_lightning.patch_zero_grad_factory(automatic, make_zero_grad_fn, _WHY))
    return stack


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
