"""Checkpoint files written atomically in their own directory: a killed save or a full disk leaves the old file."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lightning_accel.errors import FileOperationError
from lightning_accel.files import PathLike, atomic_path

__all__ = [
    "AtomicCheckpointIO",
    "atomic_torch_save",
    "hidden_name",
    "recover_directory",
    "remove_stale_staging",
    "remove_stale_temporaries",
    "replace_directory",
    "staging_path",
    "what_still_stands",
]


def hidden_name(name: str) -> str:
    """The prefix of the temporary names beside checkpoint `name`: hidden, and without `_` so that Lightning, which
    reads any name holding `hpc_ckpt_` as an HPC checkpoint version, never counts a leftover one."""
    return "." + name.replace("_", "-")


class _KeepWriteError:
    """The file `torch.save` writes through, keeping the `OSError` a write raised: torch's zip writer turns it into a
    RuntimeError ("unexpected pos 128 vs 0") that names neither the errno nor the file."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.handle.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        try:
            self.handle.flush()
        except OSError as err:
            self.error = self.error or err
            raise

    def __getattr__(self, name: str) -> Any:  # seek, tell: as the file has them
        return getattr(self.handle, name)


def _step_of(path: Path) -> str:
    """` (global step N)` of a Lightning checkpoint file, read mapped (nothing is loaded); "" where it cannot say."""
    try:
        step = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("global_step")
    except Exception:  # a checkpoint of another writer, or unreadable: the path alone is said
        return ""
    return f" (global step {step})" if isinstance(step, int) else ""


def what_still_stands(path: PathLike) -> str:
    """Which checkpoint still stands after a save to `path` failed: `path` itself as it was, else the `last.ckpt`
    beside it, else none; for the error's message."""
    target = Path(path)
    if target.is_file():
        return f"{target}{_step_of(target)} still stands, as it was before this save"
    last = target.with_name("last.ckpt")
    if last.is_file():
        return f"nothing was written to {target}; {last}{_step_of(last)} still stands"
    return f"nothing was written to {target}, and no last.ckpt stands beside it"


def atomic_torch_save(obj: Any, path: PathLike) -> None:
    """`torch.save(obj, path)` through a temporary file in `path`'s own directory, flushed to disk, then renamed over
    `path`: a reader sees the old file or the new one, never a part. On any failure (a full disk, a signal) the
    temporary file is removed and `path` is as it was.

    Raises:
        FileOperationError: an OS failure (a full disk, a read-only directory, ...), naming `path`, the errno in words
            (`No space left on device (ENOSPC)`) and the checkpoint that still stands.
    """
    target = Path(path)
    try:
        with atomic_path(target, prefix=hidden_name(target.name)[1:], fsync=True, what="checkpoint") as tmp:
            with tmp.open("wb") as handle:  # atomic_path hides the name
                kept = _KeepWriteError(handle)
                try:
                    torch.save(obj, kept)
                except RuntimeError as err:
                    if kept.error is None:
                        raise
                    raise kept.error from err
    except FileOperationError as err:
        err.detail = f"{what_still_stands(target)}; free space there, or save elsewhere"
        raise


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
    one is moved aside to `.<name>.old-<time>`, `new` renamed into place, then the old removed; a kill between the
    two renames leaves the old one aside, and `recover_directory` (run before every pipeline save and load, and
    before accel-train resumes) puts it back.
    """
    new, path = Path(new), Path(path)
    if path.exists() and not path.is_symlink() and _exchange(new, path):
        _remove(new)
        return
    old = path.with_name(f"{hidden_name(path.name)}.old-{time.time_ns():x}")
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
        _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _aside_time(path: Path) -> int:
    try:
        return int(path.name.rsplit(".old-", 1)[1], 16)
    except (IndexError, ValueError):
        return -1


def recover_directory(path: Path) -> bool:
    """If a save died between `replace_directory`'s two renames (`path` gone, `.<name>.old-<time>` beside it), move
    the latest one moved aside back to `path` (by the time in its name: an older one may be half removed). Returns
    whether it did."""
    path = Path(path)
    if os.path.lexists(path) or not path.parent.is_dir():
        return False
    aside = sorted(path.parent.glob(f"{hidden_name(path.name)}.old-*"), key=_aside_time)
    if not aside:
        return False
    try:
        os.replace(aside[-1], path)
    except FileNotFoundError:  # another rank of this job recovered it first
        return os.path.lexists(path)
    return True


def staging_path(path: Path) -> Path:
    """Where a checkpoint directory for `path` is written before it is swapped in."""
    return path.with_name(f"{hidden_name(path.name)}.saving-{uuid.uuid4().hex[:8]}")


def remove_stale_staging(path: Path) -> None:
    """Remove what killed saves left beside `path`: `.<name>.saving-<id>` directories, and (once `path` exists)
    `.<name>.old-<time>` ones whose removal was cut short."""
    path = Path(path)
    if not path.parent.is_dir():
        return
    stale = list(path.parent.glob(f"{hidden_name(path.name)}.saving-*"))
    if os.path.lexists(path):
        stale += path.parent.glob(f"{hidden_name(path.name)}.old-*")
    for leftover in stale:
        shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)


def remove_stale_temporaries(directory: PathLike) -> list[Path]:
    """Remove what killed saves left in a checkpoint directory: `atomic_torch_save`'s hidden `.<name>.<id>.tmp` files
    and `.<name>.saving-<id>` staging directories. Call it before a run starts saving there (no save of its own is
    under way); returns what it removed."""
    from lightning_accel.files import remove_stale_temporaries as remove_files

    folder = Path(directory)
    stale = [p for p in folder.glob(".*.saving-*") if p.is_dir()] if folder.is_dir() else []
    for leftover in stale:
        shutil.rmtree(leftover, ignore_errors=True)
    return [*remove_files(folder), *stale]


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's `TorchCheckpointIO`, writing local files with `atomic_torch_save`.

    Lightning's own save goes through fsspec, whose local "transaction" writes into the system's temporary directory
    and then copies across filesystems when the output lives elsewhere: a full disk there leaves a truncated file
    that looks like a checkpoint. Remote URLs (`s3://...`) keep Lightning's path.

    Example::

        trainer = Trainer(plugins=[AtomicCheckpointIO()], callbacks=[ModelCheckpoint(dirpath="ckpt")])
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: PathLike, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):
            # Lightning annotates `str | Path` but opens any path fsspec takes; the path goes on as it came
            super().save_checkpoint(checkpoint, cast("str | Path", path), storage_options)
            return
        atomic_torch_save(checkpoint, path)
