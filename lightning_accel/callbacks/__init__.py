"""Lightning callbacks of lightning_accel, one per module."""

from __future__ import annotations

from lightning_accel.callbacks.accumulation import AccumulationScheduler

__all__ = ["AccumulationScheduler"]
