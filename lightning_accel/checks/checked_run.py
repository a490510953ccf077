"""The checks' two entry points: `check_config` (every setting, alone and together) and `check_run` (then the
precision resolved for this machine, checked again), whose `CheckedRun` is what the plan is built from."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

from omegaconf import DictConfig, OmegaConf

from lightning_accel.checks.combinations import check_combinations
from lightning_accel.checks.group_settings import check_group_settings
from lightning_accel.checks.trainer_settings import check_trainer_settings
from lightning_accel.errors import ConfigError
from lightning_accel.shape import RunShape, run_shape

if TYPE_CHECKING:
    from lightning_accel.precision import ResolvedPrecision

__all__ = ["CheckedRun", "check_config", "check_run", "resolve_config_precision"]


def check_config(cfg: DictConfig, *, visible_cuda: int | None = None, shape: RunShape | None = None) -> None:
    """Fail fast, before any Trainer or process exists, on settings that cannot work: the `trainer` settings, the
    other groups' settings, then their combinations (`check_combinations`).

    Args:
        cfg: the composed config.
        visible_cuda: CUDA devices visible; None counts them (without creating a CUDA context).
        shape: the config's run shape (`shape.run_shape`), read by the caller before the checks; None reads it.

    Raises:
        ConfigError: naming the setting, the value received and the fix.
    """
    _check_settings(cfg, shape, visible_cuda)


def _check_settings(cfg: DictConfig, shape: RunShape | None, visible_cuda: int | None) -> RunShape:
    shape = shape or run_shape(cfg, visible_cuda=visible_cuda)
    check_trainer_settings(cfg)
    check_group_settings(cfg, shape)
    check_combinations(cfg, shape=shape)
    return shape


@dataclass(frozen=True, kw_only=True)
class CheckedRun:
    """A config that passed the checks, with what they read: the plan (`run_plan.build_run_plan`) is built from
    this, so it never calls a check and never reads the shape again."""

    shape: RunShape
    """The run's shape, with `precision` as resolved for this machine."""
    precision: ResolvedPrecision
    """`trainer.precision` resolved for this machine (`amp`, `fp8`), with the reason and any callbacks it needs."""


def check_run(cfg: DictConfig, shape: RunShape | None = None, *, visible_cuda: int | None = None) -> CheckedRun:
    """Check a composed config before its plan: `check_config`, then the precision resolved for this machine
    (`resolve_config_precision`) and the combinations checked again with it (`amp` may resolve to one that
    the strategy refuses).

    Args:
        cfg: the composed config.
        shape: its run shape as configured (`shape.run_shape(cfg)`); None reads it.
        visible_cuda: CUDA devices visible, when `shape` is None; None counts them.

    Raises:
        ConfigError: naming the setting, the value received and the fix.
    """
    shape = _check_settings(cfg, shape, visible_cuda)
    resolved = resolve_config_precision(cfg)
    shape = replace(shape, precision=resolved.value)
    check_combinations(cfg, shape=shape)  # again, now with the precision resolved for this machine
    return CheckedRun(shape=shape, precision=resolved)


def resolve_config_precision(cfg: DictConfig) -> ResolvedPrecision:
    """`trainer.precision` of a composed config resolved for this machine (`lightning_accel.precision`), with the
    reason: `amp` and `fp8` as asked, whether the config wrote them directly or through `${accel_precision:...}`. A
    check as much as a reading: a precision this machine cannot run is refused here.

    Raises:
        ConfigError: when the precision cannot run here, naming `trainer.precision` and the fix.
    """
    import re

    from lightning_accel.precision import resolve_precision

    accelerator = cfg.trainer.get("accelerator", "auto")
    written = cast("dict[str, Any]", OmegaConf.to_container(cfg.trainer, resolve=False))  # the trainer group: a mapping
    raw = written.get("precision", "32-true")
    requested = re.match(r"\$\{accel_precision:([^,}]+)", str(raw))  # conf/precision/amp.yaml: resolved already
    try:
        return resolve_precision(
            requested.group(1) if requested else cfg.trainer.get("precision", "32-true"),
            accelerator if isinstance(accelerator, str) else "auto",
            setting="trainer.precision",
        )
    except ConfigError as err:  # `accelerator=...` is the Trainer's
        raise err.at("trainer") from None
