"""Per-block FSDP2 sharding, activation checkpointing and torch.compile, with blocks chosen by class name."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_accel.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = [
    "COMPILE_MODES",
    "BlockClass",
    "BlockWrapPolicy",
    "block_wrap_policy",
    "checkpoint_blocks",
    "compile_blocks",
    "find_blocks",
    "fsdp_modules",
    "fully_shard_blocks",
    "mixed_precision_policy",
]

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""`torch.compile(mode=...)` values (None: torch's default), for `Compile` and `Parallelize`."""

BlockClass = str | type[nn.Module]
"""A block class: the class itself, its name (`"Block"`) or its qualified name (`"my_pkg.model.Block"`)."""

_CHECKPOINTED = "_lightning_accel_checkpointed"
_COMPILED = "_lightning_accel_compiled"


def _class_names(cls: type) -> set[str]:
    """The names a block class answers to: `Name` and `module.Name` for the class and every base class."""
    return {name for c in cls.__mro__ for name in (c.__name__, f"{c.__module__}.{c.__qualname__}")}


def _matches(module: nn.Module, block_class: BlockClass) -> bool:
    if isinstance(block_class, str):
        return block_class in _class_names(type(module))
    return isinstance(module, block_class)


def _own_class_names(module: nn.Module) -> list[str]:
    """The class names of `module`'s submodules, for error messages; FSDP2's `FSDP<Name>` subclasses are skipped."""
    names = {type(m).__name__ for _, m in module.named_modules() if m is not module}
    return sorted(n for n in names if not (n.startswith("FSDP") and n[4:] in names))


def find_blocks(module: nn.Module, block_classes: Sequence[BlockClass]) -> list[tuple[str, nn.Module]]:
    """The outermost submodules of `module` (not `module` itself) that are instances of any of `block_classes`.

    A block nested in another block is not returned: sharding, checkpointing or compiling the outer one covers it.

    Args:
        module: the model.
        block_classes: classes, or class names matched against each submodule's class and its base classes, either
            bare (`"Block"`) or qualified (`"lightning_accel.examples.gpt.Block"`).

    Returns:
        `(qualified name, submodule)` pairs in `named_modules()` order.

    Raises:
        ConfigError: when a block class matches no submodule; the message lists the submodule classes there are.
    """
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if sub is module or any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        if any(_matches(sub, block_class) for block_class in block_classes):
            found.append((name, sub))
    for block_class in block_classes:
        if not any(_matches(sub, block_class) for sub in module.modules() if sub is not module):
            shown = block_class if isinstance(block_class, str) else block_class.__qualname__
            raise ConfigError(
                f"`block_classes` entry {shown!r} matches no submodule of {type(module).__name__}; its submodule "
                f"classes are {_own_class_names(module)}. Name the class of the repeated block (e.g. a transformer "
                "layer)."
            )
    return found


class BlockWrapPolicy:
    """An FSDP1 `auto_wrap_policy` / `activation_checkpointing_policy` callable that picks blocks by class name.

    For Lightning's `FSDPStrategy`, which takes classes; this takes the names the `Parallelize` callback takes, so
    one `parallel_plan.block_classes` in config serves both strategies.
    """

    def __init__(self, block_classes: Sequence[BlockClass]) -> None:
        self.block_classes = list(block_classes)

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int = 0) -> bool:
        return recurse or any(_matches(module, block_class) for block_class in self.block_classes)

    def __repr__(self) -> str:
        return f"BlockWrapPolicy({self.block_classes!r})"


def block_wrap_policy(block_classes: Sequence[BlockClass] | None) -> BlockWrapPolicy | None:
    """A `BlockWrapPolicy` for `block_classes`, or None (no wrapping: the whole model is one unit) when empty."""
    return BlockWrapPolicy(block_classes) if block_classes else None


def checkpoint_blocks(module: nn.Module, block_classes: Sequence[BlockClass]) -> list[str]:
    """Recompute each block's activations in backward instead of storing them (non-reentrant activation checkpointing).

    The block's `forward` is wrapped in place, so parameter and state-dict names do not change (a checkpoint written
    with it loads without it and back). Blocks already checkpointed are left as they are.

    Returns:
        The names of the blocks wrapped by this call.
    """
    wrapped = []
    for name, block in find_blocks(module, block_classes):
        if getattr(block, _CHECKPOINTED, False):
            continue
        block.forward = _Recompute(block)
        setattr(block, _CHECKPOINTED, True)
        wrapped.append(name)
    return wrapped


