"""Distributed checkpoints (torch.distributed.checkpoint directories) checked before anything in them is unpickled.

torch reads a directory's `.metadata` index with plain `pickle.load`, and the non-tensor items of its `.distcp`
shards with `torch.load(weights_only=False)` (`DefaultLoadPlanner.load_bytes`): a planted payload in either runs on
resume, in `consolidate_checkpoint` and in `accel-train check=true`. `check_distributed_checkpoint` reads every one
of them first: the index with an allowlist of torch's own metadata classes, every non-tensor item (and `meta.pt`)
with `weights_only=True`. A directory that needs more is refused, naming the file, before any state is touched.
Tensor items are read by torch with `weights_only=True` already.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

from lightning_accel import _lightning
from lightning_accel.errors import ConfigError

__all__ = [
    "check_dcp_metadata",
    "check_distributed_checkpoint",
    "checkpoint_shapes",
    "load_metadata",
    "refused_object",
]

_DCP_MODULES = ("torch.distributed.checkpoint.",)
_PATH_CLASSES = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path")


def load_metadata(path: str | Path, weights_only: bool | None = None, mmap: bool = False) -> dict[str, Any]:
    """A checkpoint's pickled metadata (`meta.pt`, or a whole `torch.save` checkpoint), loaded with
    `weights_only=True` unless the caller passes `weights_only=False` for a file it trusts: a file that needs more than
    tensors and plain types is refused before anything in it runs.

    Raises:
        ConfigError: naming the file and what it holds that is not allowed, with the way out.
    """
    try:
        # on the CPU: checked before launch, every rank would otherwise put the state on cuda:0
        return torch.load(
            path, map_location="cpu", weights_only=True if weights_only is None else weights_only, mmap=mmap
        )
    except pickle.UnpicklingError as err:
        raise ConfigError(
            f"the checkpoint file {str(path)!r} holds more than tensors and plain types ({refused_object(err)}), so it "
            "is not loaded: loading it could run code. If you made this checkpoint and trust it, resume with "
            "`trainer.fit(..., weights_only=False)` (or register the class with "
            "`torch.serialization.add_safe_globals`)."
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as err:  # a zip that is not torch's, truncated
        detail = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no detail'}"
        raise ConfigError(
            f"the checkpoint file {str(path)!r} is not a readable torch checkpoint ({detail}): "
            "truncated, corrupt or another kind of archive; pass the run's `checkpoints/last.ckpt` or "
            "another checkpoint."
        ) from None


def refused_object(err: Exception) -> str:
    """What in a checkpoint torch's `weights_only` load refused, from its `UnpicklingError` (the `GLOBAL` line)."""
    lines = str(err).strip().splitlines()
    return next(
        (line.strip() for line in lines if "GLOBAL" in line or "Unsupported" in line),
        lines[0] if lines else "an object that is not a tensor or a plain type",
    )


def _allowed_in_dcp_metadata(module: str, name: str) -> bool:
    """What a distributed checkpoint's `.metadata` pickle may name: torch's checkpoint metadata classes, dtypes,
    layouts, memory formats, `torch.Size` and paths; nothing that runs code."""
    if module.startswith(_DCP_MODULES):
        import importlib

        value = getattr(importlib.import_module(module), name, None)
        return isinstance(value, type)  # classes (dataclasses, enums), not functions
    if module == "torch":
        value = getattr(torch, name, None)
        return value is torch.Size or isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
    return (module, name) == ("torch.serialization", "_get_layout") or (module == "pathlib" and name in _PATH_CLASSES)


def check_dcp_metadata(path: str | Path) -> list[Any]:
    """Unpickle every `*.metadata` file of a distributed checkpoint directory with an allowlist
    (`_allowed_in_dcp_metadata`); return what they hold (torch's `Metadata`).

    Raises:
        ConfigError: naming the file and the global it refused, or a file that is not a pickle.
    """

    class Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if not _allowed_in_dcp_metadata(module, name):
                raise pickle.UnpicklingError(f"Unsupported global: {module}.{name}")
            return super().find_class(module, name)

    found = []
    for file in sorted(Path(path).glob("*.metadata")) + sorted(Path(path).glob(".metadata")):
        try:
            with file.open("rb") as handle:
                found.append(Restricted(handle).load())
        except pickle.UnpicklingError as err:
            raise ConfigError(
                f"the distributed checkpoint index {str(file)!r} names `{err}`, which torch's "
                "checkpoint metadata never holds, so the checkpoint is not loaded: loading it could "
                "run code."
            ) from None
        except (EOFError, ValueError, TypeError, AttributeError, IndexError) as err:
            raise ConfigError(
                f"the distributed checkpoint index {str(file)!r} cannot be read ({type(err).__name__}: "
                f"{err}): truncated or not a checkpoint; pass another checkpoint."
            ) from None
    return found


