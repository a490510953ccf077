"""The DataLoader settings the tuner chooses and the presets set under `data.`: the one list of their names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["LOADER_KEYS", "LoaderSettings"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LoaderSettings:
    """The DataLoader arguments the tuner chooses."""

    num_workers: int = 0
    prefetch_factor: int | None = None
    """Batches loaded ahead per worker; None without workers (DataLoader's rule)."""
    pin_memory: bool = False
    persistent_workers: bool = False

    @property
    def cost(self) -> tuple[int, int, bool]:
        """Ordering among settings within the tolerance: fewer workers, then less prefetch, then no pinning."""
        return self.num_workers, self.prefetch_factor or 0, self.pin_memory

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


LOADER_KEYS: tuple[str, ...] = tuple(field.name for field in dataclasses.fields(LoaderSettings))
"""The DataLoader arguments the tuner chooses, the presets set under `data.`, and accel-tune may pin: the one list."""
