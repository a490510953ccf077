"""Tensor parallelism from a plan of module-name patterns and style names (DTensor's Colwise/Rowwise/Sequence)."""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from lightning_accel.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["TP_STYLES", "apply_tensor_parallel", "replicate_unplanned", "resolve_tp_plan"]

TP_STYLES = {
    "colwise": "ColwiseParallel",  # nn.Linear/nn.Embedding: output features split; input replicated
    "rowwise": "RowwiseParallel",  # nn.Linear/nn.Embedding: input features split; output all-reduced (replicated)
    "sequence": "SequenceParallel",  # norms and dropout on activations split along the sequence dimension
}
"""The style names a plan may use, and the `torch.distributed.tensor.parallel` class each one builds."""

_STYLE_MODULES = {"colwise": (nn.Linear, nn.Embedding), "rowwise": (nn.Linear, nn.Embedding)}


def _style(pattern: str, style: str | ParallelStyle) -> ParallelStyle:
    from torch.distributed.tensor import parallel

    if not isinstance(style, str):
        if not isinstance(style, parallel.ParallelStyle):
            raise ConfigError(
                f"`tp_plan[{pattern!r}]={style!r}` is neither a style name ({', '.join(TP_STYLES)}) nor a "
                "torch.distributed.tensor.parallel.ParallelStyle."
            )
        return style
    if style not in TP_STYLES:
        raise ConfigError(
            f"`tp_plan[{pattern!r}]={style!r}` is not a tensor-parallel style; use one of "
            f"{', '.join(repr(s) for s in TP_STYLES)}."
        )
    return getattr(parallel, TP_STYLES[style])()


def resolve_tp_plan(module: nn.Module, plan: Mapping[str, str | ParallelStyle]) -> dict[str, ParallelStyle]:
    """Expand a plan of name patterns into `{submodule name: ParallelStyle}`.

    A pattern is matched against the dotted names of `module.named_modules()` with shell-style wildcards (`*` also
    crosses dots): `"*.attn.q_proj"` or `"blocks.*.mlp.fc"`.

    Raises:
        ConfigError: for a pattern that matches no submodule (the message lists similar names), a submodule matched
            by two patterns, an unknown style, or a "colwise"/"rowwise" style on a module that is not a Linear or
            Embedding.
    """
    names = {name: sub for name, sub in module.named_modules() if name}
    resolved: dict[str, ParallelStyle] = {}
    matched_by: dict[str, str] = {}
    for pattern, style in plan.items():
        hits = [name for name in names if fnmatchcase(name, pattern)]
        if not hits:
            leaf = pattern.rsplit(".", 1)[-1].replace("*", "")
            similar = [name for name in names if leaf and leaf in name.rsplit(".", 1)[-1]] or list(names)
            raise ConfigError(
                f"`tp_plan` pattern {pattern!r} matches no submodule of {type(module).__name__}; submodules are named "
                f"like {similar[:8]}. Patterns use shell wildcards over dotted names, e.g. '*.attn.q_proj'."
            )
        for name in hits:
            if name in matched_by:
                raise ConfigError(
                    f"`tp_plan` patterns {matched_by[name]!r} and {pattern!r} both match {name!r}; "
                    "make them match disjoint modules."
                )
            allowed = _STYLE_MODULES.get(style) if isinstance(style, str) else None
            if allowed is not None and not isinstance(names[name], allowed):
                raise ConfigError(
                    f"`tp_plan[{pattern!r}]={style!r}` matches {name!r}, a {type(names[name]).__name__}; "
                    f"{style!r} shards nn.Linear and nn.Embedding only. Point the pattern at the linear layers."
                )
            matched_by[name] = pattern
            resolved[name] = _style(pattern, style)
    return resolved


def apply_tensor_parallel(
    module: nn.Module, mesh: DeviceMesh, plan: Mapping[str, str | ParallelStyle], *, replicate_rest: bool = True
) -> dict[str, ParallelStyle]:
    """Shard the submodules a plan names over a 1-D tensor-parallel mesh (DTensor `parallelize_module`).

    The usual plan for a transformer block: "colwise" on the query, key, value and first MLP projections, "rowwise"
    on the attention output and second MLP projections. Each rank then holds `n_head / tp` heads and a slice of the
    MLP; the rowwise layers all-reduce their outputs, so activations between blocks are whole on every rank. The
    model's forward must take sizes from the (local) tensors, not from its config (see examples/gpt.py).

    Args:
        module: the model.
        mesh: the 1-D tensor-parallel mesh (Lightning's `device_mesh["tensor_parallel"]`).
        plan: `{pattern: style}`; see `resolve_tp_plan`. A style is "colwise", "rowwise", "sequence" or a
            `ParallelStyle` object (for custom layouts, e.g. `RowwiseParallel(output_layouts=Shard(1))`).
        replicate_rest: make the parameters outside the plan replicated DTensors too (`replicate_unplanned`), so
            gradient clipping, foreach optimizers and FSDP2 see one kind of parameter.

    Returns:
        The plan as applied, `{submodule name: ParallelStyle}`.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    resolved = resolve_tp_plan(module, plan)
    if resolved:
        parallelize_module(module, mesh, resolved)
        if replicate_rest:
            replicate_unplanned(module, mesh)
    return resolved


def replicate_unplanned(module: nn.Module, mesh: DeviceMesh) -> list[str]:
    """Turn the plain parameters (and their modules' buffers) left after a plan into DTensors replicated over `mesh`.

    `clip_grad_norm_` and the foreach optimizers refuse a mix of DTensor and plain tensors. Each module holding such
    parameters (embeddings, norms, an unsharded head) gets hooks that make its tensor inputs replicated DTensors and
    its outputs plain again, so the rest of the model runs as before; its gradients stay local, which is right because
    every tensor-parallel rank computes the same values there. Parameters shared between modules stay shared.

    Returns:
        The names of the modules converted.
    """
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    placements = [Replicate()] * mesh.ndim
    converted: dict[int, nn.Parameter] = {}
    names = []
    for name, sub in module.named_modules():
        plain = {key: p for key, p in sub._parameters.items() if p is not None and not isinstance(p, DTensor)}
        if not plain:
            continue
        for key, param in plain.items():
            if id(param) not in converted:
                replicated = distribute_tensor(param.data, mesh, placements)
                converted[id(param)] = nn.Parameter(replicated, requires_grad=param.requires_grad)
            sub.register_parameter(key, converted[id(param)])
        for key, buffer in sub._buffers.items():
            if buffer is not None and not isinstance(buffer, DTensor):
                sub._buffers[key] = distribute_tensor(buffer, mesh, placements)
        sub.register_forward_pre_hook(_inputs_to_replicated(mesh))
        sub.register_forward_hook(_outputs_to_local)
        names.append(name)
    return names


def _inputs_to_replicated(mesh: DeviceMesh) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    placements = [Replicate()] * mesh.ndim

    def hook(module: nn.Module, inputs: Any) -> Any:
        def convert(t: torch.Tensor) -> torch.Tensor:
            return t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, placements, run_check=False)

        return tree_map_only(torch.Tensor, convert, inputs)

    return hook


def _outputs_to_local(module: nn.Module, inputs: Any, outputs: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return tree_map_only(DTensor, lambda t: t.to_local(), outputs)
