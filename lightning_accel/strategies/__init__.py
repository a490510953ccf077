"""Strategies the Trainer lacks (pipeline parallelism), DDP with split timeouts, NCCL environment presets, and
checkpoint files written atomically."""

from __future__ import annotations

from lightning_accel.strategies.checkpoint_io import AtomicCheckpointIO, atomic_torch_save
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
    "AtomicCheckpointIO",
    "DDPStrategy",
    "NcclPlan",
    "PipelineStrategy",
    "StagePlan",
    "atomic_torch_save",
    "consolidate_checkpoint",
    "default_route_interface",
    "nccl_plan",
    "plan_stages",
    "stage_ranks",
]
