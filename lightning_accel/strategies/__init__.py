"""Strategies the Trainer lacks and NCCL environment presets."""

from __future__ import annotations

from lightning_accel.strategies.ddp import DDPStrategy
from lightning_accel.strategies.nccl import NCCL_PRESETS, NcclPlan, default_route_interface, nccl_plan

__all__ = ["NCCL_PRESETS", "DDPStrategy", "NcclPlan", "default_route_interface", "nccl_plan"]
