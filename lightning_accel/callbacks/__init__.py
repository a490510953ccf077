"""Lightning callbacks of lightning_accel, one per module."""

from __future__ import annotations

__all__: list[str] = []
