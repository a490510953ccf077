"""accel-bench's machinery: compose and plan the stages, run them round by round, the table's arithmetic and the
outputs (bench.py is the CLI)."""

from __future__ import annotations

from lightning_accel.benchmark.bench_report import JSON_SCHEMA_VERSION, markdown_table
from lightning_accel.benchmark.results import (
    StageResult,
    StageRun,
    bottleneck,
    finalize,
    higher_is_better,
    model_flops_utilization,
    quality_verdict,
    speedups,
)
from lightning_accel.benchmark.run import BenchRun, run_bench
from lightning_accel.benchmark.stage_config import BUILTIN_STAGES, available_presets, default_ladder
from lightning_accel.benchmark.stage_plan import BenchSettings, StagePlan, plan_stages

__all__ = [
    "BUILTIN_STAGES",
    "JSON_SCHEMA_VERSION",
    "BenchRun",
    "BenchSettings",
    "StagePlan",
    "StageResult",
    "StageRun",
    "available_presets",
    "bottleneck",
    "default_ladder",
    "finalize",
    "higher_is_better",
    "markdown_table",
    "model_flops_utilization",
    "plan_stages",
    "quality_verdict",
    "run_bench",
    "speedups",
]
