"""Apply FSDP2, tensor parallelism, activation checkpointing and compile per block from config, not configure_model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel import _lightning
from lightning_accel.callbacks.accumulation import AccumulationScheduler
from lightning_accel.errors import ConfigError, LightningAccelWarning
from lightning_accel.parallel import BlockClass, fsdp_modules, is_parallelized, mixed_precision_policy, parallelize
from lightning_accel.parallel.blocks import COMPILE_MODES
from lightning_accel.patching import patch_attribute

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["Parallelize"]

_APPLIED = "_lightning_accel_parallelized"  # set on a module once its plan is applied: later stages skip it


class Parallelize(Callback):
    """Parallelize a LightningModule block by block from settings, without writing `configure_model`.

    Under `ModelParallelStrategy` it applies, in torchtitan's order, a tensor-parallel plan over the mesh's
    `tensor_parallel` dimension, activation checkpointing and `torch.compile` of each block, and FSDP2 on each block
    and the root over the `data_parallel` dimension (see `lightning_accel.parallel.parallelize`). It runs as the
    module's `configure_model` hook, so it happens once, on the model before optimizers are created and before a
    checkpoint is loaded. Under other strategies (one device, DDP) only checkpointing and compile apply.

    Under gradient accumulation FSDP2 reduce-scatters gradients after every micro-batch's backward by default; with
    `sync_grads_every_micro_batch=False` it does so only on the micro-batch that ends the window (fewer collectives,
    but each FSDP unit keeps unsharded gradients between micro-batches: more memory). `AccumulationScheduler`, when
    present, already does this, and this callback leaves the switching to it.

    Keeps identical: the math on one device or under DDP (activation checkpointing recomputes the same forward, with
        the same RNG; the zoo with no option set).
    Changes on purpose: under ModelParallelStrategy, where each parameter lives (FSDP2 shards, tensor-parallel
        slices) and so the order of floating-point sums.
    Cannot serve: a `tp_plan` for a module whose own `configure_model` already shards it (refused by name); without
        `block_classes` the whole model is one FSDP2 unit (served, with all parameters gathered at once).

    Logs:
        nothing.

    Args:
        block_classes: the class(es) of the model's repeated blocks, by class or name (`["Block"]`); each becomes
            an FSDP2 unit. None or empty: the whole model is one unit (simple, but all parameters are gathered at
            once).
        tp_plan: `{module-name pattern: style}`, style "colwise", "rowwise" or "sequence", e.g.
            `{"*.attn.q_proj": "colwise", "*.attn.out_proj": "rowwise"}`; needed when `tensor_parallel_size > 1`.
        activation_checkpointing: recompute each block's activations in backward (less memory, ~1/3 more compute).
        compile: `torch.compile` each block's forward.
        compile_mode: `torch.compile(mode=...)`: None, "default", "reduce-overhead", "max-autotune".
        reshard_after_forward: free each block's gathered parameters after its forward (all-gather again in
            backward); False keeps them (one all-gather fewer per block, more memory).
        sync_grads_every_micro_batch: reduce-scatter on every accumulation micro-batch (False: only on the last).
        param_dtype: FSDP2 mixed precision: dtype of the gathered parameters and the compute ("bfloat16"); None
            keeps the parameters' dtype.
        reduce_dtype: FSDP2 mixed precision: dtype of the gradient reduce-scatter; None follows `param_dtype`.

    Raises:
        ConfigError: for settings of the wrong type, checkpointing or compile without `block_classes`, names that
            match nothing in the model, a plan given to a module whose own `configure_model` already shards it.

    Example::

        trainer = Trainer(
            devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
            callbacks=[Parallelize(block_classes=["Block"], activation_checkpointing=True)],
        )
    """

    def __init__(
        self,
        block_classes: Sequence[BlockClass] | None = None,
        tp_plan: Mapping[str, str | ParallelStyle] | None = None,
        *,
        activation_checkpointing: bool = False,
        compile: bool = False,
        compile_mode: str | None = None,
        reshard_after_forward: bool = True,
        sync_grads_every_micro_batch: bool = False,
        param_dtype: str | None = None,
        reduce_dtype: str | None = None,
    ) -> None:
        if block_classes is None:
            block_classes = []
        elif isinstance(block_classes, (str, type)):
            block_classes = [block_classes]
        if not isinstance(block_classes, Sequence) or not all(isinstance(c, (str, type)) for c in block_classes):
            raise ConfigError(f"`block_classes={block_classes!r}` must be a list of classes or class names.")
        if tp_plan is not None and not isinstance(tp_plan, Mapping):
            raise ConfigError(f"`tp_plan={tp_plan!r}` must be a dict of {{module-name pattern: style}}.")
        flags = {
            "activation_checkpointing": activation_checkpointing,
            "compile": compile,
            "reshard_after_forward": reshard_after_forward,
            "sync_grads_every_micro_batch": sync_grads_every_micro_batch,
        }
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise ConfigError(f"`{name}={value!r}` must be true or false.")
        if (activation_checkpointing or compile) and not block_classes:
            raise ConfigError(
                "`activation_checkpointing` and `compile` work block by block; name the block class in "
                "`block_classes` (e.g. ['Block'])."
            )
        if compile_mode is not None and compile_mode not in COMPILE_MODES:
            raise ConfigError(
                f"`compile_mode={compile_mode!r}` is not a torch.compile mode; use one of {', '.join(COMPILE_MODES)} "
                "or None."
            )
        mixed_precision_policy(param_dtype, reduce_dtype)  # checks the names
        self.block_classes = list(block_classes)
        self.tp_plan = dict(tp_plan or {})
        self.activation_checkpointing = activation_checkpointing
        self.compile = compile
        self.compile_mode = compile_mode
        self.reshard_after_forward = reshard_after_forward
        self.sync_grads_every_micro_batch = sync_grads_every_micro_batch
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self._undo = ExitStack()  # the configure_model it installs; closed in teardown and on_exception
        self._fsdp_units: list[Any] = []  # FSDP2 units whose gradient sync this callback switches

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        own = type(pl_module).configure_model
        own_configure = own if own is not pl.LightningModule.configure_model else None

        def configure_model() -> None:  # a plain function, so Lightning sees the hook as overridden
            if own_configure is not None:
                own_configure(pl_module)
            self._apply(trainer, pl_module)

        self._undo.close()  # a second stage (test after fit) replaces the first one's hook
        self._undo.callback(patch_attribute(pl_module, "configure_model", configure_model, why="Parallelize"))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore(pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore(pl_module)  # Lightning skips teardown hooks after an exception

    def _restore(self, pl_module: pl.LightningModule) -> None:
        self._undo.close()
        for unit in self._fsdp_units:
            unit.set_requires_gradient_sync(True, recurse=False)
        self._fsdp_units = []

    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not getattr(pl_module, _APPLIED, False):  # else a later stage (test after fit) of a module done already
            self._apply_plan(trainer, pl_module)
            setattr(pl_module, _APPLIED, True)
        accumulation_owner = any(isinstance(cb, AccumulationScheduler) for cb in _lightning.trainer_callbacks(trainer))
        if accumulation_owner and self.sync_grads_every_micro_batch:
            rank_zero_warn(
                "Parallelize(sync_grads_every_micro_batch=True) has no effect next to AccumulationScheduler, which "
                "reduce-scatters only on the last micro-batch of each window.",
                category=LightningAccelWarning,
            )
        if not (accumulation_owner or self.sync_grads_every_micro_batch):
            self._fsdp_units = fsdp_modules(pl_module)

    def _apply_plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        name = type(pl_module).__name__
        if is_parallelized(pl_module):
            if self.block_classes or self.tp_plan:
                raise ConfigError(
                    f"{name}.configure_model already shards the model (it holds FSDP2 units or DTensor parameters) "
                    "and Parallelize was given a plan too; keep one: drop the Parallelize callback or remove the "
                    "sharding from configure_model."
                )
            rank_zero_info(f"Parallelize: {name} shards itself in configure_model; left as it is.")
        else:
            mesh = pl_module.device_mesh
            names = mesh.mesh_dim_names if mesh is not None else None
            dp_mesh = mesh["data_parallel"] if mesh is not None and names and "data_parallel" in names else None
            tp_mesh = mesh["tensor_parallel"] if mesh is not None and names and "tensor_parallel" in names else None
            if mesh is None and self.tp_plan:
                rank_zero_warn(
                    f"Parallelize: {type(trainer.strategy).__name__} has no device mesh, so the tensor-parallel "
                    "plan and FSDP2 are not applied (only checkpointing and compile are); use "
                    "lightning_accel.strategies.ModelParallelStrategy.",
                    category=LightningAccelWarning,
                )
            applied = parallelize(
                pl_module,
                block_classes=self.block_classes,
                dp_mesh=dp_mesh,
                tp_mesh=tp_mesh,
                tp_plan=self.tp_plan,
                activation_checkpointing=self.activation_checkpointing,
                compile=self.compile,
                compile_kwargs={"mode": self.compile_mode} if self.compile_mode else None,
                reshard_after_forward=self.reshard_after_forward,
                mp_policy=mixed_precision_policy(self.param_dtype, self.reduce_dtype),
            )
            rank_zero_info(f"Parallelize: {name}: {applied.describe()}")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._fsdp_units:
            return
        # Lightning has counted this batch as ready, so this says whether it ends an accumulation window.
        sync = trainer.accumulate_grad_batches == 1 or not _lightning.accumulating(trainer)
        for unit in self._fsdp_units:
            unit.set_requires_gradient_sync(sync, recurse=False)
