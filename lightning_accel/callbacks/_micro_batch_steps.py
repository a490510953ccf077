"""How MicroBatchFinder runs a batch's pieces inside Lightning's optimizer step: the Trainer it can serve, the closure,
one piece's `training_step` past DDP's forward, and what the ranks agree on (an out-of-memory error anywhere, the
smallest size)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_accel import _lightning
from lightning_accel.errors import ConfigError, LightningAccelWarning

__all__ = [
    "PiecesClosure",
    "agree_min",
    "any_rank",
    "check_trainer",
    "group_rank_zero",
    "no_sync",
    "piece_output",
    "skip_backward",
]


class PiecesClosure(Closure):
    """Lightning's closure for one batch, which MicroBatchFinder's `run_batch` runs in micro-batches (zero_grad first,
    as the gradients are snapshotted before the batch)."""

    def __init__(
        self,
        run_batch: Callable[[pl.Trainer, OrderedDict, Any, Callable | None], ClosureResult],
        trainer: pl.Trainer,
        kwargs: OrderedDict,
        optimizer: Any,
        backward_fn: Callable | None,
        zero_grad_fn: Callable | None,
    ) -> None:
        super().__init__(step_fn=lambda: ClosureResult(None), backward_fn=backward_fn, zero_grad_fn=zero_grad_fn)
        self._run_batch, self._trainer, self._kwargs, self._optimizer = run_batch, trainer, kwargs, optimizer
        self.backward_step, self.zero_grad_step = backward_fn, zero_grad_fn

    @override
    @torch.enable_grad()
    def closure(self, *args: Any, **kwargs: Any) -> ClosureResult:
        if self.zero_grad_step is not None:
            self.zero_grad_step()
        result = self._run_batch(self._trainer, self._kwargs, self._optimizer, self.backward_step)
        if result.closure_loss is None:
            self.warning_cache.warn("`training_step` returned `None`. If this was on purpose, ignore this warning...")
        return result


def skip_backward(loss: torch.Tensor) -> None:
    """Lightning skips the backward (its `skip_backward`): the pieces run their forwards only."""


def piece_output(trainer: pl.Trainer, kwargs: OrderedDict) -> Any:
    """`training_step` on one micro-batch as the strategy runs it, but past DDP's forward (its buffer broadcast and
    reducer are collectives a rank out of memory would leave unmatched; the gradients are averaged afterwards)."""
    strategy = trainer.strategy
    args = strategy.precision_plugin.convert_input(tuple(kwargs.values()))
    with strategy.precision_plugin.train_step_context():
        output = _lightning.call_module_hook(trainer, "training_step", *args)
    if output is None and trainer.world_size > 1:
        raise RuntimeError("Skipping the `training_step` by returning None in distributed training is not supported.")
    return output


def any_rank(flag: bool, device: torch.device, group: Any) -> bool:
    """Whether `flag` holds on any rank of `group`: one all-reduce of a byte (no barrier)."""
    tensor = torch.tensor([int(flag)], dtype=torch.uint8, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(tensor.item())


def group_rank_zero(group: Any) -> int:
    """The global rank of `group`'s first rank (the source of a broadcast)."""
    if group is None:
        return 0
    try:
        return torch.distributed.get_global_rank(group, 0)
    except Exception:
        return 0


def no_sync(trainer: pl.Trainer) -> Any:
    model = trainer.strategy.model
    return model.no_sync() if isinstance(model, torch.nn.parallel.DistributedDataParallel) else nullcontext()


def agree_min(trainer: pl.Trainer, value: int) -> int:
    """The smallest `value` over the ranks (the micro-batch every rank can run)."""
    if trainer.world_size == 1:
        return value
    tensor = torch.tensor(value, device=trainer.strategy.root_device)
    return int(trainer.strategy.reduce(tensor, reduce_op="min").item())


def check_trainer(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """At setup: the Trainer runs automatic optimization on one device or under DDP, its `training_step` takes the
    batch, and Lightning's BatchSizeFinder is not in the run."""
    if not pl_module.automatic_optimization:
        raise ConfigError(
            "MicroBatchFinder runs the batches of automatic optimization; under manual optimization "
            "(`automatic_optimization=False`) split the batch in your training_step, or remove it."
        )
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
        raise ConfigError(
            "MicroBatchFinder splits the batch Lightning passes to `training_step`; a step that takes "
            "`dataloader_iter` fetches its own. Remove MicroBatchFinder, or take `batch`."
        )
    strategy = trainer.strategy
    if _lightning.ddp_comm_hook(strategy) is not None:
        rank_zero_warn(
            "MicroBatchFinder averages the gradients itself, once per optimizer step: the DDP "
            "communication hook (gradient compression) is not used while it runs.",
            category=LightningAccelWarning,
        )
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or strategy.handles_gradient_accumulation:
        raise ConfigError(
            f"MicroBatchFinder supports one device and DDP, not {type(strategy).__name__}: FSDP, model-parallel, "
            "pipeline and DeepSpeed strategies split their own work and reduce gradients inside the backward. Use "
            "strategy=ddp (accel-train preset=ddp), or remove micro_batch=auto and set the batch size by hand.",
            setting="strategy",
        )
    from lightning.pytorch.callbacks import BatchSizeFinder

    if any(isinstance(cb, BatchSizeFinder) for cb in _lightning.trainer_callbacks(trainer)):
        raise ConfigError(
            "MicroBatchFinder keeps the batch size and splits it; Lightning's BatchSizeFinder changes "
            "it. Use one of them."
        )
