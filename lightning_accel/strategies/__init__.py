"""Every strategy of this package: DDP with split timeouts (`ddp`), ModelParallelStrategy sized by one flag
(`model_parallel`), pipeline parallelism (`pipeline/`); NCCL environment presets (`nccl`) and checkpoint files
written atomically (`checkpoint_io`)."""

from __future__ import annotations

from typing import Any

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

_RENAMED = {"StagePlan": "PipelineStagePlan", "plan_stages": "plan_pipeline_stages"}


def __getattr__(name: str) -> Any:
    """The pipeline's `StagePlan`/`plan_stages` were renamed (accel-bench has its own of those names); the old names
    still resolve here, with a DeprecationWarning."""
    if name in _RENAMED:
        import warnings

        new = _RENAMED[name]
        warnings.warn(f"`lightning_accel.strategies.{name}` is now `{new}`.", DeprecationWarning, stacklevel=2)
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
