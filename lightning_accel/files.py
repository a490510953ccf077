"""Files written whole or not at all: the one atomic-write helper every output of this package goes through."""

from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lightning_accel.errors import FileOperationError

__all__ = [
    "TEMP_SUFFIX",
    "PathLike",
    "atomic_path",
    "atomic_write",
    "directory_write_error",
    "owned_by_me",
    "remove_stale_temporaries",
    "temporary_target",
]

PathLike = str | os.PathLike
"""A file path as users give it: a string or a path object."""

TEMP_SUFFIX = ".tmp"
"""The suffix of the temporary files `atomic_path` writes (hidden names: `.<prefix>.accel-<id>.tmp`)."""
_TEMP_MARK = "accel-"
_TEMP_NAME = re.compile(rf"\.(?P<target>.+)\.{_TEMP_MARK}[a-z0-9_]{{8}}{re.escape(TEMP_SUFFIX)}")
"""`atomic_path`'s temporary names: `mkstemp` draws the 8-character id from `[a-z0-9_]`."""


@contextmanager
def atomic_path(
    path: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    fsync: bool = False,
    mode: int | None = None,
    what: str = "",
) -> Iterator[Path]:
    """A temporary path beside `path` to write to; renamed over `path` when the block ends without an error, removed
    when it does not (a full disk, a signal), so a reader sees the old file or the new one, never a part.

    Args:
        path: the file to write.
        prefix: the temporary name's stem (default: the target's name); hidden either way
            (`.<prefix>.accel-<id>.tmp`, the only names `remove_stale_temporaries` removes).
        fsync: flush the file and its directory entry to disk (checkpoints: a power loss keeps one of the two).
        mode: the file's permissions (default: what a plain `open` gives under the process's umask, not the private
            0o600 of a temporary file).
        what: the kind of file, for the error (`checkpoint`: "cannot write checkpoint ...").

    Raises:
        FileOperationError: an OS failure (a full disk, a read-only directory, a file where a directory belongs, a
            directory where the file belongs, permission denied), naming `path`, the operation and the errno in
            words; `path` is as it was.
    """
    target = Path(path)
    operation = f"write {what}".rstrip()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        blocked = _file_in_the_way(target.parent)
        detail = f"{blocked} is a file, not a directory" if blocked is not None else ""
        raise FileOperationError("create directory", err.filename or target.parent, err, detail) from err
    if target.is_dir():  # os.replace would say so only after the whole file was written
        raise FileOperationError(operation, target, IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR)))
    try:
        fd, name = tempfile.mkstemp(
            dir=target.parent, prefix=f".{prefix or target.name}.{_TEMP_MARK}", suffix=TEMP_SUFFIX
        )
    except OSError as err:
        raise FileOperationError(operation, target, err) from err
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, _default_mode() if mode is None else mode)
        if fsync:
            with tmp.open("rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(tmp, target)
    except FileOperationError:
        tmp.unlink(missing_ok=True)
        raise
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise FileOperationError(operation, target, err) from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_directory(target.parent)


def _file_in_the_way(folder: Path) -> Path | None:
    """The nearest existing path at or above `folder` when it is not a directory (a file where one belongs)."""
    probe = folder
    while not os.path.lexists(probe) and probe.parent != probe:
        probe = probe.parent
    return probe if os.path.lexists(probe) and not probe.is_dir() else None


def directory_write_error(path: str | os.PathLike[str]) -> FileOperationError | None:
    """Why files cannot be created in the directory `path` (created later, with its parents, by whoever writes
    there), or None when they can: a file where it or a parent belongs, a read-only file system, permission denied.

    Creates nothing that stays: the nearest existing directory is probed with a hidden temporary file, removed at
    once. Call it before the work whose results go there, so a bad path costs nothing.
    """
    target = Path(path)
    blocked = _file_in_the_way(target)
    if blocked is not None:
        number = errno.EEXIST if blocked == target else errno.ENOTDIR
        in_the_way = OSError(number, os.strerror(number))
        return FileOperationError("create directory", target, in_the_way, f"{blocked} is a file, not a directory")
    probe = target
    while not os.path.lexists(probe) and probe.parent != probe:
        probe = probe.parent
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".accel-write-check-"):
            pass
    except OSError as err:
        return FileOperationError("write into directory", probe, err)
    return None


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


def temporary_target(name: str) -> str | None:
    """The name of the file that a temporary of `atomic_path` named `name` was to become
    (`.last.ckpt.accel-k2x9q0ab.tmp` -> `last.ckpt`, with the default prefix), or None where `name` is not such a
    temporary: a user's `.draft.tmp` or `.notes.backup01.tmp` is not."""
    match = _TEMP_NAME.fullmatch(name)
    return None if match is None else match.group("target")


def owned_by_me(info: os.stat_result) -> bool:
    """`info` (an `lstat`) is a regular file of this process's user: the only kind of file this package removes."""
    return stat.S_ISREG(info.st_mode) and (not hasattr(os, "getuid") or info.st_uid == os.getuid())


def remove_stale_temporaries(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary files that writes killed midway left in `directory` (not its sub-folders): only regular
    files of this user named as `atomic_path` names them (`temporary_target`), never another hidden `.tmp` file. Call it
    when nothing of this run writes there yet; returns what it removed."""
    folder = Path(directory)
    try:
        entries = list(os.scandir(folder))
    except OSError:  # missing, not a directory, unreadable: nothing of ours to remove
        return []
    stale = []
    for entry in entries:
        if temporary_target(entry.name) is None:
            continue
        try:
            if owned_by_me(entry.stat(follow_symlinks=False)):
                os.unlink(entry.path)
                stale.append(Path(entry.path))
        except OSError:  # removed meanwhile, or not ours to remove
            continue
    return stale