def check_distributed_checkpoint(path: str | Path) -> None:
    """Check a distributed checkpoint directory before torch or Lightning unpickles anything in it: the index
    (`check_dcp_metadata`), every non-tensor item of every `.distcp` shard read with `weights_only=True` (torch would
    read them with `weights_only=False`), and `meta.pt` with `weights_only=True`.

    Raises:
        ConfigError: naming the file (and item) that holds more than tensors and plain types, an item the index
            names in a shard that is missing or short, or a transformed (compressed) item that cannot be checked.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    path = Path(path)
    for metadata in check_dcp_metadata(path):
        if not isinstance(metadata, Metadata):
            raise ConfigError(f"{str(path / '.metadata')!r} is not a torch.distributed.checkpoint index.")
        byte_items = {
            fqn for fqn, meta in metadata.state_dict_metadata.items() if isinstance(meta, BytesStorageMetadata)
        }
        sizes: dict[str, int] = {}
        for index, info in (metadata.storage_data or {}).items():
            shard = path / info.relative_path
            if info.relative_path not in sizes:
                sizes[info.relative_path] = shard.stat().st_size if shard.is_file() else -1
            if sizes[info.relative_path] < info.offset + info.length:
                state = "missing" if sizes[info.relative_path] < 0 else "shorter than its index says (truncated)"
                raise ConfigError(
                    f"the shard {str(shard)!r} of the checkpoint {str(path)!r} is {state}: the "
                    "checkpoint is incomplete; pass another checkpoint."
                )
            if index.fqn not in byte_items:
                continue
            if getattr(info, "transform_descriptors", None):
                raise ConfigError(
                    f"the item `{index.fqn}` of {str(shard)!r} is stored transformed "
                    f"({list(info.transform_descriptors)}), so it cannot be checked before it is "
                    "unpickled; the checkpoint is not loaded."
                )
            try:
                with shard.open("rb") as handle:
                    handle.seek(info.offset)
                    data = handle.read(info.length)
            except OSError as err:
                raise ConfigError(
                    f"the shard {str(shard)!r} of the checkpoint {str(path)!r} cannot be read: {err}."
                ) from None
            if len(data) != info.length:
                raise ConfigError(
                    f"the shard {str(shard)!r} is shorter than its index says (truncated): the "
                    "checkpoint is incomplete; pass another checkpoint."
                )
            try:
                torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as err:
                raise ConfigError(
                    f"the item `{index.fqn}` of the checkpoint shard {str(shard)!r} holds more than "
                    f"tensors and plain types ({refused_object(err)}), so the checkpoint is not loaded: "
                    "torch would unpickle it with weights_only=False, which could run code."
                ) from None
    meta = path / _lightning.distributed_checkpoint_metadata_name()  # loops, callbacks, hyper-parameters
    if meta.is_file():
        load_metadata(meta)


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]] | None:
    """Parameter name -> shape of the model a checkpoint holds, read without unpickling anything unchecked: a
    `torch.save` file memory-mapped with `weights_only=True`, or a distributed checkpoint's index (its
    `state_dict.<name>` entries, whose sizes are the full tensors' whatever the sharding). None when it holds no
    `state_dict`."""
    path = Path(path)
    if path.is_dir():
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        shapes = {}
        for metadata in check_dcp_metadata(path):
            for fqn, meta in getattr(metadata, "state_dict_metadata", {}).items():
                if fqn.startswith("state_dict.") and isinstance(meta, TensorStorageMetadata):
                    shapes[fqn.removeprefix("state_dict.")] = tuple(meta.size)
        return shapes or None
    state = load_metadata(path, mmap=True).get("state_dict")
    if not isinstance(state, dict):
        return None
    return {name: tuple(t.shape) for name, t in state.items() if isinstance(t, torch.Tensor)}
