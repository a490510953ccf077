"""Checks a composed run (precision x strategy x accelerator x devices) before anything is built or spawned."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_accel.errors import ConfigError

__all__ = ["check_config"]

_ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")
_PRECISIONS = (
    "transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true", "bf16-mixed", "32-true",
    "64-true", "16", "32", "64", "bf16",
)  # fmt: skip
_DEVICES_STR = re.compile(r"^\s*(auto|-1|\d+|\d+\s*(,\s*\d+\s*)*,?)\s*$")


def check_config(cfg: DictConfig) -> None:
    """Fail fast, before any Trainer or process exists, on settings that cannot work.

    Raises:
        ConfigError: naming the setting, the value received and the fix.
    """
    for node in ("trainer", "model", "data"):
        section = cfg.get(node)
        if not isinstance(section, DictConfig) or "_target_" not in section:
            raise ConfigError(
                f"`{node}` must be a config with a `_target_`; got {_show(section)}. Pick one with `{node}=NAME`."
            )
    trainer = cfg.trainer
    _check_devices(trainer.get("devices", "auto"))
    _check_choice("trainer.accelerator", trainer.get("accelerator", "auto"), _ACCELERATORS)
    _check_choice(
        "trainer.precision", trainer.get("precision", "32-true"), _PRECISIONS, hint="or pick `precision=NAME`"
    )
    _check_strategy(trainer.get("strategy", "auto"))
    _check_int("trainer.num_nodes", trainer.get("num_nodes", 1), minimum=1)
    _check_int("trainer.accumulate_grad_batches", trainer.get("accumulate_grad_batches", 1), minimum=1)
    _check_int("trainer.max_steps", trainer.get("max_steps", -1), minimum=-1)
    if trainer.get("max_epochs") is not None:
        _check_int("trainer.max_epochs", trainer.max_epochs, minimum=-1)
    seed = cfg.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConfigError(f"`seed={seed!r}` must be an integer or null.")


def _show(value: Any) -> str:
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    return repr(value)


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
            return
    raise ConfigError(
        f"`trainer.devices={_show(devices)}` is not a device count or list of device indices; use a count "
        "(`trainer.devices=2`), indices (`trainer.devices=[0,1]`), -1 for all devices, or `auto`."
    )


def _check_choice(setting: str, value: Any, choices: Sequence[str], hint: str = "") -> None:
    if isinstance(value, (DictConfig, Mapping)) and "_target_" in value:
        return
    if str(value) not in choices:
        options = ", ".join(f"`{c}`" for c in choices)
        hint = f" {hint}" if hint else ""
        raise ConfigError(f"`{setting}={_show(value)}` is not supported; use one of {options}{hint}.")


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


def _check_int(setting: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"`{setting}={_show(value)}` must be an integer >= {minimum}.")
