"""One call that applies a whole parallel plan in torchtitan's order: tensor parallel, checkpointing, compile, FSDP2."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_accel.parallel.blocks import (
    BlockClass,
    checkpoint_blocks,
    compile_blocks,
    find_blocks,
    fsdp_modules,
    fully_shard_blocks,
)
from lightning_accel.parallel.tensor_parallel import apply_tensor_parallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["AppliedPlan", "is_parallelized", "parallelize"]


@dataclass(kw_only=True, slots=True)
class AppliedPlan:
    """What `parallelize` did to a model, for logs and tests."""

    tensor_parallel: dict[str, str] = field(default_factory=dict)
    """`{submodule name: style class name}` of the tensor-parallel plan applied; empty without one."""
    checkpointed: list[str] = field(default_factory=list)
    """Blocks whose activations are recomputed in backward."""
    compiled: list[str] = field(default_factory=list)
    """Blocks whose forward is compiled."""
    sharded: list[str] = field(default_factory=list)
    """Blocks sharded as FSDP2 units (the root is sharded too whenever `fsdp` is True)."""
    fsdp: bool = False
    """Whether FSDP2 was applied (a data-parallel mesh of two or more ranks)."""

    def describe(self) -> str:
        """One line: `tp=6 modules, ac=2 blocks, compile=0 blocks, fsdp=2 blocks + root`."""
        fsdp = f"{len(self.sharded)} blocks + root" if self.fsdp else "off"
        return (
            f"tp={len(self.tensor_parallel)} modules, ac={len(self.checkpointed)} blocks, "
            f"compile={len(self.compiled)} blocks, fsdp={fsdp}"
        )


def is_parallelized(module: nn.Module) -> bool:
    """Whether `module` already holds FSDP2 units or DTensor parameters (it was sharded by someone)."""
    from torch.distributed.tensor import DTensor

    return bool(fsdp_modules(module)) or any(isinstance(p, DTensor) for p in module.parameters())


def parallelize(
    module: nn.Module,
    *,
    block_classes: Sequence[BlockClass] = (),
    dp_mesh: DeviceMesh | None = None,
    tp_mesh: DeviceMesh | None = None,
    tp_plan: Mapping[str, str | ParallelStyle] | None = None,
    activation_checkpointing: bool = False,
    compile: bool = False,
    compile_kwargs: Mapping[str, Any] | None = None,
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> AppliedPlan:
    """Apply tensor parallelism, activation checkpointing, `torch.compile` and FSDP2 to `module`, block by block.

    The order is torchtitan's: the tensor-parallel plan first (on the full modules), then checkpointing and compile
    of each block, then FSDP2 per block and at the root, so FSDP shards the (possibly 2-D) DTensor parameters and its
    hooks stay outside checkpointed and compiled code. Each step is skipped when it has nothing to do: tensor
    parallelism without a mesh of two or more ranks or without a plan, FSDP2 without a data-parallel mesh of two or
    more ranks. Call it from `configure_model`, or let the `Parallelize` callback do so.

    Args:
        module: the model.
        block_classes: the class(es) of its repeated blocks; see `find_blocks`.
        dp_mesh: the data-parallel mesh for FSDP2 (Lightning's `device_mesh["data_parallel"]`).
        tp_mesh: the tensor-parallel mesh (Lightning's `device_mesh["tensor_parallel"]`).
        tp_plan: `{module-name pattern: style}`; see `apply_tensor_parallel`.
        activation_checkpointing: recompute each block's activations in backward.
        compile: `torch.compile` each block's forward.
        compile_kwargs: keyword arguments for `torch.compile`.
        reshard_after_forward: see `fully_shard_blocks`.
        mp_policy: see `fully_shard_blocks`.

    Returns:
        What was applied.

    Raises:
        ConfigError: for names that match nothing (see `find_blocks`, `resolve_tp_plan`), checkpointing or compile
            without `block_classes`, or a tensor-parallel mesh of two or more ranks without a plan (every rank would
            compute the same thing).
    """
    from lightning_accel.errors import ConfigError

    applied = AppliedPlan()
    if (activation_checkpointing or compile) and not block_classes:
        raise ConfigError(
            f"`activation_checkpointing={activation_checkpointing}` and `compile={compile}` work block by block; name "
            "the block class in `block_classes`."
        )
    if block_classes:
        find_blocks(module, block_classes)  # check the names before anything changes
    tp_size = tp_mesh.size() if tp_mesh is not None else 1
    if tp_size > 1:
        if not tp_plan:
            raise ConfigError(
                f"The tensor-parallel mesh has {tp_size} ranks but `tp_plan` is empty, so every rank would compute "
                "the same thing; give a plan (e.g. {'*.attn.q_proj': 'colwise', ...}) or set "
                "`tensor_parallel_size=1`."
            )
        assert tp_mesh is not None
        resolved = apply_tensor_parallel(module, tp_mesh, tp_plan)
        applied.tensor_parallel = {name: type(style).__name__ for name, style in resolved.items()}
    if activation_checkpointing:
        applied.checkpointed = checkpoint_blocks(module, block_classes)
    if compile:
        applied.compiled = compile_blocks(module, block_classes, **dict(compile_kwargs or {}))
    if dp_mesh is not None and dp_mesh.size() > 1:
        applied.sharded = fully_shard_blocks(
            module, dp_mesh, block_classes, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy
        )
        applied.fsdp = True
    return applied
