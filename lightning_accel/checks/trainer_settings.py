"""The `trainer` section's settings, one by one: devices, accelerator, precision, strategy, lengths, durations,
validation interval, gradient clipping and batch limits; and Lightning's own refusal of one, named."""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig

from lightning_accel.checks._values import _check_choice, _check_int, _show
from lightning_accel.errors import ConfigError
from lightning_accel.precision import PRECISION_CHOICES

__all__ = ["check_trainer_settings", "trainer_setting_error"]


_ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")


_DEVICES_STR = re.compile(r"^\s*(auto|-1|\d+|\d+\s*(,\s*\d+\s*)*,?)\s*$")


def _check_devices(devices: Any) -> None:
    if isinstance(devices, bool):
        pass
    elif isinstance(devices, int):
        if devices == -1 or devices >= 1:
            return
    elif isinstance(devices, str):
        if _DEVICES_STR.match(devices):
            return
    elif isinstance(devices, (ListConfig, Sequence)):
        if len(devices) > 0 and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices):
            if len(set(devices)) == len(devices):
                return
            raise ConfigError(
                f"`trainer.devices={_show(devices)}` names a device twice; list each index once, e.g. "
                "`trainer.devices=[0,1]`."
            )
    raise ConfigError(
        f"`trainer.devices={_show(devices)}` is not a device count or list of device indices; use a count "
        "(`trainer.devices=2`), indices (`trainer.devices=[0,1]`), -1 for all devices, or `auto`."
    )


def _check_val_check_interval(value: Any) -> None:
    """Lightning's `val_check_interval`: a fraction of the epoch in (0, 1], a number of batches >= 1, or (Lightning
    >= 2.6) a time between validations, "DD:HH:MM:SS" or a mapping of `timedelta` arguments."""
    if value is None:
        return
    if isinstance(value, (str, DictConfig, Mapping)) and _time_based_validation():
        _check_duration("trainer.val_check_interval", value)
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        timed = ", or a time (`'00:00:10:00'`)" if _time_based_validation() else ""
        raise ConfigError(
            f"`trainer.val_check_interval={_show(value)}` must be a fraction of the epoch (0 < x <= 1.0) "
            f"or a number of batches (an integer >= 1){timed}."
        )
    if (isinstance(value, int) and value < 1) or (isinstance(value, float) and not 0.0 < value <= 1.0):
        raise ConfigError(
            f"`trainer.val_check_interval={value}` validates never or always; use a fraction of the "
            "epoch (0 < x <= 1.0, e.g. 0.25) or a number of batches (an integer >= 1, e.g. 200)."
        )


def _time_based_validation() -> bool:
    """Whether the installed Lightning takes a time as `val_check_interval` (2.6 and later)."""
    import inspect

    from lightning.pytorch import Trainer

    return "timedelta" in str(inspect.signature(Trainer.__init__).parameters["val_check_interval"].annotation)


_DURATION = re.compile(r"^(\d+):(\d\d):(\d\d):(\d\d)$")
_DURATION_KEYS = ("weeks", "days", "hours", "minutes", "seconds", "milliseconds", "microseconds")


