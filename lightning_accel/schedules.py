"""Optimizer-step accounting and LR scheduler factories that step once per optimizer step."""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, OneCycleLR

from lightning_accel import _lightning
from lightning_accel.errors import ConfigError

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "AccumulationPlan",
    "accumulation_plan",
    "check_schedule_settings",
    "configure_optimizers",
    "cosine_schedule",
    "count_optimizer_steps",
    "estimated_optimizer_steps",
    "linear_warmup_schedule",
    "onecycle_schedule",
]

OptimizerFactory = Callable[[Iterable[Any]], Optimizer]
SchedulerFactory = Callable[..., LRScheduler]


@dataclass(frozen=True)
class AccumulationPlan:
    """How many micro-batches each optimizer step accumulates, as a step function of epoch or optimizer step.

    Windows restart at every epoch start and the last window of an epoch may be partial: Lightning steps the optimizer
    on an epoch's final batch whatever the accumulation.

    Attributes:
        unit: "epoch" keys the points by epoch, "step" by the optimizer step at which a window starts.
        points: sorted `(key, micro_batches)` pairs, the first key 0.
    """

    unit: str = "epoch"
    points: tuple[tuple[int, int], ...] = ((0, 1),)

    def __post_init__(self) -> None:
        assert self.unit in ("epoch", "step"), self.unit
        assert self.points and self.points[0][0] == 0, self.points
        assert all(a[0] < b[0] for a, b in zip(self.points, self.points[1:], strict=False)), self.points

    @classmethod
    def constant(cls, micro_batches: int) -> AccumulationPlan:
        return cls("epoch", ((0, int(micro_batches)),))

    def at(self, epoch: int, step: int) -> int:
        """Micro-batches of the window that starts in `epoch` at optimizer step `step`."""
        key = epoch if self.unit == "epoch" else step
        return self.points[bisect_right([p[0] for p in self.points], key) - 1][1]

    def _next_change(self, key: int) -> float:
        later = [p[0] for p in self.points if p[0] > key]
        return later[0] if later else math.inf


def count_optimizer_steps(plan: AccumulationPlan, num_batches: float, max_epochs: int | None, max_steps: int) -> int:
    """The optimizer steps a fit of `num_batches` batches per epoch takes under `plan`, `max_epochs`, `max_steps`.

    Args:
        plan: the accumulation plan.
        num_batches: training batches per epoch on one rank (after `limit_train_batches`); `inf` for an iterable
            dataset without a length.
        max_epochs: None or -1 for no epoch limit.
        max_steps: -1 for no step limit.

    Raises:
        ValueError: when neither limit ends the fit.
    """
    unlimited_epochs = max_epochs is None or max_epochs < 0
    step_cap = math.inf if max_steps is None or max_steps < 0 else max_steps
    epoch_cap = math.inf if max_epochs is None or max_epochs < 0 else max_epochs
    if (unlimited_epochs or not math.isfinite(num_batches)) and not math.isfinite(step_cap):
        raise ConfigError(
            f"The fit has no end (`max_epochs={max_epochs}`, `max_steps={max_steps}`, {num_batches} batches per "
            "epoch), so an LR schedule cannot be sized; set the Trainer's `max_steps` or `max_epochs`."
        )
    if not math.isfinite(num_batches):
        return int(step_cap)
    num_batches = int(num_batches)
    if num_batches <= 0 or epoch_cap == 0:
        return 0
    last_key = plan.points[-1][0]
    steps, epoch = 0, 0
    while epoch < epoch_cap and steps < step_cap:
        if epoch >= last_key if plan.unit == "epoch" else steps >= last_key:
            # the plan is constant from here on: whole epochs at once
            per_epoch = math.ceil(num_batches / plan.at(epoch, steps))
            epochs_left = epoch_cap - epoch
            return int(min(steps + per_epoch * epochs_left, step_cap))
        done = 0
        while done < num_batches and steps < step_cap:
            k = plan.at(epoch, steps)
            until_change = plan._next_change(steps) - steps if plan.unit == "step" else math.inf
            windows = int(min(math.ceil((num_batches - done) / k), until_change, step_cap - steps))
            done = min(num_batches, done + windows * k)
            steps += windows
        epoch += 1
    return int(min(steps, step_cap))


