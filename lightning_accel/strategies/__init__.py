"""Strategies the Trainer lacks (pipeline parallelism), DDP with split timeouts, and NCCL environment presets."""

from __future__ import annotations

from lightning_accel.strategies.ddp import DDPStrategy
from lightning_accel.strategies.nccl import NCCL_PRESETS, NcclPlan, default_route_interface, nccl_plan
from lightning_accel.strategies.pipeline import PIPELINE_PRECISIONS, PipelineStrategy
from lightning_accel.strategies.pipeline_stages import (
    SCHEDULES,
    StagePlan,
    consolidate_checkpoint,
    plan_stages,
    stage_ranks,
)

__all__ = [
    "NCCL_PRESETS",
    "PIPELINE_PRECISIONS",
    "SCHEDULES",
    "DDPStrategy",
    "NcclPlan",
    "PipelineStrategy",
    "StagePlan",
    "consolidate_checkpoint",
    "default_route_interface",
    "nccl_plan",
    "plan_stages",
    "stage_ranks",
]
