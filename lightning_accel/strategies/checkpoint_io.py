"""Checkpoint files written atomically in their own directory: a killed save or a full disk leaves the old file."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

__all__ = ["AtomicCheckpointIO", "atomic_torch_save", "recover_directory", "remove_stale_staging", "replace_directory"]


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


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux `renameat2(RENAME_EXCHANGE)`); False where the OS or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc < 2.28, musl
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(a), str(b))


def replace_directory(new: Path, path: Path) -> None:
    """Put the complete directory `new` at `path`, so that `path` always holds a whole checkpoint.

    Where the file system can swap two paths in one step (Linux, most local file systems) the old and the new trade
    places and the old is then removed: a kill at any moment leaves one whole checkpoint at `path`. Elsewhere the old
    one is moved aside to `.<name>.old-<id>`, `new` renamed into place, then the old removed; a kill between the two
    renames leaves the old one aside, and `recover_directory` (run before every pipeline save and load) puts it back.
    """
    new, path = Path(new), Path(path)
    if path.exists() and _exchange(new, path):
        shutil.rmtree(new) if new.is_dir() else new.unlink()
        return
    old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
    had_old = path.exists()
    if had_old:
        os.replace(path, old)
    try:
        os.replace(new, path)
    except BaseException:
        if had_old:
            os.replace(old, path)
        raise
    if had_old:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def recover_directory(path: Path) -> bool:
    """If a save died between `replace_directory`'s two renames (`path` gone, `.<name>.old-<id>` beside it), move
    the newest such directory back to `path`. Returns whether it did."""
    path = Path(path)
    if path.exists() or not path.parent.is_dir():
        return False
    aside = sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if not aside:
        return False
    os.replace(aside[-1], path)
    return True


def remove_stale_staging(path: Path) -> None:
    """Remove `.<name>.saving-<id>` directories beside `path`: what saves killed before completion left behind."""
    path = Path(path)
    if path.parent.is_dir():
        for stale in path.parent.glob(f".{path.name}.saving-*"):
            shutil.rmtree(stale, ignore_errors=True)


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
