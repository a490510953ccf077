"""MicroBatchFinder: every batch runs as the largest micro-batches that fit, found at fit start and halved on
out-of-memory, with the update of the whole batch (the hook over `lightning_accel.tuning.micro_batch_search`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from contextlib import ExitStack, nullcontext
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel import _lightning
from lightning_accel.batches import loader_batch_size, samples_in
from lightning_accel.errors import ConfigError, LightningAccelWarning
from lightning_accel.patching import patch_attribute
from lightning_accel.signals import raise_if_signalled
from lightning_accel.tuning.micro_batch_search import (
    MicroBatchSearch,
    MicroBatchTooLargeError,
    average_gradients,
    backward_in_pieces,
    find_micro_batch,
    optimizer_state_bytes,
    split_batch,
)

__all__ = ["MicroBatchFinder"]


class MicroBatchFinder(Callback):
    """Run each training batch as micro-batches of the largest size that fits the device, with the update of the
    whole batch: Lightning's `accumulate_grad_batches="auto"` (its issue #17393), for a plain `Trainer` on one device
    or under DDP.

    At the start of training it searches the divisors of the train loader's batch size (bisection, largest first)
    for the largest micro-batch whose forward and backward fit: no out-of-memory error, and on CUDA a peak of at most
    `memory_fraction` of the memory this process can use, less room for the optimizer's state. Every batch then runs
    in pieces of that size inside its optimizer step, each piece's mean loss weighted by its share of the samples, so
    the gradient is the whole batch's: the loader, its samples and order, the optimizer steps per epoch (Lightning's
    `estimated_stepping_batches`, `estimated_optimizer_steps`) and the LR schedules sized by them stay what they were,
    and so does the global batch of `accumulate_grad_batches` or `AccumulationScheduler(global_batch_size=...)`, whose
    every micro-batch this splits further.

    During training, an out-of-memory error inside a step (a long sequence, a fragmented allocator) puts the
    gradients back as they were before the batch, frees what the attempt held and runs the batch again in pieces of
    half the size, once per error; after `grow_after` clean batches it tries twice the size again, up to the size
    found. Under DDP every rank adopts the smallest rank's size, an out-of-memory error on one rank makes every rank
    redo the batch at the smaller size (one all-reduce of a byte per attempt), the gradients are averaged once per
    optimizer step (the pieces run past DDP's forward, under `no_sync`), and buffers are broadcast from rank zero then;
    a DDP communication hook is not used.

    The backward hooks (`on_before_backward`, `on_after_backward`) run once per batch, after all its pieces, with the
    batch's loss; `training_step` runs once per piece (on_step logs show the last piece's values; on_epoch means are
    weighted by each piece's samples). Under DDP, `training_step` must not run collectives of its own
    (SyncBatchNorm, an all-gather): a rank that runs out of memory would leave them unmatched.

    Args:
        micro_batch_size: "auto" (search at the start of training) or the micro-batch to start from (no search).
        memory_fraction: on CUDA, the share of the memory this process can use (free + what its allocator holds)
            that a trial's peak may reach; the rest is the margin for fragmentation and data-dependent batches.
        grow_after: clean batches after a recovery before trying twice the micro-batch again (never above the size
            found); None: keep the smaller size.

    Raises:
        ConfigError: for a bad option, manual optimization, a strategy other than one device or DDP (FSDP, model
            parallel, pipeline and DeepSpeed split their own work), or Lightning's `BatchSizeFinder` in the same run.
        MicroBatchTooLargeError: (at the start of training, or at the step that needs it) when one sample does not
            fit; the message names the memory and the fixes.

    Logs:
        `micro_batch/size`: the micro-batch the step ran (samples); `micro_batch/oom_recoveries`: out-of-memory errors
        survived so far (count).

    Example::

        trainer = Trainer(callbacks=[MicroBatchFinder()])  # the loader's batch of 256 runs as micro-batches that fit
    """

    @classmethod
    def check_run(cls, *, family: str, on_cuda: bool, block_classes: bool, settings: Mapping[str, Any]) -> None:
        """This callback's rule for a run, asked before launch: one device or DDP; the other strategies split their
        own work and reduce gradients inside the backward.

        Raises:
            ConfigError: for `family` fsdp, model_parallel, pipeline or deepspeed.
        """
        if family in ("fsdp", "model_parallel", "pipeline", "deepspeed"):
            raise ConfigError(
                f"(MicroBatchFinder, `micro_batch=auto`) runs on one device or under DDP, not with "
                f"`strategy={family}`, which splits its own work and reduces gradients inside the backward; use "
                "`micro_batch=none` with it (and set the batch size by hand), or `strategy=ddp`."
            )

    def __init__(
        self,
        micro_batch_size: int | Literal["auto"] = "auto",
        *,
        memory_fraction: float = 0.9,
        grow_after: int | None = 100,
    ) -> None:
        if micro_batch_size != "auto" and (
            isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1
        ):
            raise ConfigError(
                f"`micro_batch_size={micro_batch_size!r}` must be 'auto' or an integer >= 1.",
                setting="micro_batch_size",
            )
        if (
            isinstance(memory_fraction, bool)
            or not isinstance(memory_fraction, (int, float))
            or not (0 < memory_fraction <= 1)
        ):
            raise ConfigError(
                f"`memory_fraction={memory_fraction!r}` must be a number in (0, 1], e.g. 0.9.",
                setting="memory_fraction",
            )
        if grow_after is not None and (
            isinstance(grow_after, bool) or not isinstance(grow_after, int) or grow_after < 1
        ):
            raise ConfigError(
                f"`grow_after={grow_after!r}` must be an integer >= 1, or None to keep the smaller size.",
                setting="grow_after",
            )
        self.micro_batch_size = micro_batch_size
        self.memory_fraction = float(memory_fraction)
        self.grow_after = grow_after
        self.search: MicroBatchSearch | None = None
        """The search of this fit (None when resumed or given a size)."""
        self.batch_size: int | None = None
        """The train loader's batch size the micro-batch divides."""
        self.found: int | None = None
        """The micro-batch chosen at the start of training (the ceiling for growing back)."""
        self.size: int | None = None
        """The micro-batch the next batch starts from."""
        self.oom_recoveries = 0
        """Out-of-memory errors survived during training (every rank counts each one)."""
        self._clean = 0  # clean batches since the last recovery
        self._last_size: int | None = None  # the micro-batch the last batch ran
        self._resumed = False  # the state came from a checkpoint
        self._restore = ExitStack()

    # -- set-up ---------------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _check_trainer(trainer, pl_module)
        self._restore.close()
        automatic = trainer.fit_loop.epoch_loop.automatic_optimization

        why = "MicroBatchFinder (remove it to train whole batches)"

        def make_closure(kwargs: OrderedDict, optimizer: torch.optim.Optimizer, batch_idx: int) -> Closure:
            backward, zero_grad = _lightning.closure_step_fns(automatic, batch_idx, optimizer, why)
            return _PiecesClosure(self, trainer, kwargs, optimizer, backward, zero_grad)

        self._restore.callback(_lightning.patch_closure_factory(automatic, make_closure, why))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._restore.close()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore.close()  # Lightning skips teardown after an exception

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.train_dataloader is None:
            trainer.fit_loop.setup_data()
        batch = None
        batch_size = loader_batch_size(trainer.train_dataloader)
        if batch_size is None:
            batch = _first_batch(trainer)
            batch_size = samples_in(batch, default=1)
        resumed, self._resumed = self._resumed, False
        if resumed and self.batch_size == batch_size and self.size and self.found:
            rank_zero_info(
                f"MicroBatchFinder: resumed at micro-batch {self.size} of {self.batch_size} "
                f"({self.oom_recoveries} out-of-memory recoveries so far)."
            )
            return
        self.batch_size, self.search = batch_size, None
        self.oom_recoveries = self._clean = 0
        if self.micro_batch_size != "auto":
            chosen, how = min(int(self.micro_batch_size), self.batch_size), "given"
        else:
            self.search = self._search(trainer, pl_module, _first_batch(trainer) if batch is None else batch)
            chosen = _agree_min(trainer, self.search.micro_batch or 0)
            if chosen == 0:
                raise MicroBatchTooLargeError(_too_large_message(self.search, trainer))
            how = f"trials: {_trials_text(self.search)}"
        self.found = self.size = chosen
        pieces = -(-self.batch_size // chosen)
        rank_zero_info(
            f"MicroBatchFinder: micro-batch {chosen} of the loader's {self.batch_size} ({pieces} "
            f"micro-batch(es) per batch; {how})."
        )

    def _search(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> MicroBatchSearch:
        """Forward and backward of the first `size` samples of the first batch at each size the bisection asks for,
        with no logging, and the RNG, buffers (BatchNorm statistics) and gradients put back afterwards."""
        device = pl_module.device
        cuda = device.type == "cuda"
        budget = None
        if cuda:
            free, total = torch.cuda.mem_get_info(device)
            room = free + torch.cuda.memory_reserved(device)
            capped = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.6
            if capped is not None:
                room = min(room, int(capped(device) * total))
            budget = int(self.memory_fraction * room) - sum(optimizer_state_bytes(o) for o in trainer.optimizers)
        n = samples_in(batch, default=1)
        params = [p for p in pl_module.parameters() if p.requires_grad]
        buffers = {name: b.detach().clone() for name, b in pl_module.named_buffers()}
        metrics = _metric_states(pl_module)
        rngs = _host_rngs()
        rng = torch.random.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(device) if cuda else None

        def try_size(size: int) -> int | None:
            raise_if_signalled("MicroBatchFinder's search")  # a stop signal ends the search at its next trial
            part = batch if size >= n else split_batch(batch, [size, n - size])[0]
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            try:
                loss = _piece_loss(trainer, _step_kwargs(pl_module, part))
                if loss is not None:
                    loss.backward()
                    del loss
                return int(torch.cuda.max_memory_allocated(device)) if cuda else None
            finally:
                for param in params:
                    param.grad = None

        with ExitStack() as stack:
            for name in ("log", "log_dict"):
                stack.callback(patch_attribute(pl_module, name, _no_log, why="MicroBatchFinder's trial steps"))
            stack.enter_context(_no_sync(trainer))
            try:
                return find_micro_batch(try_size, n, budget_bytes=budget)
            finally:
                with torch.no_grad():
                    for name, b in pl_module.named_buffers():
                        if name in buffers:
                            b.copy_(buffers[name])
                for metric, state in metrics:
                    metric.__dict__.update(state)
                _set_host_rngs(rngs)
                torch.random.set_rng_state(rng)
                if cuda_rng is not None:
                    torch.cuda.set_rng_state(cuda_rng, device)

    # -- training -------------------------------------------------------------------------------------------------

    def _run_batch(self, trainer: pl.Trainer, kwargs: OrderedDict, optimizer: Any, backward: Callable | None) -> Any:
        """One batch in micro-batches; returns Lightning's ClosureResult with the batch's (normalised) loss."""
        pl_module = trainer.lightning_module
        params = [p for p in pl_module.parameters() if p.requires_grad]
        extra: dict[str, Any] = {}

        results = _lightning.logged_results(trainer)
        whole = kwargs["batch"]

        def loss_fn(part: Any) -> torch.Tensor | None:
            extra.clear()  # the last piece's outputs (a failed attempt's among them) go before the next forward
            if results is not None:  # self.log weighs on-epoch means by this piece's samples, not the batch's
                results.batch, results.batch_size = part, None
            output = _piece_output(trainer, OrderedDict(kwargs, batch=part))
            result = ClosureResult.from_training_step_output(output, trainer.accumulate_grad_batches)
            extra.update(result.extra)
            return result.closure_loss

        def piece_backward(loss: torch.Tensor) -> None:
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            trainer.precision_plugin.backward(scaler.scale(loss) if scaler is not None else loss, pl_module, optimizer)

        model = trainer.strategy.model
        group = getattr(model, "process_group", None)
        distributed = trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()
        agree = (lambda oom: _any_rank(oom, pl_module.device, group)) if distributed else None
        sync = bool(getattr(model, "require_backward_grad_sync", False))  # the window ends with this batch
        try:
            with _no_sync(trainer):
                step = backward_in_pieces(
                    loss_fn,
                    whole,
                    params,
                    piece=self.size,
                    agree=agree,
                    backward=piece_backward if backward is not None else _skip_backward,
                )
        finally:
            if results is not None:
                results.batch, results.batch_size = whole, None
        if distributed and sync and backward is not None:
            average_gradients(params, group)
            if getattr(model, "broadcast_buffers", False):  # what DDP's forward did: rank zero's buffers everywhere
                for buffer in pl_module.buffers():
                    torch.distributed.broadcast(buffer, src=_group_rank_zero(group), group=group)
        self._after_batch(trainer, step.piece, step.recoveries)
        if step.loss is None:
            return ClosureResult(None, extra=extra)
        if backward is not None:
            loss = step.loss
            _lightning.call_callback_hooks(trainer, "on_before_backward", loss)
            _lightning.call_module_hook(trainer, "on_before_backward", loss)
            _lightning.call_callback_hooks(trainer, "on_after_backward")
            _lightning.call_module_hook(trainer, "on_after_backward")
        return ClosureResult(step.loss, extra=extra)

    def _after_batch(self, trainer: pl.Trainer, piece: int, recoveries: int) -> None:
        self._last_size = piece
        if recoveries:
            self.oom_recoveries += recoveries
            self._clean = 0
            before, self.size = self.size, piece
            rank_zero_warn(
                f"MicroBatchFinder: out of memory at step {trainer.global_step} (epoch {trainer.current_epoch}); the "
                f"batch ran again as micro-batches of {piece} (was {before}); {self.oom_recoveries} recovery(ies) so "
                "far.",
                category=LightningAccelWarning,
            )
            return
        self._clean += 1
        if self.grow_after and self.size is not None and self.found is not None and self.size < self.found:
            if self._clean >= self.grow_after:
                self.size, self._clean = min(self.found, self.size * 2), 0

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._last_size is not None:
            pl_module.log("micro_batch/size", float(self._last_size), on_step=True, on_epoch=False)
            pl_module.log("micro_batch/oom_recoveries", float(self.oom_recoveries), on_step=True, on_epoch=False)

    # -- checkpoints ----------------------------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "found": self.found,
            "size": self.size,
            "oom_recoveries": self.oom_recoveries,
            "clean": self._clean,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The micro-batch of the checkpoint's run, used again when the loader's batch size is the same."""
        self.batch_size, self.found, self.size = (state_dict.get(k) for k in ("batch_size", "found", "size"))
        self.oom_recoveries, self._clean = int(state_dict.get("oom_recoveries", 0)), int(state_dict.get("clean", 0))
        self._resumed = True


class _PiecesClosure(Closure):
    """Lightning's closure for one batch, run by MicroBatchFinder in micro-batches (zero_grad first, as the
    gradients are snapshotted before the batch)."""

    def __init__(
        self,
        finder: MicroBatchFinder,
        trainer: pl.Trainer,
        kwargs: OrderedDict,
        optimizer: Any,
        backward_fn: Callable | None,
        zero_grad_fn: Callable | None,
    ) -> None:
        super().__init__(step_fn=lambda: ClosureResult(None), backward_fn=backward_fn, zero_grad_fn=zero_grad_fn)
        self._finder, self._trainer, self._kwargs, self._optimizer = finder, trainer, kwargs, optimizer
        self.backward_step, self.zero_grad_step = backward_fn, zero_grad_fn

    @override
    @torch.enable_grad()
    def closure(self, *args: Any, **kwargs: Any) -> ClosureResult:
        if self.zero_grad_step is not None:
            self.zero_grad_step()
        result = self._finder._run_batch(self._trainer, self._kwargs, self._optimizer, self.backward_step)
        if result.closure_loss is None:
            self.warning_cache.warn("`training_step` returned `None`. If this was on purpose, ignore this warning...")
        return result


def _skip_backward(loss: torch.Tensor) -> None:
    """Lightning skips the backward (its `_skip_backward`): the pieces run their forwards only."""


def _no_log(*args: Any, **kwargs: Any) -> None:
    """`LightningModule.log` during the search's trial steps: nothing is logged."""


def _piece_output(trainer: pl.Trainer, kwargs: OrderedDict) -> Any:
    """`training_step` on one micro-batch as the strategy runs it, but past DDP's forward (its buffer broadcast and
    reducer are collectives a rank out of memory would leave unmatched; the gradients are averaged afterwards)."""
    strategy = trainer.strategy
    args = strategy.precision_plugin.convert_input(tuple(kwargs.values()))
    with strategy.precision_plugin.train_step_context():
        output = _lightning.call_module_hook(trainer, "training_step", *args)
    if output is None and trainer.world_size > 1:
        raise RuntimeError("Skipping the `training_step` by returning None in distributed training is not supported.")
    return output


def _piece_loss(trainer: pl.Trainer, kwargs: dict[str, Any]) -> torch.Tensor | None:
    output = _piece_output(trainer, OrderedDict(kwargs))
    return ClosureResult.from_training_step_output(output, 1).closure_loss


def _step_kwargs(pl_module: pl.LightningModule, batch: Any) -> dict[str, Any]:
    """`training_step`'s arguments as Lightning passes them: `batch_idx` only where the signature takes it."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    kwargs: dict[str, Any] = {"batch": batch}
    if is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2):
        kwargs["batch_idx"] = 0
    return kwargs


def _metric_states(pl_module: pl.LightningModule) -> list[tuple[Any, dict[str, Any]]]:
    """Copies of every torchmetrics Metric's states (its `_defaults` keys, update count, cached result), so trial
    steps that update metrics leave them as they were."""
    import copy

    saved = []
    for module in pl_module.modules():
        defaults = getattr(module, "_defaults", None)
        if isinstance(defaults, dict) and hasattr(module, "_update_count"):
            keys = [*defaults, "_update_count", "_computed"]
            saved.append((module, {k: copy.deepcopy(module.__dict__[k]) for k in keys if k in module.__dict__}))
    return saved


def _host_rngs() -> dict[str, Any]:
    """Python's and (when imported) numpy's global random states."""
    import random
    import sys

    states: dict[str, Any] = {"random": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy"] = numpy.random.get_state()
    return states


def _set_host_rngs(states: dict[str, Any]) -> None:
    import random
    import sys

    random.setstate(states["random"])
    if "numpy" in states:
        sys.modules["numpy"].random.set_state(states["numpy"])


def _any_rank(flag: bool, device: torch.device, group: Any) -> bool:
    """Whether `flag` holds on any rank of `group`: one all-reduce of a byte (no barrier)."""
    tensor = torch.tensor([int(flag)], dtype=torch.uint8, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(tensor.item())


def _group_rank_zero(group: Any) -> int:
    """The global rank of `group`'s first rank (the source of a broadcast)."""
    if group is None:
        return 0
    try:
        return torch.distributed.get_global_rank(group, 0)
    except Exception:
        return 0


def _no_sync(trainer: pl.Trainer) -> Any:
    model = trainer.strategy.model
    return model.no_sync() if isinstance(model, torch.nn.parallel.DistributedDataParallel) else nullcontext()


def _agree_min(trainer: pl.Trainer, value: int) -> int:
    """The smallest `value` over the ranks (the micro-batch every rank can run)."""
    if trainer.world_size == 1:
        return value
    tensor = torch.tensor(value, device=trainer.strategy.root_device)
    return int(trainer.strategy.reduce(tensor, reduce_op="min").item())


def _first_batch(trainer: pl.Trainer) -> Any:
    """The train loader's first batch on the device (the RNG a shuffling sampler draws from is put back)."""
    if trainer.train_dataloader is None:
        trainer.fit_loop.setup_data()
    loader = trainer.train_dataloader
    assert loader is not None, "`fit_loop.setup_data()` sets the train DataLoader"
    sampler = getattr(loader, "sampler", None)
    generators = [
        g
        for g in (getattr(loader, "generator", None), getattr(sampler, "generator", None))
        if isinstance(g, torch.Generator)
    ]
    states = [g.get_state() for g in generators]
    rng, host = torch.random.get_rng_state(), _host_rngs()
    try:
        batch = next(iter(loader))
    except StopIteration:
        raise ConfigError(
            "MicroBatchFinder: the train DataLoader yields no batch to size the micro-batch on."
        ) from None
    finally:
        torch.random.set_rng_state(rng)
        _set_host_rngs(host)
        for generator, state in zip(generators, states, strict=True):
            generator.set_state(state)
    return trainer.strategy.batch_to_device(batch)


def _trials_text(search: MicroBatchSearch) -> str:
    def one(trial: Any) -> str:
        peak = "" if trial.peak_bytes is None else f" ({trial.peak_bytes / 2**20:.0f} MiB)"
        return f"{trial.size} {'fits' if trial.fits else 'no: ' + trial.reason}{peak}"

    return ", ".join(one(t) for t in search.trials)


def _too_large_message(search: MicroBatchSearch | None, trainer: pl.Trainer) -> str:
    tried = _trials_text(search) if search is not None and search.trials else "on another rank"
    return (
        f"MicroBatchFinder: not even one sample of the train loader's batch fits the device (trials: {tried}). "
        "Reduce the memory per sample: activation checkpointing (Parallelize(activation_checkpointing=True)), bf16 "
        "(precision='bf16-mixed', or accel-train precision=bf16_mixed), a model-parallel strategy "
        "(ModelParallelStrategy, PipelineStrategy), or shorter sequences; or lower `memory_fraction` only if it is "
        "the margin that rules one sample out."
    )


def _check_trainer(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
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