def _check_duration(setting: str, value: Any) -> None:
    """A Lightning duration (`max_time`, a time-based `val_check_interval`): "DD:HH:MM:SS" or a mapping of
    `datetime.timedelta` arguments (`{hours: 12}`), finite, not negative, and not zero."""
    if value is None:
        return
    fix = "write it as DD:HH:MM:SS (`'00:12:00:00'`: 12 hours) or as a mapping (`{hours: 12}`)"
    if isinstance(value, str):
        match = _DURATION.match(value.strip())
        if match is None:
            raise ConfigError(f"`{setting}={value!r}` is not a duration Lightning reads; {fix}.")
        days, hours, minutes, seconds = (int(part) for part in match.groups())
        total = float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)
    elif isinstance(value, (DictConfig, Mapping)):
        parts = dict(value.items())
        unknown = sorted(str(k) for k in parts if k not in _DURATION_KEYS)
        bad = [k for k, v in parts.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
        bad += [k for k, v in parts.items() if k not in bad and (not math.isfinite(v) or v < 0)]
        if unknown or bad or not parts:
            what = f"takes only {', '.join(_DURATION_KEYS)}" if unknown else "needs numbers >= 0"
            raise ConfigError(f"`{setting}={_show(value)}` is not a duration: a mapping {what}; {fix}.")
        try:
            total = datetime.timedelta(**{str(k): v for k, v in parts.items()}).total_seconds()
        except OverflowError:
            total = math.inf
    else:
        raise ConfigError(f"`{setting}={_show(value)}` is not a duration; {fix}.")
    if total > datetime.timedelta.max.total_seconds():
        raise ConfigError(f"`{setting}={_show(value)}` is longer than Python's `timedelta` can hold; {fix}.")
    if total <= 0:
        raise ConfigError(f"`{setting}={_show(value)}` is no time at all; {fix}, or null for no limit.")


def _check_gradient_clipping(value: Any, algorithm: Any) -> None:
    """`gradient_clip_val`: null or 0 (no clipping), or a finite number > 0 (a negative one flips the gradients'
    sign under norm clipping); `gradient_clip_algorithm`: null, norm or value."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
    ):
        raise ConfigError(
            f"`trainer.gradient_clip_val={_show(value)}` must be a finite number >= 0 (the largest gradient norm, "
            "e.g. 1.0), or 0 or null for no clipping."
        )
    if algorithm is not None and str(algorithm) not in ("norm", "value"):
        raise ConfigError(f"`trainer.gradient_clip_algorithm={_show(algorithm)}` must be `norm`, `value` or null.")


def _check_strategy(strategy: Any) -> None:
    if isinstance(strategy, (DictConfig, Mapping)):
        if "_target_" not in strategy:
            raise ConfigError(
                f"`trainer.strategy={_show(strategy)}` needs a `_target_` naming a Lightning Strategy class; "
                "or pick one with `strategy=NAME`."
            )
        return
    from lightning.pytorch.strategies import StrategyRegistry

    _check_choice("trainer.strategy", strategy, ("auto", *StrategyRegistry.keys()), hint="or pick `strategy=NAME`")


def _check_limit(setting: str, value: Any, fit: bool) -> None:
    """`trainer.limit_*_batches`: a fraction in [0, 1] or a count >= 0; none at all for training that should train."""
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (isinstance(value, float) and value > 1.0)
    ):
        raise ConfigError(f"`{setting}={_show(value)}` must be a fraction within [0, 1] or a number of batches >= 0.")
    if value == 0 and fit and setting.endswith("train_batches"):
        raise ConfigError(
            f"`{setting}={_show(value)}` trains on no batch at all; use a count >= 1 or a fraction "
            "above 0 (or `fit=false` to skip training)."
        )


def trainer_setting_error(err: Exception, cfg: DictConfig, trainer: Any) -> ConfigError | None:
    """Lightning's own refusal of a Trainer setting before the first step (`val_check_interval` beyond the epoch,
    ...), as a ConfigError naming the config path and value, or None for any other error."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    if trainer.global_step > 0 or not isinstance(err, (ValueError, MisconfigurationException)):
        return None
    text = str(err).strip()
    for name in re.findall(r"`(\w+)`", text):
        if name in cfg.trainer:
            return ConfigError(f"`trainer.{name}={cfg.trainer.get(name)}`: {text.splitlines()[0]}")
    return None


def check_trainer_settings(cfg: DictConfig) -> None:
    """The `trainer`, `model` and `data` sections are `_target_` configs, and each `trainer` setting alone can work.

    Raises:
        ConfigError: naming the setting, the value received and the fix.
    """
    for node in ("trainer", "model", "data"):
        section = cfg.get(node)
        if not isinstance(section, DictConfig) or "_target_" not in section:
            raise ConfigError(
                f"`{node}` must be a config with a `_target_`; got {_show(section)}. Pick one with `{node}=NAME`."
            )
    trainer, fit = cfg.trainer, cfg.get("fit", True)
    _check_devices(trainer.get("devices", "auto"))
    _check_choice("trainer.accelerator", trainer.get("accelerator", "auto"), _ACCELERATORS)
    _check_choice(
        "trainer.precision", trainer.get("precision", "32-true"), PRECISION_CHOICES, hint="or pick `precision=NAME`"
    )
    _check_strategy(trainer.get("strategy", "auto"))
    _check_int("trainer.num_nodes", trainer.get("num_nodes", 1), minimum=1)
    _check_int("trainer.accumulate_grad_batches", trainer.get("accumulate_grad_batches", 1), minimum=1)
    _check_int("trainer.max_steps", trainer.get("max_steps", -1), minimum=-1)
    if trainer.get("max_steps", -1) == 0 and fit:
        raise ConfigError(
            "`trainer.max_steps=0` trains nothing; use -1 (no step limit, `max_epochs` decides) or a "
            "number of optimizer steps >= 1 (or `fit=false` to skip training)."
        )
    _check_val_check_interval(trainer.get("val_check_interval"))
    _check_duration("trainer.max_time", trainer.get("max_time"))
    _check_gradient_clipping(trainer.get("gradient_clip_val"), trainer.get("gradient_clip_algorithm"))
    if trainer.get("max_epochs") is not None:
        _check_int("trainer.max_epochs", trainer.max_epochs, minimum=-1)
        if trainer.max_epochs == 0 and fit and trainer.get("max_steps", -1) in (-1, None):
            raise ConfigError(
                "`trainer.max_epochs=0` trains nothing; use -1 (no epoch limit, `max_steps` decides) or "
                "a number of epochs >= 1 (or `fit=false` to skip training)."
            )
    _check_limit("trainer.limit_train_batches", trainer.get("limit_train_batches"), fit)
