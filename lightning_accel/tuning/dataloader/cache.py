"""The decision cache: one JSON file of `TunerDecision`s keyed by a fingerprint of what a decision depends on."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_accel.files import atomic_write
from lightning_accel.tuning.dataloader.decision import TunerDecision

__all__ = ["DecisionCache", "default_cache_dir", "fingerprint"]


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/lightning_accel`, else `~/.cache/lightning_accel`."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning_accel"


def fingerprint(facts: Mapping[str, Any]) -> str:
    """A short stable hash of what the decision depends on (dataset, batch size, model, hardware, world size)."""
    return hashlib.sha256(json.dumps(dict(facts), sort_keys=True, default=str).encode()).hexdigest()[:20]


class DecisionCache:
    """Decisions in one JSON file, keyed by fingerprint; written atomically (a temporary file, then a rename)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def _entries(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        entries = data.get("entries") if isinstance(data, dict) else None
        return entries if isinstance(entries, dict) else {}  # a file of another shape counts as empty

    def get(self, key: str, max_workers: int) -> TunerDecision | None:
        """The valid decision under `key` (`TunerDecision.from_dict`), or None: a miss, tuned again."""
        entry = self._entries().get(key)
        if isinstance(entry, dict):
            entry = {"fingerprint": key, **entry}
        return TunerDecision.from_dict(entry, fingerprint=key, max_workers=max_workers)

    def put(self, decision: TunerDecision) -> None:
        self._write({**self._entries(), decision.fingerprint: decision.as_dict()})

    def remove(self, key: str) -> None:
        """Drop the entry under `key` (a decision that failed its verification), if there is one."""
        entries = self._entries()
        if entries.pop(key, None) is not None:
            self._write(entries)

    def _write(self, entries: Mapping[str, Any]) -> None:
        atomic_write(self.path, json.dumps({"version": 1, "entries": dict(entries)}, indent=1, sort_keys=True))
