"""lightning_accel: Lightning callbacks, strategy presets and Hydra configs for faster runs that keep their quality.

Importing the package has no side effects: no Hydra, no NVML, no CUDA initialisation.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_accel.precision import Hardware, ResolvedPrecision, apply_float32_matmul_precision, resolve_precision
    from lightning_accel.schedules import (
        AccumulationPlan,
        configure_optimizers,
        cosine_schedule,
        estimated_optimizer_steps,
        linear_warmup_schedule,
        onecycle_schedule,
    )

__version__ = "0.2.0"

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

# The public names, each imported from its room when first used: `import lightning_accel` loads no submodule, so
# `import lightning_accel.system` brings in only what the facts layer needs (tests/test_layers.py checks it).
_HOMES = {
    name: "lightning_accel.precision"
    for name in ("Hardware", "ResolvedPrecision", "apply_float32_matmul_precision", "resolve_precision")
} | {
    name: "lightning_accel.schedules"
    for name in (
        "AccumulationPlan",
        "configure_optimizers",
        "cosine_schedule",
        "estimated_optimizer_steps",
        "linear_warmup_schedule",
        "onecycle_schedule",
    )
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
