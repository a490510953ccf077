"""FSDP2, tensor-parallel, activation-checkpointing and compile helpers that parallelize a model block by block.

Pure functions with typed keyword arguments, for a `configure_model` of your own; the
`lightning_accel.callbacks.parallelize.Parallelize` callback applies them from config instead.
"""

from __future__ import annotations

from lightning_accel.parallel.apply_plan import AppliedPlan, is_parallelized, parallelize
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
