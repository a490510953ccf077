"""The project's exception and warning classes."""

from __future__ import annotations

__all__ = ["ConfigError", "LightningAccelError", "LightningAccelWarning", "NonFiniteLossError"]


class LightningAccelError(Exception):
    """Base class of lightning_accel's errors."""


class ConfigError(LightningAccelError, ValueError):
    """A setting that cannot work; the message names the setting, the value received and the fix."""


class NonFiniteLossError(LightningAccelError):
    """Training met a NaN/inf loss under `NonFiniteGuard(action="raise")`; the message names the step and checkpoint."""


class LightningAccelWarning(UserWarning):
    """Warnings of lightning_accel (filter them with `warnings.filterwarnings("ignore", category=...)`)."""
