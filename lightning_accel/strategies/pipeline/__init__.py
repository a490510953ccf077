"""Pipeline parallelism (torch.distributed.pipelining) in the Lightning loop.

- `strategy`: `PipelineStrategy`, the Lightning hooks;
- `pipeline_settings`: its arguments as `PipelineSettings`, their defaults and the checks run before launch and in
  `setup`;
- `spec`: the schedules by name (`ScheduleSpec`);
- `stages`: the stage plan (`PipelineStagePlan`), placing stages on ranks, pruning a model to its stages;
- `runner`: one batch through the stages (`PipelineRunner`, returning a `PipelineStepResult`), clipping over stages;
- `checkpoint`: saving, loading and consolidating checkpoint directories.
"""

from __future__ import annotations

from lightning_accel.precision import PIPELINE_PRECISIONS  # owned by precision.py, exported here as before
from lightning_accel.strategies.dcp_checks import check_dcp_metadata, check_distributed_checkpoint, load_metadata
from lightning_accel.strategies.pipeline.checkpoint import consolidate_checkpoint
from lightning_accel.strategies.pipeline.pipeline_settings import (
    PipelineSettings,
    check_pipeline_settings,
    check_precision,
)
from lightning_accel.strategies.pipeline.runner import PipelineRunner, PipelineStepResult, split_batch
from lightning_accel.strategies.pipeline.spec import SCHEDULES, ScheduleSpec, check_torch_pipelining, schedule_spec
from lightning_accel.strategies.pipeline.stages import (
    PipelineStagePlan,
    check_microbatches,
    microbatches_for,
    plan_pipeline_stages,
    prune_to_stages,
    stage_ranks,
)
from lightning_accel.strategies.pipeline.strategy import PipelineStrategy

__all__ = [
    "PIPELINE_PRECISIONS",
    "SCHEDULES",
    "PipelineRunner",
    "PipelineSettings",
    "PipelineStagePlan",
    "PipelineStepResult",
    "PipelineStrategy",
    "ScheduleSpec",
    "check_dcp_metadata",
    "check_distributed_checkpoint",
    "check_microbatches",
    "check_pipeline_settings",
    "check_precision",
    "check_torch_pipelining",
    "consolidate_checkpoint",
    "load_metadata",
    "microbatches_for",
    "plan_pipeline_stages",
    "prune_to_stages",
    "schedule_spec",
    "split_batch",
    "stage_ranks",
]
