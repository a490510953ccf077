"""Checkpoint files written atomically in their own directory: a killed save or a full disk leaves the old file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

__all__ = ["AtomicCheckpointIO", "atomic_torch_save"]


def atomic_torch_save(obj: Any, path: _PATH) -> None:
    """`torch.save(obj, path)` through a temporary file in `path`'s own directory, flushed to disk, then renamed over
    `path`: a reader sees the old file or the new one, never a part. On any failure (a full disk, a signal) the
    temporary file is removed and `path` is as it was."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # the rename itself survives a power loss once the directory entry is on disk
        dir_fd = os.open(target.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's `TorchCheckpointIO`, writing local files with `atomic_torch_save`.

    Lightning's own save goes through fsspec, whose local "transaction" writes into the system's temporary directory
    and then copies across filesystems when the output lives elsewhere: a full disk there leaves a truncated file
    that looks like a checkpoint. Remote URLs (`s3://...`) keep Lightning's path.

    Example::

        trainer = Trainer(plugins=[AtomicCheckpointIO()], callbacks=[ModelCheckpoint(dirpath="ckpt")])
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        atomic_torch_save(checkpoint, path)
