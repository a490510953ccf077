"""Files written whole or not at all: the one atomic-write helper every output of this package goes through."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["TEMP_SUFFIX", "PathLike", "atomic_path", "atomic_write", "remove_stale_temporaries"]

PathLike = str | os.PathLike
"""A file path as users give it: a string or a path object."""

TEMP_SUFFIX = ".tmp"
"""The suffix of the temporary files `atomic_path` writes (hidden names: `.<prefix>.<id>.tmp`)."""


@contextmanager
def atomic_path(
    path: str | os.PathLike[str], *, prefix: str | None = None, fsync: bool = False, mode: int | None = None
) -> Iterator[Path]:
    """A temporary path beside `path` to write to; renamed over `path` when the block ends without an error, removed
    when it does not (a full disk, a signal), so a reader sees the old file or the new one, never a part.

    Args:
        path: the file to write.
        prefix: the temporary name's stem (default: the target's name); hidden either way (`.<prefix>.<id>.tmp`).
        fsync: flush the file and its directory entry to disk (checkpoints: a power loss keeps one of the two).
        mode: the file's permissions (default: what a plain `open` gives under the process's umask, not the private
            0o600 of a temporary file).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{prefix or target.name}.", suffix=TEMP_SUFFIX)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, _default_mode() if mode is None else mode)
        if fsync:
            with tmp.open("rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_directory(target.parent)


def _read_umask() -> int:
    """The process's umask: from /proc (Linux), else by setting and restoring it (racy with threads: import time)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


_UMASK_AT_IMPORT = _read_umask()


def _default_mode() -> int:
    umask = _read_umask() if Path("/proc/self/status").exists() else _UMASK_AT_IMPORT
    return 0o666 & ~umask


def _fsync_directory(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], data: str | bytes, *, mode: int | None = None) -> Path:
    """Write `data` (text as UTF-8) to `path` through `atomic_path`; returns `path`."""
    target = Path(path)
    with atomic_path(target, mode=mode) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")
    return target


def remove_stale_temporaries(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove the hidden `.*.tmp` files that writes killed midway left in `directory` (not its sub-folders). Call it
    when nothing of this run writes there yet; returns what it removed."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    stale = [p for p in folder.glob(f".*{TEMP_SUFFIX}") if p.is_file()]
    for leftover in stale:
        leftover.unlink(missing_ok=True)
    return stale
