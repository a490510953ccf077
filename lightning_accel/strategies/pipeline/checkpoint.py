"""Pipeline checkpoints: directories of per-stage slices (torch.distributed.checkpoint), saved, loaded safely and
consolidated into the plain model's state dict."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_accel import _lightning
from lightning_accel.errors import ConfigError
from lightning_accel.files import PathLike
from lightning_accel.strategies.checkpoint_io import (
    atomic_torch_save,
    recover_directory,
    remove_stale_staging,
    replace_directory,
    staging_path,
)
from lightning_accel.strategies.dcp_checks import check_distributed_checkpoint, load_metadata

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy

__all__ = [
    "consolidate_checkpoint",
    "load_pipeline_checkpoint",
    "model_state_dict",
    "optimizer_state_dict",
    "save_pipeline_checkpoint",
]


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)


def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """This rank's slice of the model's state, under the plain model's names, on the CPU."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options())


def optimizer_state_dict(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer state keyed by parameter name, flattened, so stages' entries do not collide."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optimizer = getattr(optimizer, "_optimizer", optimizer)
    return get_optimizer_state_dict(model, optimizer, options=_options())


def save_pipeline_checkpoint(strategy: ParallelStrategy, checkpoint: dict[str, Any], filepath: PathLike) -> None:
    """Every rank writes its shards of `checkpoint` into the directory `filepath`; rank 0 the rest (`meta.pt`).

    Written beside its target under a temporary name, then renamed over it: a save that dies (SIGKILL, a full disk)
    leaves the previous checkpoint whole, and no stale shards of an earlier save mix in (last.ckpt).
    """
    import torch.distributed.checkpoint as dcp

    path = Path(strategy.broadcast(filepath))
    staging = Path(strategy.broadcast(staging_path(path)))
    if strategy.global_rank == 0:
        recover_directory(path)  # a save killed mid-swap on a file system without an atomic exchange
        remove_stale_staging(path)  # shards of saves that were killed before they completed
        staging.mkdir(parents=True)
    strategy.barrier()
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    dcp.save(state, checkpoint_id=staging)
    if strategy.global_rank == 0:
        torch.save(checkpoint, staging / _lightning.distributed_checkpoint_metadata_name())
    strategy.barrier()  # every rank's shards are complete
    if strategy.global_rank == 0:
        replace_directory(staging, path)
    strategy.barrier()


def load_pipeline_checkpoint(
    strategy: ParallelStrategy, model: nn.Module, path: PathLike, weights_only: bool | None = None
) -> dict[str, Any]:
    """Load this rank's slice of the model and of each of `strategy.optimizers` in place; return the metadata.

    Raises:
        ConfigError: for a path that is no checkpoint directory, or metadata (or a distributed checkpoint index)
            holding more than tensors and plain types, unless `weights_only=False`.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    path = Path(strategy.broadcast(path))
    if strategy.global_rank == 0:
        recover_directory(path)
    strategy.barrier()
    if not path.is_dir():
        raise ConfigError(f"`ckpt_path={str(path)!r}` is not a PipelineStrategy checkpoint directory.")
    if weights_only is not False:  # the caller's explicit trust skips the checks
        check_distributed_checkpoint(path)  # the index, every shard's non-tensor items, meta.pt: before any state
    meta = load_metadata(path / _lightning.distributed_checkpoint_metadata_name(), weights_only)
    state: dict[str, Any] = {"state_dict": model_state_dict(model)}
    optimizers = [getattr(o, "_optimizer", o) for o in strategy.optimizers]
    for i, optimizer in enumerate(optimizers):
        state[f"optimizer_{i}"] = optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["state_dict"], options=_options())
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, state[f"optimizer_{i}"], options=_options())
    return meta


def consolidate_checkpoint(path: str | Path, out: str | Path | None = None) -> dict[str, torch.Tensor]:
    """The plain model's state dict from a `PipelineStrategy` checkpoint directory (every stage's slice joined).

    Args:
        path: the checkpoint directory a `PipelineStrategy` run saved (e.g. `.../checkpoints/last.ckpt`).
        out: when given, also write `{"state_dict": ...}` there with `torch.save`, loadable by
            `LightningModule.load_from_checkpoint`'s weights or `model.load_state_dict(torch.load(out)["state_dict"])`.

    Returns:
        Parameter name -> full tensor, the names of the plain (unsplit) model.

    Raises:
        ConfigError: for a path that is no distributed checkpoint, or metadata that holds more than tensors and plain
            types (`load_metadata`).
    """

    path = Path(path)
    if not (path / ".metadata").is_file():
        raise ConfigError(
            f"{str(path)!r} is not a distributed checkpoint directory (no .metadata); pass the "
            "directory a PipelineStrategy run saved."
        )
    check_distributed_checkpoint(path)  # before torch unpickles the index and the shards' non-tensor items
    meta = (
        load_metadata(path / _lightning.distributed_checkpoint_metadata_name())
        if (path / _lightning.distributed_checkpoint_metadata_name()).is_file()
        else {}
    )
    state: dict[str, Any] = _lightning.load_distributed_checkpoint(path)
    model_state = {k: v for k, v in state["state_dict"].items() if isinstance(v, torch.Tensor)}
    if out is not None:
        extra = {k: meta[k] for k in ("hyper_parameters", "epoch", "global_step") if k in meta}
        atomic_torch_save({"state_dict": model_state, **extra}, out)
    return model_state
