"""One batch through the pipeline stages: the runner builds and caches torch's schedules, runs a step, and returns the
batch's loss and the gradients it made; and the gradient clipping over every stage."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_accel.errors import ConfigError, ConfigTypeError
from lightning_accel.strategies.pipeline.spec import ScheduleSpec
from lightning_accel.strategies.pipeline.stages import PipelineStagePlan

__all__ = ["PipelineRunner", "PipelineStepResult", "clip_grad_norm_over_stages", "split_batch"]


@dataclass(frozen=True, slots=True)
class PipelineStepResult:
    """What one pass of a batch through the pipeline produced."""

    loss: torch.Tensor
    """The batch's mean loss (float32, detached), the same on every pipeline rank."""
    grads: tuple[tuple[nn.Parameter, torch.Tensor], ...] = ()
    """Training only: each local parameter that got a gradient, and that gradient (not yet averaged over replicas)."""


def split_batch(
    batch: Any, n_microbatches: int, train: bool, inputs: Callable[[Any], Any] | None = None
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, int]:
    """The stage inputs, the target and the number of micro-batches of a batch.

    `inputs(batch) -> (args, target)` is the module's `pipeline_inputs` (default: `(batch[0],), batch[1]`). A training
    batch must divide into `n_microbatches`; an evaluation batch that does not (the last, smaller batch of a validation
    set) runs as one micro-batch, through the stages in order, so its loss is still the batch mean.

    Raises:
        ConfigError: for a training batch that does not divide into `n_microbatches`.
    """
    args, target = inputs(batch) if inputs is not None else ((batch[0],), batch[1])
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    size = target.shape[0]
    if size % n_microbatches == 0:
        return args, target, n_microbatches
    if train:
        raise ConfigError(
            f"A training batch of {size} samples does not divide into `n_microbatches={n_microbatches}` "
            f"micro-batches; make the batch size a multiple of {n_microbatches} (and drop a smaller last batch: "
            "DataLoader(drop_last=True)), or change `n_microbatches`.",
            setting="n_microbatches",
        )
    return args, target, 1


@dataclass
class _MicroLosses:
    """The schedules' `loss_fn`: the module's loss of one micro-batch, divided for the backward so that the
    micro-batches (and accumulated batches) add up to the mean; records each undivided loss for the step's result."""

    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    divisor: int = 1
    recorded: list[torch.Tensor] = field(default_factory=list)

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.loss(output, target)
        self.recorded.append(loss.detach())
        return loss / self.divisor


