"""FSDP2, tensor-parallel, activation-checkpointing and compile helpers that parallelize a model block by block.

Pure functions with typed keyword arguments, for a `configure_model` of your own; the
`lightning_accel.callbacks.parallelize.Parallelize` callback applies them from config instead.
"""

from __future__ import annotations

from typing import Any

from lightning_accel.parallel.blocks import (
    BlockClass,
    BlockWrapPolicy,
    block_wrap_policy,
    checkpoint_blocks,
    compile_blocks,
    find_blocks,
    fsdp_modules,
    fully_shard_blocks,
    mixed_precision_policy,
)
from lightning_accel.parallel.plan import AppliedPlan, is_parallelized, parallelize
from lightning_accel.parallel.tensor_parallel import TP_STYLES, apply_tensor_parallel, resolve_tp_plan

__all__ = [
    "TP_STYLES",
    "AppliedPlan",
    "BlockClass",
    "BlockWrapPolicy",
    "apply_tensor_parallel",
    "block_wrap_policy",
    "checkpoint_blocks",
    "compile_blocks",
    "find_blocks",
    "fsdp_modules",
    "fully_shard_blocks",
    "is_parallelized",
    "mixed_precision_policy",
    "parallelize",
    "resolve_tp_plan",
]


def __getattr__(name: str) -> Any:
    """`lightning_accel.parallel.ModelParallelStrategy` moved to `lightning_accel.strategies` with every strategy; the
    old name (a `_target_` in configs written before 0.3) still resolves, with a DeprecationWarning."""
    if name == "ModelParallelStrategy":
        import warnings

        from lightning_accel.strategies.model_parallel import ModelParallelStrategy

        warnings.warn("`lightning_accel.parallel.ModelParallelStrategy` moved to "
                      "`lightning_accel.strategies.ModelParallelStrategy`; import it (or name it in `_target_`) from "
                      "there.", DeprecationWarning, stacklevel=2)  # fmt: skip
        return ModelParallelStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
