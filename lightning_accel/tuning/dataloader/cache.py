"""The decision cache: one JSON file of `TunerDecision`s keyed by a fingerprint of what a decision depends on."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning_accel.errors import LightningAccelWarning
from lightning_accel.files import atomic_write
from lightning_accel.tuning.dataloader.decision import TunerDecision

__all__ = ["SCHEMA", "DecisionCache", "default_cache_dir", "fingerprint"]

SCHEMA = "lightning_accel.dataloader_tuner_cache/1"
"""The `schema` a decision cache file holds; a file without it (and not of the version-1 shape that earlier releases
wrote) is someone else's, and is never written over."""


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/lightning_accel`, else `~/.cache/lightning_accel`."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning_accel"


def fingerprint(facts: Mapping[str, Any]) -> str:
    """A short stable hash of what the decision depends on (dataset, batch size, model, hardware, world size)."""
    return hashlib.sha256(json.dumps(dict(facts), sort_keys=True, default=str).encode()).hexdigest()[:20]


class DecisionCache:
    """Decisions in one JSON file, keyed by fingerprint; written atomically (a temporary file, then a rename), each
    read-modify-write under an exclusive lock on `<file>.lock` (concurrent runs each keep their entries). Entries are
    checked like user input (`TunerDecision.from_dict`). A cache file (or its folder) that other users may write, or
    that another user owns, is not used: a warning says so once, and the tuner tunes as without a cache. So is a file
    at that path that is not a decision cache (no `schema` of this package): it is never written over."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._refused: str | None = None

    def _unsafe(self) -> str | None:
        """Why the cache file must not be trusted (writable by others, owned by someone else), or None."""
        if not hasattr(os, "getuid"):
            return None
        for target in (self.path, self.path.parent):
            try:
                info = target.stat()
            except OSError:
                continue
            if info.st_mode & stat.S_IWOTH and not (target.is_dir() and info.st_mode & stat.S_ISVTX):
                return f"{target} is writable by every user"
            if info.st_uid not in (os.getuid(), 0) and target == self.path:
                return f"{target} belongs to another user (uid {info.st_uid})"
        return None

    def _entries(self) -> dict[str, Any]:
        """The entries of the cache file; {} where it is missing, unsafe or not a decision cache (warned once)."""
        why = self._unsafe()
        if why is not None:
            self._refuse(why, "any entry in it could have been planted; fix its permissions (chmod go-w) or")
            return {}
        entries, foreign = self._read()
        if foreign is not None:
            self._refuse(foreign, "it is left as it is; move it away or")
        return entries

    def _read(self) -> tuple[dict[str, Any], str | None]:
        """The entries, and why the file is not a decision cache of this package (None: it is one, or is missing)."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError:  # missing or unreadable: a miss (a write fails and says why)
            return {}, None
        try:
            data = json.loads(text)
        except ValueError:
            return {}, f"{self.path} does not hold JSON"
        legacy = isinstance(data, dict) and set(data) == {"version", "entries"} and data["version"] == 1
        if not isinstance(data, dict) or not (data.get("schema") == SCHEMA or legacy):
            return {}, f"{self.path} is not a DataLoaderTuner decision cache (no `schema` {SCHEMA!r})"
        entries = data.get("entries")
        return (entries if isinstance(entries, dict) else {}), None

    def _refuse(self, why: str, then: str) -> None:
        if self._refused != why:
            self._refused = why
            warnings.warn(
                f"DataLoaderTuner: the decision cache is not used: {why}, so {then} set `cache_dir` to a folder of "
                "your own.",
                LightningAccelWarning,
                stacklevel=4,
            )

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive lock on `<file>.lock` for a read-modify-write (none where fcntl is missing)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # Windows
            yield
            return
        with open(self.path.with_name(self.path.name + ".lock"), "a") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def get(self, key: str, max_workers: int) -> TunerDecision | None:
        """The valid decision under `key` (`TunerDecision.from_dict`), or None: a miss, tuned again."""
        entry = self._entries().get(key)
        if isinstance(entry, dict):
            entry = {"fingerprint": key, **entry}
        return TunerDecision.from_dict(entry, fingerprint=key, max_workers=max_workers)

    def put(self, decision: TunerDecision) -> None:
        with self._locked():
            if self._unsafe() is None and self._read()[1] is None:  # never over a file that is not ours
                self._write({**self._entries(), decision.fingerprint: decision.as_dict()})

    def remove(self, key: str) -> None:
        """Drop the entry under `key` (a decision that failed its verification), if there is one."""
        with self._locked():
            entries = self._entries()
            if entries.pop(key, None) is not None:  # none from a file that is unsafe or not ours
                self._write(entries)

    def _write(self, entries: Mapping[str, Any]) -> None:
        atomic_write(self.path, json.dumps({"schema": SCHEMA, "entries": dict(entries)}, indent=1, sort_keys=True))