def accumulation_plan(trainer: pl.Trainer) -> AccumulationPlan:
    """The accumulation plan of `trainer`: its AccumulationScheduler's, Lightning's GradientAccumulationScheduler's
    (epoch keys), or the constant `trainer.accumulate_grad_batches`."""
    for callback in _lightning.trainer_callbacks(trainer):
        plan = getattr(callback, "accumulation_plan", None)
        if callable(plan):
            return plan(trainer)
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    for callback in _lightning.trainer_callbacks(trainer):
        if isinstance(callback, GradientAccumulationScheduler):
            points = dict(callback.scheduling)
            points.setdefault(0, 1)
            return AccumulationPlan("epoch", tuple(sorted(points.items())))
    return AccumulationPlan.constant(trainer.accumulate_grad_batches)


def estimated_optimizer_steps(trainer: pl.Trainer) -> int:
    """The exact number of optimizer steps the current fit will take.

    Unlike `trainer.estimated_stepping_batches` it follows accumulation schedules (lightning_accel's
    `AccumulationScheduler`, by epoch, step or global batch size, and Lightning's `GradientAccumulationScheduler`),
    the last partial window of every epoch, `limit_train_batches`, `max_steps` and `max_epochs`. World size enters
    through the per-rank batch count. Size an LR schedule with it in `configure_optimizers`, one line::

        total_steps = lightning_accel.estimated_optimizer_steps(self.trainer)

    It agrees with `trainer.estimated_stepping_batches` wherever that one is exact (constant accumulation; tested
    on a grid), and differs on purpose at the edges: `limit_train_batches=0` and `max_epochs=0` take 0 steps (Lightning
    estimates a full epoch, or -1); a fit without an end raises instead of returning `inf`.

    Raises:
        ValueError: when the fit has no end (`max_steps=-1` and `max_epochs=-1`, or an iterable dataset without a
            length and no `max_steps`), so a schedule cannot be sized.
    """
    if trainer.limit_train_batches == 0 or trainer.max_epochs == 0 or trainer.max_steps == 0:
        return 0  # no training batch runs (Lightning leaves the train DataLoader unbuilt: its length reads inf)
    if trainer.train_dataloader is None:
        trainer.fit_loop.setup_data()
    return count_optimizer_steps(
        accumulation_plan(trainer), trainer.num_training_batches, trainer.max_epochs, trainer.max_steps
    )


def _need_total_steps(function: str, group: str, total_steps: int | None) -> int:
    """The `scheduler` group's factories need the fit's length; a model that calls them without it (one that is not
    ours, as lightning-hydra-template's `self.hparams.scheduler(optimizer=optimizer)`) learns how to pass it."""
    if total_steps is None:
        raise ConfigError(
            f"`scheduler={group}` ({function}) needs `total_steps`, the fit's optimizer steps; call it in "
            "`configure_optimizers` as `scheduler(optimizer=optimizer, total_steps="
            "lightning_accel.estimated_optimizer_steps(self.trainer))` and step it every optimizer step "
            '(`{"scheduler": ..., "interval": "step"}`), or use `lightning_accel.schedules.configure_optimizers`.'
        )
    return total_steps


def _check_warmup(total_steps: int, warmup_steps: int | float, min_lr_ratio: float) -> int:
    """Validate a warm-up + decay schedule's settings; returns the warm-up in optimizer steps."""
    if total_steps <= 0:
        raise ConfigError(f"`total_steps={total_steps}` must be positive.")
    _check_warmup_settings(warmup_steps, min_lr_ratio)
    if isinstance(warmup_steps, float):
        warmup_steps = int(warmup_steps * total_steps)
    if not warmup_steps < total_steps:
        raise ConfigError(
            f"`warmup_steps={warmup_steps}` must be >= 0 and below the fit's {total_steps} optimizer steps.",
            setting="warmup_steps",
        )
    return warmup_steps


