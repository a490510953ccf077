"""Checks a composed run (precision x strategy x accelerator x devices) before anything is built or spawned."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_accel.errors import ConfigError

__all__ = ["check_config"]

_ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")
# `amp` and `fp8` are resolved per hardware (lightning_accel.precision) before the Trainer is built.
_PRECISIONS = (
    "amp", "fp8", "transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true", "bf16-mixed",
    "32-true", "64-true", "16", "32", "64", "bf16",
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
    if cfg.get("float32_matmul_precision") is not None:
        _check_choice("float32_matmul_precision", cfg.float32_matmul_precision, ("highest", "high", "medium"),
                      hint="or null to leave it alone")  # fmt: skip
    _check_int("trainer.num_nodes", trainer.get("num_nodes", 1), minimum=1)
    _check_int("trainer.accumulate_grad_batches", trainer.get("accumulate_grad_batches", 1), minimum=1)
    _check_int("trainer.max_steps", trainer.get("max_steps", -1), minimum=-1)
    if trainer.get("max_epochs") is not None:
        _check_int("trainer.max_epochs", trainer.max_epochs, minimum=-1)
    seed = cfg.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConfigError(f"`seed={seed!r}` must be an integer or null.")
    _check_accumulation(cfg)


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


_ACCUMULATION_CALLBACKS = ("AccumulationScheduler", "GradientAccumulationScheduler")


def _check_accumulation(cfg: DictConfig) -> None:
    """An accumulation callback owns `accumulate_grad_batches`; a global batch must split evenly over the devices."""
    callbacks = cfg.get("callbacks") or {}
    schedulers = [
        (name, node)
        for name, node in callbacks.items()
        if isinstance(node, DictConfig) and str(node.get("_target_", "")).rsplit(".", 1)[-1] in _ACCUMULATION_CALLBACKS
    ]
    if not schedulers:
        return
    if len(schedulers) > 1:
        names = ", ".join(f"`callbacks.{name}`" for name, _ in schedulers)
        raise ConfigError(f"{names} are all accumulation callbacks; keep one (remove others with `~callbacks.NAME`).")
    name, node = schedulers[0]
    accumulate = cfg.trainer.get("accumulate_grad_batches", 1)
    if accumulate != 1:
        raise ConfigError(
            f"`trainer.accumulate_grad_batches={accumulate}` conflicts with `callbacks.{name}`, which sets it per "
            "window; use `accumulation=none` with the callback, or remove it with `~callbacks.{name}`."
        )
    global_batch = node.get("global_batch_size")
    micro = node.get("micro_batch_size")
    world = _world_size(cfg.trainer)
    if isinstance(global_batch, int) and isinstance(micro, int) and micro > 0 and world is not None:
        from lightning_accel.callbacks.accumulation import micro_batches_for

        micro_batches_for(global_batch, micro, world)


def _world_size(trainer: DictConfig) -> int | None:
    """Devices x nodes when the config fixes them; None for "auto" and -1, which depend on the machine."""
    devices, nodes = trainer.get("devices", "auto"), trainer.get("num_nodes", 1)
    if isinstance(devices, ListConfig | list):
        count = len(devices)
    elif isinstance(devices, str) and "," in devices:
        count = len([d for d in devices.split(",") if d.strip()])
    elif isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
        count = devices
    elif isinstance(devices, str) and devices.strip().isdigit() and int(devices) > 0:
        count = int(devices)
    else:
        return None
    return count * nodes if isinstance(nodes, int) else None
