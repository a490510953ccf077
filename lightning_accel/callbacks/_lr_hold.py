"""Keeps step-interval LR schedulers from advancing on optimizer steps that did not update the weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_accel.patching import patch_attribute

__all__ = ["active_hold", "grad_scaler", "hold_lr_schedulers", "release_lr_schedulers"]

HoldPredicate = Callable[[], bool]


def grad_scaler(trainer: pl.Trainer) -> torch.amp.GradScaler | None:
    """The precision plugin's enabled GradScaler (fp16 mixed precision), or None."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None


class _LRHold:
    """Stands in for `LightningModule.lr_scheduler_step` as an instance attribute.

    Lightning's training epoch loop steps the schedulers after each optimizer step through
    `call._call_lightning_module_hook(trainer, "lr_scheduler_step", scheduler, metric)`, which looks the hook up with
    `getattr(pl_module, ...)`, so an instance attribute takes precedence over the class's method. A scheduler whose
    interval is "step" is not stepped while any owner's predicate returns True; "epoch" schedulers always step.
    Nothing is set on the scheduler objects, whose `state_dict` saves their whole `__dict__`. A copy or pickle of
    the module (which Lightning makes without its trainer) gets a hold without owners, which only passes through.
    """

    def __init__(self, pl_module: pl.LightningModule) -> None:
        self.pl_module = pl_module
        self.owners: dict[int, HoldPredicate] = {}
        self.shadowed = pl_module.__dict__.get("lr_scheduler_step")  # an instance attribute we cover, if any
        self.held_steps = 0  # scheduler steps suppressed, for tests and debugging
        self.undo: Callable[[], None] = lambda: None  # set by `hold_lr_schedulers`: removes the hold

    def __call__(self, scheduler: Any, *args: Any) -> None:  # args: (metric,) in Lightning 2.x
        if self.owners and self._is_step_interval(scheduler) and any(held() for held in self.owners.values()):
            self.held_steps += 1
            return
        if self.shadowed is not None:
            self.shadowed(scheduler, *args)
        else:
            type(self.pl_module).lr_scheduler_step(self.pl_module, scheduler, *args)

    def _is_step_interval(self, scheduler: Any) -> bool:
        configs = self.pl_module.trainer.lr_scheduler_configs
        return any(cfg.scheduler is scheduler and cfg.interval == "step" for cfg in configs)

    def __getstate__(self) -> dict[str, Any]:
        state = {**self.__dict__, "owners": {}}  # the owners' predicates belong to the running fit
        state.pop("undo", None)  # a closure over the running module
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.undo = self._remove_copy

    def _remove_copy(self) -> None:
        """The undo of a copied hold: take it off the copied module (or put back what it covered there)."""
        module = self.pl_module.__dict__
        if module.get("lr_scheduler_step") is self:
            if self.shadowed is None:
                del module["lr_scheduler_step"]
            else:
                module["lr_scheduler_step"] = self.shadowed


def hold_lr_schedulers(pl_module: pl.LightningModule, owner: object, held: HoldPredicate) -> None:
    """Install (or join) the hold on `pl_module`: step-interval schedulers skip a step whenever `held()` is True.

    `held` is asked after the optimizer step, once per step-interval scheduler, and must give the same answer for
    every scheduler of one step. Pair with `release_lr_schedulers(pl_module, owner)`.
    """
    hold = active_hold(pl_module)
    if hold is None:
        hold = _LRHold(pl_module)
        # an instance attribute, looked up before the method; the undo puts back whatever was there
        hold.undo = patch_attribute(pl_module, "lr_scheduler_step", hold, why="holding LR schedulers on skipped steps")
    hold.owners[id(owner)] = held


def release_lr_schedulers(pl_module: pl.LightningModule, owner: object) -> None:
    """Leave the hold; the last owner to leave restores `pl_module.lr_scheduler_step`. Safe to call twice."""
    hold = active_hold(pl_module)
    if hold is None:
        return
    hold.owners.pop(id(owner), None)
    if not hold.owners:
        hold.undo()


def active_hold(pl_module: pl.LightningModule) -> _LRHold | None:
    """The hold installed on `pl_module`, if any."""
    hold = pl_module.__dict__.get("lr_scheduler_step")
    return hold if isinstance(hold, _LRHold) else None