class _ForwardWrapper:
    """Stands in for a module's `forward` on the instance, wrapping the one there was; picklable, unlike a closure."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.inner = module.__dict__.get("forward")  # a forward set on the instance before, else the class's

    def wrapped(self) -> Callable[..., Any]:
        return self.inner if self.inner is not None else partial(type(self.module).forward, self.module)


class _Recompute(_ForwardWrapper):
    """The block's forward under non-reentrant activation checkpointing."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.wrapped(), *args, use_reentrant=False, **kwargs)


class _Compiled(_ForwardWrapper):
    """The block's forward compiled by `torch.compile` on first call (the compiled code is not pickled)."""

    def __init__(self, module: nn.Module, compile_kwargs: dict[str, Any]) -> None:
        super().__init__(module)
        self.compile_kwargs = compile_kwargs
        self._compiled: Callable[..., Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            inner = self.wrapped()
            self._compiled = torch.compile(inner, **self.compile_kwargs)
        return self._compiled(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_compiled": None}


def compile_blocks(module: nn.Module, block_classes: Sequence[BlockClass], **compile_kwargs: Any) -> list[str]:
    """`torch.compile` each block's `forward` in place (after activation checkpointing, which it then includes).

    Compiling block by block keeps compile time to one block's graph (identical blocks reuse it) and leaves FSDP2's
    hooks outside the compiled code. Names do not change (no `_orig_mod.`), and the model still pickles (the compiled
    code is rebuilt on the first call after). Blocks already compiled are skipped.

    Args:
        module: the model.
        block_classes: as for `find_blocks`.
        compile_kwargs: passed to `torch.compile` (`mode`, `fullgraph`, `backend`, ...).

    Returns:
        The names of the blocks compiled by this call.
    """
    compiled = []
    for name, block in find_blocks(module, block_classes):
        if getattr(block, _COMPILED, False):
            continue
        block.forward = _Compiled(block, compile_kwargs)
        setattr(block, _COMPILED, True)
        compiled.append(name)
    return compiled


def mixed_precision_policy(param_dtype: str | None = None, reduce_dtype: str | None = None) -> MixedPrecisionPolicy:
    """FSDP2's `MixedPrecisionPolicy` from dtype names ("bfloat16", "float16", "float32"); None keeps the parameters'.

    Raises:
        ConfigError: for a name that is not a floating-point torch dtype.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtypes: dict[str, torch.dtype | None] = {}
    for setting, name in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        dtype = getattr(torch, name, None) if isinstance(name, str) else None
        if name is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ConfigError(
                f"`{setting}={name!r}` is not a floating-point torch dtype; use 'bfloat16', 'float16', "
                "'float32' or null."
            )
        dtypes[setting] = dtype
    return MixedPrecisionPolicy(param_dtype=dtypes["param_dtype"], reduce_dtype=dtypes["reduce_dtype"])


def fully_shard_blocks(
    module: nn.Module,
    mesh: DeviceMesh,
    block_classes: Sequence[BlockClass],
    *,
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> list[str]:
    """Shard each block with FSDP2 (`fully_shard`), then `module` itself for the parameters outside the blocks.

    Each block is one unit: its parameters are all-gathered just before its forward (and backward) and its
    gradients reduce-scattered in one collective. `module` becomes the root, whose forward must run every step (for
    a LightningModule: `training_step` calls `self(...)`). Call it after tensor parallelism, so blocks sharded over
    a tensor-parallel mesh become 2-D (data-parallel x tensor-parallel) DTensors.

    Args:
        module: the model (root unit).
        mesh: the 1-D data-parallel mesh (Lightning's `device_mesh["data_parallel"]`).
        block_classes: as for `find_blocks`; empty makes the whole model one unit.
        reshard_after_forward: free each block's gathered parameters after its forward (True: least memory) or keep
            them for the backward (False: no second all-gather); an int reshards to that smaller world size.
        mp_policy: FSDP2 mixed precision (see `mixed_precision_policy`); None keeps the parameters' dtype.

    Returns:
        The names of the sharded blocks.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    blocks = find_blocks(module, block_classes) if block_classes else []
    for _, block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)  # the root keeps its parameters for the backward
    return [name for name, _ in blocks]


def fsdp_modules(module: nn.Module) -> list[nn.Module]:
    """The FSDP2 (`fully_shard`) units within `module`, `module` included, which reduce-scatter on every backward."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6 keeps it under _composable
        from torch.distributed._composable.fsdp import FSDPModule
    return [sub for sub in module.modules() if isinstance(sub, FSDPModule)]