def _check_warmup_settings(warmup_steps: Any, min_lr_ratio: Any) -> None:
    """What a warm-up + decay schedule's settings must be whatever the fit's length."""
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, (int, float)):
        raise ConfigError(
            f"`warmup_steps={warmup_steps!r}` must be an int (optimizer steps) or a float (a fraction of the fit).",
            setting="warmup_steps",
        )
    if isinstance(warmup_steps, float) and not 0.0 <= warmup_steps < 1.0:
        raise ConfigError(
            f"`warmup_steps={warmup_steps}` as a fraction of the fit must be within [0, 1).", setting="warmup_steps"
        )
    if isinstance(warmup_steps, int) and warmup_steps < 0:
        raise ConfigError(f"`warmup_steps={warmup_steps}` must be >= 0 optimizer steps.", setting="warmup_steps")
    if isinstance(min_lr_ratio, bool) or not isinstance(min_lr_ratio, (int, float)) or not 0.0 <= min_lr_ratio <= 1.0:
        raise ConfigError(f"`min_lr_ratio={min_lr_ratio}` must be within [0, 1].", setting="min_lr_ratio")


def _check_positive(name: str, value: Any, *, below_one: bool = False, optional: bool = False) -> None:
    if value is None and optional:
        return
    number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not number or value <= 0 or (below_one and value >= 1):
        bounds = "within (0, 1)" if below_one else "> 0"
        raise ConfigError(f"`{name}={value!r}` must be a finite number {bounds}.", setting=name)


def check_schedule_settings(target: str, settings: Mapping[str, Any]) -> None:
    """The settings of a `scheduler` partial that hold whatever the fit's length, checked before launch
    (`checks.check_config`): this module's schedules, and torch's `ReduceLROnPlateau` (`scheduler=plateau`).
    Other targets are not checked. A warm-up longer than the fit is refused when the fit's length is known.

    Raises:
        ConfigError: naming the argument (`setting`), the value and the range.
    """
    name = target.rsplit(".", 1)[-1]
    if name in ("cosine_schedule", "linear_warmup_schedule"):
        _check_warmup_settings(settings.get("warmup_steps", 0), settings.get("min_lr_ratio", 0.0))
    elif name == "onecycle_schedule":
        _check_positive("max_lr", settings.get("max_lr"), optional=True)
        _check_positive("pct_start", settings.get("pct_start", 0.3), below_one=True)
        _check_positive("div_factor", settings.get("div_factor", 25.0))
        _check_positive("final_div_factor", settings.get("final_div_factor", 1e4))
        if settings.get("anneal_strategy", "cos") not in ("cos", "linear"):
            raise ConfigError(
                f"`anneal_strategy={settings.get('anneal_strategy')!r}` must be 'cos' or 'linear'.",
                setting="anneal_strategy",
            )
    elif name == "ReduceLROnPlateau":
        _check_positive("factor", settings.get("factor", 0.1), below_one=True)
        patience = settings.get("patience", 10)
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ConfigError(f"`patience={patience!r}` must be an integer >= 0 (epochs).", setting="patience")
        if settings.get("mode", "min") not in ("min", "max"):
            raise ConfigError(f"`mode={settings.get('mode')!r}` must be 'min' or 'max'.", setting="mode")


