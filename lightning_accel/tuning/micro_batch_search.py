"""Micro-batch sizing by experiment: how large a micro-batch fits, and splitting a batch that did not.

The sizing and the splitting the micro-batch finder (`callbacks.MicroBatchFinder`) is built on, with no Trainer in
them:

- `candidate_sizes(batch_size)`: the micro-batches a batch divides into evenly, largest first;
- `micro_batch_for_budget(batch_size, ran, peak_bytes=, base_bytes=, budget_bytes=)`: after a real step of `ran`
  samples whose peak device memory was measured, the micro-batch the next steps should run to stay within a budget
  (memory grows about linearly with the micro-batch above what the step held before it started);
- `split_sizes(n, piece)` and `split_batch(batch, sizes)`: a batch cut into micro-batches along its first dimension
  (30 in pieces of 8: 8, 8, 8, 6), with `sample_weights(sizes)`, the share of each piece in the batch's mean loss
  (a piece's mean loss times its share sums to the whole batch's mean, which equal weights would not);
- `backward_in_pieces(loss_fn, batch, params, piece=)`: one batch's forward and backward in micro-batches, recovering
  from out-of-memory by splitting further, with the gradients of the whole batch and ranks kept in lockstep;
- `is_out_of_memory(err)` and `release_memory()`: what counts as running out of device memory (torch's
  `OutOfMemoryError` on CUDA, and the same class raised by a memory-budget seam on a CPU), and freeing what a
  failed attempt held;
- `held_tensors(module)`, `batch_sized_state(before, after, samples)` and `batch_statistics_layers(module)`: what
  makes a module's update differ when its batch is split: state sized by the batch that a step leaves on the module
  (an RNN's hidden state), and layers that take statistics over the batch (BatchNorm).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_accel.batches import samples_in
from lightning_accel.errors import ConfigError, ConfigTypeError

__all__ = [
    "MicroBatchTooLargeError",
    "SplitStep",
    "Trial",
    "average_gradients",
    "backward_in_pieces",
    "batch_sized_state",
    "batch_statistics_layers",
    "candidate_sizes",
    "held_tensors",
    "is_out_of_memory",
    "micro_batch_for_budget",
    "optimizer_state_bytes",
    "release_memory",
    "sample_weights",
    "split_batch",
    "split_sizes",
]


def candidate_sizes(batch_size: int) -> list[int]:
    """The micro-batch sizes that divide `batch_size` evenly, largest first (`12` -> 12, 6, 4, 3, 2, 1): each keeps
    the batch whole with a constant number of micro-batches per step.

    Raises:
        ConfigTypeError: for a batch size that is not an integer.
        ConfigError: for a batch size below 1.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise ConfigTypeError(f"`batch_size={batch_size!r}` must be an integer >= 1.", setting="batch_size")
    if batch_size < 1:
        raise ConfigError(f"`batch_size={batch_size}` must be an integer >= 1.", setting="batch_size")
    small = [d for d in range(1, int(batch_size**0.5) + 1) if batch_size % d == 0]
    return sorted({*small, *(batch_size // d for d in small)}, reverse=True)


def is_out_of_memory(err: BaseException) -> bool:
    """Whether `err` is the device running out of memory: torch's `OutOfMemoryError` (CUDA's, and what a CPU test's
    memory budget raises), or a RuntimeError with CUDA's or the CUDA allocator's out-of-memory message."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("CUDA out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text)


def release_memory() -> None:
    """Free what a failed attempt held: collect its garbage (the exception's frames hold its activations) and return
    the CUDA caching allocator's free blocks, so the next, smaller attempt starts from the memory the model needs."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Trial:
    """One size a sizing step ran: the micro-batch, whether it fitted, and its peak memory when measured."""

    size: int
    fits: bool
    """No out-of-memory error, and a measured peak within the budget."""
    peak_bytes: int | None = None
    """The step's peak device memory (CUDA); None where it is not measured (a CPU, an attempt that ran out)."""
    reason: str = ""
    """Why it did not fit: "out of memory", or the peak against the budget."""


def micro_batch_for_budget(batch_size: int, ran: int, *, peak_bytes: int, base_bytes: int, budget_bytes: int) -> int:
    """The micro-batch to run after a step of `ran` samples that peaked at `peak_bytes`: `ran` itself when that is
    within `budget_bytes` (or `ran` is 1); else the largest of `candidate_sizes(batch_size)` below `ran` whose peak,
    estimated as `base_bytes` plus the step's bytes per sample times its samples, is within the budget; 1 when none
    is.

    Args:
        batch_size: the loader's batch, whose divisors are the candidates.
        ran: the samples per micro-batch of the measured step.
        peak_bytes: its peak device memory.
        base_bytes: what the step held before its first forward, plus the gradients it allocates (memory that does
            not grow with the micro-batch).
        budget_bytes: the most a step's peak may reach.
    """
    if peak_bytes <= budget_bytes or ran <= 1:
        return ran
    per_sample = max(0, peak_bytes - base_bytes) / ran
    for size in candidate_sizes(batch_size):
        if size < ran and base_bytes + per_sample * size <= budget_bytes:
            return size
    return 1


def split_sizes(n: int, piece: int) -> list[int]:
    """`n` samples in pieces of at most `piece`, in order: the full pieces, then the rest (30 by 8: 8, 8, 8, 6).

    Raises:
        ConfigError: for `n < 1` or `piece < 1`.
    """
    if n < 1 or piece < 1:
        raise ConfigError(f"cannot split {n} sample(s) into pieces of {piece}; both must be >= 1.")
    return [piece] * (n // piece) + ([n % piece] if n % piece else [])


def sample_weights(sizes: Sequence[int]) -> list[float]:
    """Each piece's share of the batch (`size / total`): the weight of its mean loss in the batch's mean loss."""
    total = sum(sizes)
    return [size / total for size in sizes]


def split_batch(batch: Any, sizes: Sequence[int]) -> list[Any]:
    """`batch` cut along its first dimension into consecutive pieces of `sizes`, keeping its structure: every tensor
    in it (inside tuples, lists and dicts) is cut the same way; anything else is repeated in each piece.

    Raises:
        ConfigError: when a tensor's first dimension is not `sum(sizes)` (the pieces would not cover the batch).
    """
    total = sum(sizes)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]

    def cut(value: Any, index: int) -> Any:
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != total:
                raise ConfigError(
                    f"A batch tensor of shape {tuple(value.shape)} cannot be split into micro-batches of {list(sizes)}"
                    f" ({total} samples): every tensor of a batch must hold the samples along its first dimension."
                )
            return value.narrow(0, offsets[index], sizes[index])
        if isinstance(value, dict):
            return {key: cut(item, index) for key, item in value.items()}
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
            return type(value)(*(cut(item, index) for item in value))
        if isinstance(value, (list, tuple)):
            return type(value)(cut(item, index) for item in value)
        return value

    return [cut(batch, i) for i in range(len(sizes))]


class MicroBatchTooLargeError(RuntimeError):
    """Not even one sample of a batch fits the device: the message names what was tried and what to do."""


@dataclass(frozen=True)
class SplitStep:
    """What `backward_in_pieces` did for one batch."""

    loss: torch.Tensor | None
    """The batch's mean loss (the pieces' mean losses, weighted by their samples), detached; None when every piece
    was skipped."""
    piece: int
    """The micro-batch size that ran."""
    recoveries: int
    """Out-of-memory errors survived by splitting further."""


def backward_in_pieces(
    loss_fn: Callable[[Any], torch.Tensor | None],
    batch: Any,
    params: Sequence[torch.nn.Parameter],
    *,
    piece: int | None = None,
    agree: Callable[[bool], bool] | None = None,
    backward: Callable[[torch.Tensor], None] | None = None,
    on_attempt: Callable[[int], None] | None = None,
) -> SplitStep:
    """Forward and backward of `batch` as micro-batches of `piece` samples (the whole batch when None), with the
    gradient of the whole batch's mean loss: each piece's mean loss is weighted by its share of the samples.

    When a piece runs out of memory, the gradients are put back as they were before this batch (earlier
    micro-batches of an accumulation window keep theirs), memory is released, and the batch runs again in pieces of
    half the size; the same batch is never halved twice for one error.

    Args:
        loss_fn: the mean loss of a piece (a forward); its backward runs here. None skips the piece (a
            `training_step` that returned None).
        batch: tensors along the first dimension, in tuples, lists and dicts (`split_batch`).
        params: the parameters whose gradients accumulate (saved before the batch, restored after a failure).
        piece: the micro-batch size to start from.
        agree: called after every attempt with "this rank ran out of memory", returns "any rank did" (an all-reduce
            of the flag); every rank then retries at the same size, so collectives stay matched. Under DDP, run the
            pieces inside `no_sync` and reduce the gradients once after this returns.
        backward: runs a piece's backward (Lightning's `strategy.backward`, which scales an fp16 loss and calls the
            backward hooks); None: `loss.backward()`.

    Raises:
        MicroBatchTooLargeError: when one sample does not fit.
    """
    n = max(1, samples_in(batch, default=1))
    size = n if piece is None else max(1, piece)  # the size every rank holds, whatever its own batch's length
    # The gradients from before this batch are set aside (by reference: no copy) and the pieces accumulate into
    # fresh ones; success adds the two, failure puts the old ones back as they were.
    before = [p.grad for p in params]
    recoveries = 0
    while True:
        for param in params:
            param.grad = None
        if on_attempt is not None:
            on_attempt(size)
        sizes = split_sizes(n, min(size, n))
        message: str | None = None
        total: torch.Tensor | None = None
        loss: torch.Tensor | None = None
        try:
            for part, weight in zip(split_batch(batch, sizes), sample_weights(sizes), strict=True):
                loss = loss_fn(part)
                if loss is None:
                    continue
                loss = loss * weight
                if backward is None:
                    loss.backward()
                else:
                    backward(loss)
                total = loss.detach() if total is None else total + loss.detach()  # the loss's dtype and device
                loss = None
        except Exception as err:
            if not is_out_of_memory(err):
                _put_back(params, before)
                raise
            message = str(err).strip().splitlines()[0][:500] if str(err).strip() else type(err).__name__
        loss = None  # the failed piece's graph (and its activations) go before anything else runs
        oomed = message is not None
        if agree is not None:
            oomed = agree(oomed)
        if not oomed:
            for param, old in zip(params, before, strict=True):
                if old is not None:
                    if param.grad is None:
                        param.grad = old
                    else:
                        param.grad = old.add_(param.grad)
            return SplitStep(loss=total, piece=size, recoveries=recoveries)
        total = None
        _put_back(params, before)
        release_memory()  # outside the `except`: the handled error's frames no longer hold the attempt's tensors
        if size == 1:
            raise MicroBatchTooLargeError(
                f"One sample of this batch does not fit the device ({message or 'another rank ran out of memory'}). "
                "Reduce the memory per sample: activation checkpointing (Parallelize(activation_checkpointing=True)), "
                "bf16 (precision='bf16-mixed' or 'amp'), a model-parallel strategy (ModelParallelStrategy, "
                "PipelineStrategy), or shorter sequences."
            )
        size, recoveries = max(1, size // 2), recoveries + 1


def _put_back(params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad


def average_gradients(params: Sequence[torch.nn.Parameter], group: Any = None, bucket_bytes: int = 25 * 2**20) -> None:
    """All-reduce the gradients of `params` to their mean over the ranks of `group` (what DDP's backward does), in
    flat buckets of about `bucket_bytes` per dtype and device: the one reduction of an optimizer step whose
    micro-batches ran under `no_sync`. A parameter without a gradient on this rank but with one on another takes part
    with zeros (every rank must send the same buckets); one without a gradient on any rank keeps None. No-op outside
    an initialised process group of more than one rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size(group)
    if world == 1:
        return
    trained = [param for param in params if param.requires_grad]
    if not trained:
        return
    has_grad = torch.tensor([param.grad is not None for param in trained], dtype=torch.uint8, device=trained[0].device)
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=group)
    grads: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for param, anywhere in zip(trained, has_grad.tolist(), strict=True):
        if not anywhere:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grads.setdefault((param.grad.dtype, param.grad.device), []).append(param.grad)
    for tensors in grads.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for grad in [*tensors, None]:
            if grad is not None:
                bucket.append(grad)
                size += grad.numel() * grad.element_size()
            if bucket and (grad is None or size >= bucket_bytes):
                flat = torch.cat([g.reshape(-1) for g in bucket])
                dist.all_reduce(flat, group=group)
                flat /= world
                offset = 0
                for g in bucket:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
                bucket, size = [], 0


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The device memory `optimizer`'s state takes once it has stepped: what it holds now, or, before its first step,
    an estimate from its kind (Adam-like optimizers keep two tensors per parameter, momentum SGD one, others none),
    the room a step measured before the optimizer's first step must leave for it."""
    held = sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )
    if held:
        return held
    per_param = 0
    defaults = optimizer.defaults
    if "betas" in defaults:
        per_param = 2
    elif defaults.get("momentum"):
        per_param = 1
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    return per_param * sum(p.numel() * p.element_size() for p in params)


def held_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors `module` and its submodules hold as plain attributes, alone or in a tuple or a public dict, by
    qualified name (`model.hidden[0]`): not parameters or buffers, nor the states of torchmetrics metrics (their
    accumulators), nor the items of lists (outputs collected for the epoch's end, which a split leaves whole)."""
    held: dict[str, torch.Tensor] = {}
    for prefix, sub in module.named_modules():
        if hasattr(sub, "_defaults") and hasattr(sub, "_update_count"):  # a torchmetrics Metric
            continue
        for name, value in vars(sub).items():
            qualified = f"{prefix}.{name}" if prefix else name
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                held[qualified] = value
            elif isinstance(value, tuple):
                held.update((f"{qualified}[{i}]", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor))
            elif isinstance(value, dict) and not name.startswith("_"):  # `_parameters`, `_buffers`: nn.Module's own
                held.update((f"{qualified}[{k!r}]", v) for k, v in value.items() if isinstance(v, torch.Tensor))
    return held


def batch_sized_state(
    before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor], samples: int
) -> dict[str, tuple[int, ...]]:
    """The tensors of `after` (a `held_tensors` taken after a step) that the step set, not the same objects as in
    `before`, and that hold `samples` along their first or second dimension (an RNN's hidden state is (layers,
    batch, features)): state sized by the step's batch that the module keeps for its next step. Name -> shape."""
    found = {}
    for name, tensor in after.items():
        if before.get(name) is tensor or tensor.dim() == 0:
            continue
        if tensor.shape[0] == samples or (tensor.dim() > 1 and tensor.shape[1] == samples):
            found[name] = tuple(tensor.shape)
    return found


def batch_statistics_layers(module: torch.nn.Module) -> dict[str, str]:
    """The layers of `module` whose output or running statistics depend on the whole batch as they run now: BatchNorm
    of any kind (SyncBatchNorm and the lazy ones too) in train mode or without running statistics, and InstanceNorm
    in train mode that tracks running statistics (averaged over the batch). Qualified name -> class name."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.instancenorm import _InstanceNorm

    found = {}
    for name, layer in module.named_modules():
        if isinstance(layer, _InstanceNorm):
            batchwise = layer.training and layer.track_running_stats
        elif isinstance(layer, _BatchNorm):
            batchwise = layer.training or layer.running_mean is None
        else:
            batchwise = False
        if batchwise:
            found[name or type(module).__name__] = type(layer).__name__
    return found
