"""MicroBatchFinder: every batch runs as the largest micro-batches that fit, sized on the first real steps of training
and halved on out-of-memory (the hook over `lightning_accel.tuning.micro_batch_search`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel import _lightning
from lightning_accel.batches import loader_batch_size, samples_in
from lightning_accel.callbacks._micro_batch_steps import (
    PiecesClosure,
    agree_min,
    any_rank,
    check_trainer,
    group_rank_zero,
    no_sync,
    piece_output,
    skip_backward,
)
from lightning_accel.callbacks._micro_batch_watch import ModuleWatch, state_names
from lightning_accel.errors import ConfigError, LightningAccelWarning
from lightning_accel.tuning.micro_batch_search import (
    MicroBatchTooLargeError,
    Trial,
    average_gradients,
    backward_in_pieces,
    micro_batch_for_budget,
    optimizer_state_bytes,
)

__all__ = ["MicroBatchFinder"]


class MicroBatchFinder(Callback):
    """Run each training batch as micro-batches that fit the device, inside its optimizer step: Lightning's
    `accumulate_grad_batches="auto"` (its issue #17393), for a plain `Trainer` on one device or under DDP.

    There are no trial steps. With `micro_batch_size="auto"` the first batch of training runs whole, as a real step
    whose work is kept. An out-of-memory error in it splits it (the recovery below: half the size until it fits), and
    on CUDA its peak memory, measured against `memory_fraction` of the memory this process can use (less room for the
    optimizer's state before its first step), sets the size of the next batch: estimated from the peak per sample,
    measured again, until a batch's peak is within the budget. Under DDP every rank takes the smallest rank's size.
    On a CPU (no peak to measure) a batch that does not run out of memory stays whole: `auto` then changes nothing.
    With `micro_batch_size=k`, every batch runs in pieces of k. Each piece's mean loss is weighted by its share of the
    samples, its backward accumulates, and the optimizer steps once per batch.

    During training, an out-of-memory error inside a step (a long sequence, a fragmented allocator) puts the
    gradients back as they were before the batch, frees what the attempt held and runs the batch again in pieces of
    half the size, once per error; after `grow_after` clean batches it tries twice the size again, up to the size
    found. Under DDP an out-of-memory error on one rank makes every rank redo the batch at the smaller size (one
    all-reduce of a byte per attempt), the gradients are averaged once per optimizer step (the pieces run past DDP's
    forward, under `no_sync`), and buffers are broadcast from rank zero then.

    Keeps identical:
        The loader, its samples and order; the optimizer steps per epoch (Lightning's `estimated_stepping_batches`,
        `estimated_optimizer_steps`) and the LR schedules sized by them; the global batch of
        `accumulate_grad_batches` or `AccumulationScheduler(global_batch_size=...)`, whose every micro-batch this
        splits further. A batch that runs whole (`auto` on a CPU, or `micro_batch_size` >= the batch) runs exactly
        as without the callback: one `training_step` call per batch. A split batch gets the update of the whole
        batch (within floating-point rounding) where the loss is a mean over samples that do not see each other:
        no layer taking statistics over the batch in train mode, no state carried from one piece to the next, and no
        random draws in the step.

    Changes on purpose:
        A batch split into pieces of k runs `training_step` once per piece, with the batch's `batch_idx`: steps x
        ceil(batch / k) calls, and not one more. Whatever a step does besides its loss (a counter, an environment step,
        a Python random draw) happens once per piece, and a warning at the first split batch, before its optimizer step,
        names the module's attributes that its first two pieces changed; random draws (dropout masks) are drawn per
        piece, from the same distribution. On-step logs show the last piece's values; on-epoch means are weighted by
        each piece's samples. The backward hooks (`on_before_backward`, `on_after_backward`) run once per batch, after
        its pieces, with the batch's loss. An out-of-memory error runs the batch's pieces again at half the size (the
        pieces before the error run twice). Under DDP the gradient all-reduce runs once after the backward, buffers are
        broadcast once per optimizer step, and a DDP communication hook is not used (a warning says so).

    Cannot serve:
        Manual optimization, a `training_step` that takes `dataloader_iter`, a strategy other than one device or DDP,
        and Lightning's `BatchSizeFinder` in the same run: a `ConfigError` at setup. A module that keeps tensors sized
        by its batch on itself between `training_step` calls (an RNN's hidden state, as Lightning's
        `demos.lstm.LightningLSTM` does): a split batch would hand one piece's state to the next, so the first piece of
        the first split batch ends in a `ConfigError` naming the attribute, before that batch's optimizer step (served
        as it is while its batches run whole). Such state is what the step set as attributes of the module or its
        submodules, alone or in a tuple or dict, with the piece's size along their first or second dimension; a tensor
        kept only to look at (the last batch) counts too, a list of collected outputs does not. Layers that take
        statistics over the batch in train mode (BatchNorm, SyncBatchNorm, InstanceNorm tracking running statistics)
        normalise each piece by its own statistics, as gradient accumulation does: a warning names them at the first
        split batch, before its optimizer step (GroupNorm or LayerNorm keep the whole batch's update). Under DDP, a
        `training_step` that runs collectives of its own (SyncBatchNorm, an all-gather): a rank out of memory would
        leave them unmatched; a warning names SyncBatchNorm layers at the start of training.

    Args:
        micro_batch_size: "auto" (sized on the first batches of training) or the micro-batch to run (no sizing).
        memory_fraction: on CUDA, the share of the memory this process can use (free + what its allocator holds)
            that a step's peak may reach; the rest is the margin for fragmentation and data-dependent batches.
        grow_after: clean batches after a recovery before trying twice the micro-batch again (never above the size
            found); None: keep the smaller size.

    Raises:
        ConfigError: for a bad option, manual optimization, a strategy other than one device or DDP (FSDP, model
            parallel, pipeline and DeepSpeed split their own work), Lightning's `BatchSizeFinder` in the same run, or
            batch-sized state on the module when a batch is split.
        MicroBatchTooLargeError: (at the first batch, or at the step that needs it) when one sample does not fit;
            the message names the sizes tried and the fixes.

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
        self.sizing: list[Trial] = []
        """The sizes the sizing batches of this fit ran, in order: out of memory, over the budget, or fitted (with
        their peaks on CUDA). Empty when given a size or resumed."""
        self.batch_size: int | None = None
        """The train loader's batch size the micro-batch divides (the first batch's samples when the loader does not
        say)."""
        self.found: int | None = None
        """The micro-batch the sizing settled on (the ceiling for growing back); None while sizing."""
        self.size: int | None = None
        """The micro-batch the next batch starts from; None before the first batch of `auto` (the whole batch)."""
        self.oom_recoveries = 0
        """Out-of-memory errors survived during training, after the sizing (every rank counts each one)."""
        self._sizing = False  # auto: the next batch still sizes the micro-batch
        self._clean = 0  # clean batches since the last recovery
        self._last_size: int | None = None  # the micro-batch the last batch ran
        self._resumed = False  # the state came from a checkpoint
        self._watch = ModuleWatch()
        self._restore = ExitStack()

    # -- set-up ---------------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        check_trainer(trainer, pl_module)
        self._restore.close()
        automatic = trainer.fit_loop.epoch_loop.automatic_optimization

        why = "MicroBatchFinder (remove it to train whole batches)"

        def make_closure(kwargs: OrderedDict, optimizer: torch.optim.Optimizer, batch_idx: int) -> Closure:
            backward, zero_grad = _lightning.closure_step_fns(automatic, batch_idx, optimizer, why)
            return PiecesClosure(self._run_batch, trainer, kwargs, optimizer, backward, zero_grad)

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
        self._watch = ModuleWatch()
        if trainer.world_size > 1:
            synced = [n for n, m in pl_module.named_modules() if isinstance(m, torch.nn.SyncBatchNorm)]
            if synced:
                rank_zero_warn(
                    f"MicroBatchFinder: SyncBatchNorm layers ({', '.join(f'`{n}`' for n in synced)}) all-gather "
                    "inside `training_step`; an out-of-memory error on one rank would leave that collective "
                    "unmatched (a hang). Use BatchNorm (per-rank statistics) or GroupNorm, or remove MicroBatchFinder.",
                    category=LightningAccelWarning,
                )
        batch_size = loader_batch_size(trainer.train_dataloader)
        resumed, self._resumed = self._resumed, False
        if resumed and self.size and self.found and batch_size in (None, self.batch_size):
            self._sizing = False
            rank_zero_info(
                f"MicroBatchFinder: resumed at micro-batch {self.size} of {self.batch_size} "
                f"({self.oom_recoveries} out-of-memory recoveries so far)."
            )
            return
        self.batch_size, self.sizing = batch_size, []
        self.oom_recoveries = self._clean = 0
        if self.micro_batch_size == "auto":
            self.found = self.size = None
            self._sizing = True
            return
        self._sizing = False
        self.found = self.size = (
            int(self.micro_batch_size) if batch_size is None else min(self.micro_batch_size, batch_size)
        )
        of = "" if batch_size is None else f" of the loader's {batch_size} ({-(-batch_size // self.size)} per batch)"
        rank_zero_info(f"MicroBatchFinder: micro-batch {self.size}{of}, given.")

    # -- training -------------------------------------------------------------------------------------------------

    def _run_batch(self, trainer: pl.Trainer, kwargs: OrderedDict, optimizer: Any, backward: Callable | None) -> Any:
        """One batch in micro-batches; returns Lightning's ClosureResult with the batch's (normalised) loss."""
        pl_module = trainer.lightning_module
        params = [p for p in pl_module.parameters() if p.requires_grad]
        extra: dict[str, Any] = {}

        results = _lightning.logged_results(trainer)
        whole = kwargs["batch"]
        n = samples_in(whole, default=1)
        if self.batch_size is None:
            self.batch_size = n
        sizing = self._sizing
        meter = _cuda_meter(trainer, pl_module, params, self.memory_fraction) if sizing else None
        attempts: list[int] = []

        def on_attempt(size: int) -> None:
            attempts.append(size)
            if meter is not None:
                meter.reset()

        def loss_fn(part: Any) -> torch.Tensor | None:
            extra.clear()  # the last piece's outputs (a failed attempt's among them) go before the next forward
            if results is not None:  # self.log weighs on-epoch means by this piece's samples, not the batch's
                results.batch, results.batch_size = part, None
            k = samples_in(part, default=1)
            before = self._watch.before_step(self.micro_batch_size, pl_module, k, n)
            output = piece_output(trainer, OrderedDict(kwargs, batch=part))
            if before is not None:
                self._watch.after_step(self.micro_batch_size, pl_module, before, k, n)
            self._watch.after_piece(pl_module, k, n)
            result = ClosureResult.from_training_step_output(output, trainer.accumulate_grad_batches)
            extra.update(result.extra)
            return result.closure_loss

        def piece_backward(loss: torch.Tensor) -> None:
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            trainer.precision_plugin.backward(scaler.scale(loss) if scaler is not None else loss, pl_module, optimizer)

        model = trainer.strategy.model
        group = getattr(model, "process_group", None)
        distributed = trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()
        agree = (lambda oom: any_rank(oom, pl_module.device, group)) if distributed else None
        sync = bool(getattr(model, "require_backward_grad_sync", False))  # the window ends with this batch
        try:
            with no_sync(trainer):
                step = backward_in_pieces(
                    loss_fn,
                    whole,
                    params,
                    piece=self.size or n,
                    agree=agree,
                    backward=piece_backward if backward is not None else skip_backward,
                    on_attempt=on_attempt,
                )
        except MicroBatchTooLargeError as err:
            if not sizing:
                raise
            raise MicroBatchTooLargeError(_too_large_message(attempts, n)) from err
        finally:
            if results is not None:
                results.batch, results.batch_size = whole, None
        if distributed and sync and backward is not None:
            average_gradients(params, group)
            if getattr(model, "broadcast_buffers", False):  # what DDP's forward did: rank zero's buffers everywhere
                for buffer in pl_module.buffers():
                    torch.distributed.broadcast(buffer, src=group_rank_zero(group), group=group)
        if sizing:
            self._sized(trainer, step.piece, attempts, meter, n)
        else:
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

    def _sized(self, trainer: pl.Trainer, piece: int, attempts: list[int], meter: _Meter | None, n: int) -> None:
        """After a sizing batch: the size the next batch runs; the sizing ends when every rank's batch fitted."""
        assert self.batch_size is not None, "set by the batch"
        self.sizing += [Trial(size, fits=False, reason="out of memory") for size in attempts[:-1]]
        proposal = piece
        if meter is None:
            self.sizing.append(Trial(piece, fits=True))
        else:
            peak = meter.peak()
            fits = peak <= meter.budget
            reason = "" if fits else f"peak {_mib(peak)} over the budget of {_mib(meter.budget)}"
            self.sizing.append(Trial(piece, fits=fits, peak_bytes=peak, reason=reason))
            if not fits and piece >= n and self._watch.state:
                rank_zero_warn(
                    f"MicroBatchFinder: the batch of {n} peaked at {_mib(peak)}, over `memory_fraction="
                    f"{self.memory_fraction}` ({_mib(meter.budget)}), but the module keeps batch-sized state "
                    f"({state_names(self._watch.state)}), so its batches stay whole. Lower the loader's batch size to "
                    "keep the margin.",
                    category=LightningAccelWarning,
                )
            elif not fits:
                proposal = micro_batch_for_budget(
                    self.batch_size, piece, peak_bytes=peak, base_bytes=meter.base, budget_bytes=meter.budget
                )
        agreed = agree_min(trainer, proposal)
        self._last_size, self.size = piece, agreed
        if agreed == piece:  # every rank's batch fitted at this size
            self.found, self._sizing = piece, False
            pieces = -(-self.batch_size // piece)
            rank_zero_info(
                f"MicroBatchFinder: micro-batch {piece} of the loader's {self.batch_size} ({pieces} per batch), sized "
                f"on the first batch(es) of training: {_sizing_text(self.sizing)}."
            )

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


@dataclass
class _Meter:
    """A sizing step's device memory on CUDA: what it held before its first forward plus the gradients it allocates
    (memory that does not grow with the micro-batch), and the most its peak may reach."""

    device: torch.device
    grad_bytes: int
    budget: int
    base: int = 0

    def reset(self) -> None:
        """Before an attempt: the peak counter restarts, and the base is what the device holds now."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = int(torch.cuda.memory_allocated(self.device)) + self.grad_bytes

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))


def _cuda_meter(
    trainer: pl.Trainer, pl_module: pl.LightningModule, params: list[torch.nn.Parameter], memory_fraction: float
) -> _Meter | None:
    """The meter of a sizing step on CUDA (None on another device): the budget is `memory_fraction` of the free
    memory plus what this process's allocator holds (capped by `set_per_process_memory_fraction`), less the state
    an optimizer that has not stepped yet will allocate."""
    device = pl_module.device
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    room = free + torch.cuda.memory_reserved(device)
    capped = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.6
    if capped is not None:
        room = min(room, int(capped(device) * total))
    pending = sum(optimizer_state_bytes(o) for o in trainer.optimizers if not o.state)
    grads = sum(p.numel() * p.element_size() for p in params)
    return _Meter(device, grad_bytes=grads, budget=int(memory_fraction * room) - pending)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def _sizing_text(trials: list[Trial]) -> str:
    def one(trial: Trial) -> str:
        peak = "" if trial.peak_bytes is None else f" ({_mib(trial.peak_bytes)})"
        return f"{trial.size} {'fits' if trial.fits else trial.reason}{peak if trial.fits else ''}"

    return ", ".join(one(t) for t in trials)


def _too_large_message(attempts: list[int], n: int) -> str:
    return (
        f"MicroBatchFinder: not even one sample of the batch of {n} fits the device (out of memory at micro-batches "
        f"{', '.join(map(str, attempts))}). Reduce the memory per sample: activation checkpointing "
        "(Parallelize(activation_checkpointing=True)), bf16 (precision='bf16-mixed', or accel-train "
        "precision=bf16_mixed), a model-parallel strategy (ModelParallelStrategy, PipelineStrategy), or shorter "
        "sequences."
    )
