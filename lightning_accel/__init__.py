"""lightning_accel: Lightning callbacks, strategy presets and Hydra configs for faster runs that keep their quality.

Importing the package has no side effects: no Hydra, no NVML, no CUDA initialisation.
"""

from __future__ import annotations

from lightning_accel.precision import Hardware, ResolvedPrecision, apply_float32_matmul_precision, resolve_precision
from lightning_accel.schedules import (
    AccumulationPlan,
    configure_optimizers,
    cosine_schedule,
    estimated_optimizer_steps,
    linear_warmup_schedule,
    onecycle_schedule,
)

__version__ = "0.1.0"

__all__ = [
    "AccumulationPlan",
    "Hardware",
    "ResolvedPrecision",
    "__version__",
    "apply_float32_matmul_precision",
    "configure_optimizers",
    "cosine_schedule",
    "estimated_optimizer_steps",
    "linear_warmup_schedule",
    "onecycle_schedule",
    "resolve_precision",
]