def _warmup_then(decay: Callable[[float], float], total_steps: int, warmup_steps: int) -> Callable[[int], float]:
    """An LR factor: linear warm-up to 1 over `warmup_steps`, then `decay(progress)`, progress 0 at the first step
    after warm-up and 1 at the fit's last optimizer step (`total_steps - 1`), so the last step runs at the floor."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        return decay(min(1.0, (step - warmup_steps) / max(1, total_steps - 1 - warmup_steps)))

    return factor


def cosine_schedule(
    optimizer: Optimizer, total_steps: int | None = None, *, warmup_steps: int | float = 0, min_lr_ratio: float = 0.0
) -> LambdaLR:
    """Linear warm-up for `warmup_steps`, then cosine decay to `min_lr_ratio` x the base LR at the last step.

    Args:
        optimizer: the optimizer whose base LRs are scaled.
        total_steps: optimizer steps of the whole fit (`estimated_optimizer_steps`).
        warmup_steps: linear warm-up towards the base LR: an int counts optimizer steps, a float in [0, 1) is a
            fraction of `total_steps`.
        min_lr_ratio: LR of the fit's last optimizer step, as a fraction of the base LR.

    Raises:
        ValueError: for a negative or too long warm-up or a ratio outside [0, 1].
    """
    total_steps = _need_total_steps("cosine_schedule", "cosine", total_steps)
    warmup = _check_warmup(total_steps, warmup_steps, min_lr_ratio)

    def cosine(progress: float) -> float:
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, _warmup_then(cosine, total_steps, warmup))


def linear_warmup_schedule(
    optimizer: Optimizer, total_steps: int | None = None, *, warmup_steps: int | float = 0.05, min_lr_ratio: float = 0.0
) -> LambdaLR:
    """Linear warm-up for `warmup_steps`, then linear decay to `min_lr_ratio` x the base LR at the last step.

    Args:
        optimizer: the optimizer whose base LRs are scaled.
        total_steps: optimizer steps of the whole fit (`estimated_optimizer_steps`).
        warmup_steps: an int counts optimizer steps, a float in [0, 1) is a fraction of `total_steps`.
        min_lr_ratio: LR of the fit's last optimizer step, as a fraction of the base LR.

    Raises:
        ValueError: for a negative or too long warm-up or a ratio outside [0, 1].
    """
    total_steps = _need_total_steps("linear_warmup_schedule", "linear", total_steps)
    warmup = _check_warmup(total_steps, warmup_steps, min_lr_ratio)
    return LambdaLR(optimizer, _warmup_then(lambda p: 1.0 - (1.0 - min_lr_ratio) * p, total_steps, warmup))


def onecycle_schedule(
    optimizer: Optimizer,
    total_steps: int | None = None,
    *,
    max_lr: float | None = None,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
    anneal_strategy: Literal["cos", "linear"] = "cos",
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
    total_steps = _need_total_steps("onecycle_schedule", "onecycle", total_steps)
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
    monitor: str = "val/loss",
) -> Any:
    """Build what `LightningModule.configure_optimizers` returns from Hydra partials.

    A scheduler factory that takes `total_steps` (this package's `scheduler` group: cosine, OneCycle, warm-ups) is
    called as `lr_scheduler(optimizer, total_steps=...)` with the fit's optimizer steps and stepped every optimizer
    step; any other (`scheduler=plateau`: ReduceLROnPlateau, torch's StepLR, ...) as `lr_scheduler(optimizer)` and
    stepped every epoch, ReduceLROnPlateau on `monitor`.

    Example::

        def configure_optimizers(self):
            return lightning_accel.schedules.configure_optimizers(self, self.optimizer, self.lr_scheduler)
    """
    make_optimizer = optimizer if optimizer is not None else partial(torch.optim.AdamW, lr=1e-3)
    opt = make_optimizer(params if params is not None else module.parameters())
    if lr_scheduler is None:
        return opt
    if not _takes_total_steps(lr_scheduler):
        scheduler = lr_scheduler(opt)
        config = {"scheduler": scheduler, "interval": "epoch", "frequency": 1}
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            config["monitor"] = monitor
        return {"optimizer": opt, "lr_scheduler": config}
    total = estimated_optimizer_steps(module.trainer)
    if total <= 0:
        why = _why_no_steps(module.trainer)
        raise ConfigError(f"the fit takes no optimizer step, so there is no schedule to size: {why}")
    scheduler = lr_scheduler(opt, total_steps=total)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}


def _why_no_steps(trainer: pl.Trainer) -> str:
    """Which setting leaves a fit without an optimizer step, in words."""
    if trainer.limit_train_batches == 0:
        return "`trainer.limit_train_batches=0`; use a count >= 1 or a fraction above 0."
    if trainer.max_epochs == 0:
        return "`trainer.max_epochs=0`; use -1 or a number of epochs >= 1."
    if trainer.max_steps == 0:
        return "`trainer.max_steps=0`; use -1 or a number of steps >= 1."
    return (
        f"the train DataLoader has {trainer.num_training_batches} batches (an empty training set, or fewer "
        "samples than one batch with `drop_last`); give the data more samples, or lower `data.batch_size`."
    )


def _takes_total_steps(factory: SchedulerFactory) -> bool:
    """Whether a scheduler factory (a function or a `functools.partial` of one, or of a scheduler class) takes the
    fit's length as `total_steps`."""
    import inspect

    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no readable signature: this package's factories all have one
        return True
    return "total_steps" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
