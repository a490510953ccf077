"""Micro-batch sizing by experiment: the largest micro-batch that fits, and splitting a batch that did not.

The search and the splitting the micro-batch finder (`callbacks.MicroBatchFinder`) is built on, with no Trainer in them:

- `candidate_sizes(batch_size)`: the micro-batches a batch divides into evenly, largest first;
- `find_micro_batch(try_size, batch_size)`: the largest candidate whose trial fits (no out-of-memory error, and a
  peak within the budget when the trial measures one), by bisection over the candidates;
- `split_sizes(n, piece)` and `split_batch(batch, sizes)`: a batch cut into micro-batches along its first dimension
  (30 in pieces of 8: 8, 8, 8, 6), with `sample_weights(sizes)`, the share of each piece in the batch's mean loss
  (a piece's mean loss times its share sums to the whole batch's mean, which equal weights would not);
- `backward_in_pieces(loss_fn, batch, params, piece=)`: one batch's forward and backward in micro-batches, recovering
  from out-of-memory by splitting further, with the gradients of the whole batch and ranks kept in lockstep;
- `is_out_of_memory(err)` and `release_memory()`: what counts as running out of device memory (torch's
  `OutOfMemoryError` on CUDA, and the same class raised by a memory-budget seam on a CPU), and freeing what a
  failed attempt held.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_accel.batches import samples_in
from lightning_accel.errors import ConfigError, ConfigTypeError

__all__ = [
    "MicroBatchSearch",
    "MicroBatchTooLargeError",
    "SplitStep",
    "Trial",
    "average_gradients",
    "backward_in_pieces",
    "candidate_sizes",
    "find_micro_batch",
    "is_out_of_memory",
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
    """One attempt of the search: a micro-batch size, whether it fitted, and its peak memory when measured."""

    size: int
    fits: bool
    peak_bytes: int | None = None
    """The trial's peak device memory (CUDA); None where it is not measured (a CPU)."""
    reason: str = ""
    """Why it did not fit: "out of memory", or the peak against the budget."""


@dataclass(frozen=True)
class MicroBatchSearch:
    """The search's result: the micro-batch it chose and every trial, in the order run."""

    batch_size: int
    micro_batch: int | None
    """The largest candidate that fitted; None when not even one sample did."""
    trials: tuple[Trial, ...] = field(default_factory=tuple)

    @property
    def micro_batches(self) -> int | None:
        """Micro-batches per batch at the chosen size (the accumulation factor the batch gains)."""
        return None if self.micro_batch is None else self.batch_size // self.micro_batch


def find_micro_batch(
    try_size: Callable[[int], int | None],
    batch_size: int,
    *,
    budget_bytes: int | None = None,
) -> MicroBatchSearch:
    """The largest micro-batch among `candidate_sizes(batch_size)` whose trial fits, by bisection (memory grows with
    the micro-batch, so a size that fits means every smaller one does).

    Args:
        try_size: runs one forward and backward at the given micro-batch size and returns its peak device memory in
            bytes (None where not measured); raises torch's `OutOfMemoryError` when it does not fit. It is called
            with each size at most once, and memory is released after each failed trial.
        batch_size: the loader's batch size, the largest candidate.
        budget_bytes: a trial whose peak exceeds this does not fit either (the margin below the device's memory);
            None: only an out-of-memory error rules a size out.

    Returns:
        The search, with `micro_batch=None` when even 1 sample does not fit.
    """
    sizes = candidate_sizes(batch_size)  # largest first
    trials: list[Trial] = []
    lo, hi = 0, len(sizes) - 1  # the answer's index lies in [lo, hi]; sizes[hi] (1) is the last resort
    best: int | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        trial = _run_trial(try_size, sizes[mid], budget_bytes)
        trials.append(trial)
        if trial.fits:
            best, hi = sizes[mid], mid - 1  # fits: try larger sizes (smaller indices)
        else:
            lo = mid + 1
    return MicroBatchSearch(batch_size=batch_size, micro_batch=best, trials=tuple(trials))


def _run_trial(try_size: Callable[[int], int | None], size: int, budget_bytes: int | None) -> Trial:
    first_line: str | None
    try:
        peak = try_size(size)
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        first_line = (str(err).strip().splitlines() or [""])[0][:300]
        peak = None
    else:
        first_line = None
    if first_line is not None:
        release_memory()  # outside the `except`: the handled error's frames no longer hold the trial's tensors
        return Trial(size, fits=False, reason=f"out of memory ({first_line})" if first_line else "out of memory")
    if budget_bytes is not None and peak is not None and peak > budget_bytes:
        return Trial(size, fits=False, peak_bytes=peak, reason=f"peak {peak} B over the budget of {budget_bytes} B")
    return Trial(size, fits=True, peak_bytes=peak)


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
    the room a search run before the first step must leave."""
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
