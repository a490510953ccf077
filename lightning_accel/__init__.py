"""lightning_accel: Lightning callbacks, strategy presets and Hydra configs for faster runs that keep their quality.

Importing the package has no side effects: no Hydra, no NVML, no CUDA initialisation.
"""

from __future__ import annotations

from lightning_accel.schedules import configure_optimizers, cosine_schedule, onecycle_schedule, total_optimizer_steps

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "configure_optimizers",
    "cosine_schedule",
    "onecycle_schedule",
    "total_optimizer_steps",
]
