"""The project's exception and warning classes."""

from __future__ import annotations

__all__ = ["ConfigError", "LightningAccelError", "LightningAccelWarning", "NonFiniteLossError", "PreflightError"]


class LightningAccelError(Exception):
    """Base class of lightning_accel's errors."""


class ConfigError(LightningAccelError, ValueError):
    """A setting that cannot work; the message names the setting, the value received and the fix."""


class NonFiniteLossError(LightningAccelError):
    """Training met a NaN/inf loss under `NonFiniteGuard(action="raise")`; the message names the step and checkpoint."""


class PreflightError(LightningAccelError):
    """A `Preflight` check failed before the first step; the message names the node, rank, check and fix."""


class LightningAccelWarning(UserWarning):
    """Warnings of lightning_accel (filter them with `warnings.filterwarnings("ignore", category=...)`)."""