class PipelineRunner:
    """Runs batches through this rank's stages with torch.distributed.pipelining and owns the schedules it builds.

    Args:
        module: the (pruned) LightningModule: its `pipeline_loss`, optional `pipeline_inputs`, `training` flag and
            parameters (those of this rank's stages).
        views: one module per local stage (`prune_to_stages`), in the order of `stages`.
        stages: the stage indices this rank runs.
        plan: the stage plan; spec: the schedule; n_microbatches: micro-batches per batch.
        ranks: `ranks[s]`, the pipeline rank of stage `s` (`stage_ranks`); rank: this process's.
        group: the pipeline-parallel process group; device: where the stages run.
    """

    def __init__(
        self,
        *,
        module: Any,
        views: Sequence[nn.Module],
        stages: Sequence[int],
        plan: PipelineStagePlan,
        spec: ScheduleSpec,
        n_microbatches: int,
        ranks: Sequence[int],
        rank: int,
        group: Any,
        device: torch.device,
    ) -> None:
        self.module = module
        self.views = list(views)
        self.stages = list(stages)
        self.plan = plan
        self.spec = spec
        self.n_microbatches = n_microbatches
        self.group = group
        self.rank = rank
        self.device = device
        self.ranks = list(ranks)
        self._losses = _MicroLosses(module.pipeline_loss)
        self._schedules: dict[tuple[Any, ...], Any] = {}

    def step(self, batch: Any, *, train: bool, accumulate: int = 1) -> PipelineStepResult:
        """One pass of the batch: forward and backward of all its micro-batches under training, forward only otherwise.

        The gradients the step makes are returned, not left on the parameters, which keep the gradients they had.

        Args:
            accumulate: batches per optimizer step (training): each micro-batch's loss is divided by it as well.
        """
        if not train:
            return PipelineStepResult(loss=self._run(batch, train=False, accumulate=1))
        params = [p for p in self.module.parameters() if p.requires_grad]
        earlier = [p.grad for p in params]  # Lightning zeroes gradients between training_step and backward
        for p in params:
            p.grad = None
        try:
            loss = self._run(batch, train=True, accumulate=accumulate)
            grads = tuple((p, p.grad) for p in params if p.grad is not None)
        finally:
            for p, grad in zip(params, earlier, strict=True):
                p.grad = grad
        return PipelineStepResult(loss=loss, grads=grads)

    def _run(self, batch: Any, train: bool, accumulate: int) -> torch.Tensor:
        """The batch's mean loss on every pipeline rank."""
        inputs, target, n_micro = split_batch(batch, self.n_microbatches, train, _hook(self.module, "pipeline_inputs"))
        first, last = 0 in self.stages, self.plan.n_stages - 1 in self.stages
        args = inputs if first else ()
        for view in self.views:  # shallow copies of the root: its own `training` flag is not shared
            view.training = self.module.training
        # Forward only through the stages in order, the batch as one micro-batch: evaluation under torch's V
        # schedules (they cannot run without a backward), and the last, smaller evaluation batch, which need not
        # divide into micro-batches (1F1B would refuse fewer micro-batches than stages).
        in_order = not train and (self.spec.placement == "v" or n_micro != self.n_microbatches)
        self._losses.divisor = self.n_microbatches * (accumulate if self.module.training else 1)
        self._losses.recorded = []
        if in_order:
            n_micro = 1
            losses = self._forward_in_order(inputs, target)
        else:
            schedule = self._schedule(inputs, target, train, n_micro)
            if train:
                schedule.step(*args, target=target if last else None)
            elif hasattr(schedule, "eval"):
                schedule.eval(*args, target=target if last else None)
            else:  # torch without schedule.eval (< 2.9): the same switch eval flips
                schedule._has_backward = False
                try:
                    schedule.step(*args, target=target if last else None)
                finally:
                    schedule._has_backward = True
            losses = self._losses.recorded
        self._losses.recorded = []
        # The stages' shape inference (first use) calls the loss on uninitialized tensors: keep the real ones.
        real = losses[-n_micro:]
        loss = torch.stack(real).mean() if last else torch.zeros((), device=self.device)
        loss = loss.float().detach().clone()
        dist.broadcast(loss, src=dist.get_global_rank(self.group, self.ranks[-1]), group=self.group)
        return loss

    def _schedule(self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor, train: bool, n_micro: int) -> Any:
        """The schedule (with its stages) for this batch shape; stages infer their buffers' shapes on first use."""
        from torch.distributed.pipelining import PipelineStage

        key = (train, n_micro, *(tuple(t.shape) for t in inputs), tuple(target.shape), *(t.dtype for t in inputs))
        if key in self._schedules:
            return self._schedules[key]
        stages = [
            PipelineStage(view, stage, self.plan.n_stages, self.device, group=self.group)
            for stage, view in zip(self.stages, self.views, strict=True)
        ]
        # scale_grads=False: the loss function divides each micro-batch's loss itself
        built = self.spec.schedule_class(
            stages[0] if self.spec.single_stage else stages,
            n_microbatches=n_micro,
            loss_fn=self._losses,
            scale_grads=False,
        )
        self._schedules[key] = built
        return built

    def _forward_in_order(self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> list[torch.Tensor]:
        """Forward only, the whole batch through stage 0, 1, ... in turn, activations sent between ranks; the loss
        (on the rank of the last stage).

        For evaluation under the V-shaped schedules (ZBV, DualPipeV), whose torch implementations need a backward,
        and for an evaluation batch that does not divide into the micro-batches. One micro-batch of the whole batch:
        its loss is the batch mean, as with equal micro-batches.
        """
        views = dict(zip(self.stages, self.views, strict=True))
        losses = []
        hidden: Any = inputs
        for stage in range(self.plan.n_stages):
            if self.ranks[stage] != self.rank:
                continue
            if stage > 0 and self.ranks[stage - 1] != self.rank:
                source = dist.get_global_rank(self.group, self.ranks[stage - 1])
                hidden = (_recv_tensor(source, self.group, self.device),)
            output = views[stage](*hidden)
            if stage == self.plan.n_stages - 1:
                losses.append(self.module.pipeline_loss(output, target).detach())
            elif self.ranks[stage + 1] != self.rank:
                _send_tensor(output, dist.get_global_rank(self.group, self.ranks[stage + 1]), self.group)
            hidden = (output,)
        return losses


def _hook(module: Any, name: str) -> Callable[..., Any] | None:
    hook = getattr(module, name, None)
    return hook if callable(hook) else None


def clip_grad_norm_over_stages(optimizer: Optimizer, clip_val: float, group: Any, device: torch.device) -> None:
    """Clip the optimizer's gradients by their norm over every stage of the pipeline (`group`): the sum of squares
    of this rank's gradients (FSDP2 shards summed over their own group first) is all-reduced before the root."""
    grads = [p.grad for param_group in optimizer.param_groups for p in param_group["params"] if p.grad is not None]
    squares = torch.zeros((), device=device, dtype=torch.float32)
    sharded: dict[Any, torch.Tensor] = {}  # FSDP2's gradient shards: summed here, then over their mesh's group
    for grad in grads:
        shard_group = _shard_group(grad)
        if shard_group is not None:
            total = sharded.setdefault(shard_group, torch.zeros_like(squares))
            total += grad.to_local().detach().float().pow(2).sum()
        else:
            local = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            squares += local.detach().float().pow(2).sum()
    for shard_group, total in sharded.items():
        dist.all_reduce(total, group=shard_group)
        squares += total
    dist.all_reduce(squares, group=group)
    norm = squares.sqrt()
    coefficient = torch.clamp(clip_val / (norm + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient.to(grad.dtype))


def _shard_group(grad: Any) -> Any:
    """The process group over which a DTensor gradient is sharded (a 1-D mesh, `Shard` placement: FSDP2's); None
    for a plain or replicated tensor, or a layout whose norm needs the full tensor."""
    mesh = getattr(grad, "device_mesh", None)
    placements: tuple[Any, ...] = getattr(grad, "placements", ())
    if mesh is None or mesh.ndim != 1 or len(placements) != 1 or not placements[0].is_shard():
        return None
    return mesh.get_group()


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _send_tensor(tensor: torch.Tensor, dst: int, group: Any) -> None:
    """Send a tensor of up to 6 dimensions with a header (rank, shape, dtype) so the receiver can allocate it."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() > 6 or tensor.dtype not in _DTYPES:
        raise ConfigTypeError(
            f"A pipeline stage's output must be one floating tensor of <= 6 dimensions; got {tensor!r}: return a "
            "single tensor from each block (the model's `pipeline_blocks`)."
        )
    shape = list(tensor.shape) + [0] * (6 - tensor.dim())
    header = torch.tensor([tensor.dim(), *shape, _DTYPES.index(tensor.dtype)], dtype=torch.int64, device=tensor.device)
    dist.send(header, dst=dst, group=group)
    dist.send(tensor.contiguous(), dst=dst, group=group)


def _recv_tensor(src: int, group: Any, device: torch.device) -> torch.Tensor:
    header = torch.empty(8, dtype=torch.int64, device=device)
    dist.recv(header, src=src, group=group)
    ndim, *shape, dtype = header.tolist()
    tensor = torch.empty(shape[:ndim], dtype=_DTYPES[dtype], device=device)
    dist.recv(tensor, src=src, group=group)
    return tensor
