"""Strategies the Trainer lacks (pipeline parallelism), DDP with split timeouts, NCCL environment presets, and
checkpoint files written atomically."""

from __future__ import annotations

from lightning_accel.precision import PIPELINE_PRECISIONS  # owned by precision.py, exported here as before
from lightning_accel.strategies.checkpoint_io import AtomicCheckpointIO, atomic_torch_save
from lightning_accel.strategies.ddp import DDPStrategy
from lightning_accel.strategies.nccl import NCCL_PRESETS, NcclPlan, default_route_interface, nccl_plan
from lightning_accel.strategies.pipeline import (
    SCHEDULES,
    PipelineSettings,
    PipelineStagePlan,
    PipelineStrategy,
    consolidate_checkpoint,
    plan_pipeline_stages,
    stage_ranks,
)

__all__ = [
    "NCCL_PRESETS",
    "PIPELINE_PRECISIONS",
    "SCHEDULES",
    "AtomicCheckpointIO",
    "DDPStrategy",
    "NcclPlan",
    "PipelineSettings",
    "PipelineStagePlan",
    "PipelineStrategy",
    "atomic_torch_save",
    "consolidate_checkpoint",
    "default_route_interface",
    "nccl_plan",
    "plan_pipeline_stages",
    "stage_ranks",
]
