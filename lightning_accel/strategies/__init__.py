"""Every strategy of this package: DDP with split timeouts (`ddp`), ModelParallelStrategy sized by one flag
(`model_parallel`), pipeline parallelism (`pipeline/`); NCCL environment presets (`nccl`) and checkpoint files
written atomically (`checkpoint_io`)."""

from __future__ import annotations

from lightning_accel.precision import PIPELINE_PRECISIONS  # owned by precision.py, exported here as before
from lightning_accel.strategies.checkpoint_io import AtomicCheckpointIO, atomic_torch_save
from lightning_accel.strategies.ddp import DDPStrategy
from lightning_accel.strategies.model_parallel import ModelParallelStrategy
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
    "ModelParallelStrategy",
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
