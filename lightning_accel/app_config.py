"""`check_app_config(cfg)`: what your own Hydra app (lightning-hydra-template's `train.py`) calls after composing, so
that every setting of this package's groups that you chose is applied, or you are told why not, before launch.

Composed into another app, this package's groups meet configs they were not written with. Each rule here is one way
a choice could otherwise be lost without a word, found by running the real template:

- a group option's callback dropped by a later `callbacks: null` (the template's debug configs);
- a top-level key a group writes that nothing in the app reads (`scheduler=onecycle` writes `scheduler`, but the
  template's model reads `model.scheduler`);
- a preset's `trainer.devices: auto` over a device count your own trainer config sets (`trainer=ddp_sim`'s 2: on a
  CPU `auto` is 1 process): your count is kept, and the log says so.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from lightning_accel.checks import check_config
from lightning_accel.shape import count_devices

__all__ = ["GROUP_CALLBACKS", "UNREAD_KEYS", "check_app_config"]

log = logging.getLogger(__name__)

GROUP_CALLBACKS: dict[tuple[str, str], str] = {
    ("accumulation", "schedule"): "accumulation",
    ("accumulation", "global_batch"): "accumulation",
    ("preset", "amp"): "dataloader_tuner",
    ("preset", "ddp"): "dataloader_tuner",
    ("micro_batch", "auto"): "micro_batch",
    ("compile", "default"): "compile",
    ("compile", "reduce-overhead"): "compile",
    ("compile", "max-autotune"): "compile",
    ("lr_scaling", "linear"): "lr_scaling",
    ("lr_scaling", "sqrt"): "lr_scaling",
    **{
        ("precision", option): "matmul_precision"
        for option in ("fp32", "amp", "bf16_mixed", "fp16_mixed", "bf16_true", "fp8")
    },
}
"""(group, option) -> the callback (a key of `callbacks`) the option adds; without it the run trains differently
from what the option says."""

UNREAD_KEYS: dict[str, tuple[str, str]] = {
    "scheduler": (
        "model.scheduler",
        "write `scheduler: ${oc.select:scheduler,null}` in your model config (README, "
        '"From lightning-hydra-template", step 2), so the model builds the schedule the group chose',
    ),
    "ddp_grad_compression": (
        "",
        "instantiate the Trainer with `**build_run_plan(cfg, check_run(cfg)).trainer_kwargs(cfg)` "
        "(`lightning_accel.run_plan`, `lightning_accel.checks`; accel-train does), or leave it at `none`",
    ),
}
"""Top-level keys this package's groups write -> (where an app's model usually expects it, how to read it). A chosen
value that no interpolation in the app's config reads is a warning."""
_INERT = {"ddp_grad_compression": "none"}  # values that ask for nothing


def check_app_config(cfg: DictConfig) -> list[str]:
    """Check a composed config of your own Hydra app against what this package's groups need; warn for each choice
    that would not be applied, and keep your own device count over a preset's `auto`. Returns the warnings.

    `check_config` runs where the config has this package's shape (`trainer`, `model` and `data` with targets).
    Call it first thing in your task function, before you instantiate anything; it may set `cfg.trainer.devices`
    (see `_keep_own_devices`).

    Raises:
        ConfigError: what `check_config` raises.
    """
    from hydra.core.hydra_config import HydraConfig
    from lightning.pytorch.utilities import rank_zero_warn

    from lightning_accel.errors import LightningAccelWarning

    if all(isinstance(cfg.get(n), DictConfig) and "_target_" in cfg.get(n) for n in ("trainer", "model", "data")):
        check_config(cfg)
    hydra = HydraConfig.get() if HydraConfig.initialized() else None
    choices = {k: v for k, v in dict(hydra.runtime.choices).items() if v not in (None, "null")} if hydra else {}
    task = list(hydra.overrides.task) if hydra else []
    warnings = [*_dropped_callbacks(cfg, choices, task), *_unread_keys(cfg, choices), *_keep_own_devices(cfg, task)]
    for message in warnings:
        rank_zero_warn(message, category=LightningAccelWarning)
    return warnings


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _dropped_callbacks(cfg: DictConfig, choices: dict[str, str], task: list[str]) -> list[str]:
    """A chosen option whose callback the composed config lacks, unless the command line removed it on purpose
    (`~callbacks.dataloader_tuner`, `callbacks.dataloader_tuner=null`)."""
    callbacks = cfg.get("callbacks")
    removed = {_key(o) for o in task if o.startswith("~") or o.endswith(("=null", "=None"))}
    warnings = []
    for (group, option), name in GROUP_CALLBACKS.items():
        if choices.get(group) != option or (callbacks is not None and callbacks.get(name) is not None):
            continue
        if f"callbacks.{name}" in removed or "callbacks" in removed:
            continue
        if callbacks is None:
            why = "`callbacks` is null in the composed config (lightning-hydra-template's debug configs set it so)"
        elif "debug" in choices:
            why = (
                f"`debug={choices['debug']}` empties `callbacks` after it (lightning-hydra-template's debug configs "
                "set `callbacks: null`)"
            )
        else:
            why = f"something after `{group}` in the defaults list removed `callbacks.{name}`"
        warnings.append(
            f"`{group}={option}` adds `callbacks.{name}`, but the composed config has no such callback: "
            f"{why}. The run does not do what `{group}={option}` says. Put `{group}` after the config "
            f"that empties `callbacks` in your defaults list, or add the callback back; to go without it, "
            f"say so with `~callbacks.{name}`."
        )
    return warnings


def _unread_keys(cfg: DictConfig, choices: dict[str, str]) -> list[str]:
    """A top-level key a group wrote (a value that asks for something) that no interpolation anywhere reads."""
    raw = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(raw, dict)
    warnings = []
    for key, (expected, fix) in UNREAD_KEYS.items():
        value = raw.get(key)
        if value is None or value == _INERT.get(key):
            continue
        rest = repr({k: v for k, v in raw.items() if k != key})
        if re.search(r"\$\{(oc\.select:\s*)?" + re.escape(key) + r"\b", rest):
            continue
        group = key if key in choices else next((g for g in ("strategy", "preset") if g in choices), key)
        chosen = f"`{group}={choices[group]}`" if group in choices else f"`{key}`"
        where = OmegaConf.select(cfg, expected, default=None) if expected else None
        target = f" ({where.get('_target_')})" if isinstance(where, DictConfig) and "_target_" in where else ""
        reads = (
            f"; your model reads `{expected}`{target} instead"
            if expected and OmegaConf.select(cfg, expected, default="__missing__") != "__missing__"
            else ""
        )
        warnings.append(
            f"{chosen} sets the top-level `{key}`, but nothing in your config reads it{reads}, so it is "
            f"not applied: {fix}."
        )
    return warnings


def _keep_own_devices(cfg: DictConfig, task: list[str]) -> list[str]:
    """A preset's `trainer.devices` over your trainer config's count: your count of two or more devices (a list,
    -1) is kept and logged; a single device the preset changes is a warning with both numbers."""
    if "trainer.devices" in {_key(o) for o in task} or not isinstance(cfg.get("trainer"), DictConfig):
        return []
    own = _composed_without_preset()
    if own is None or not isinstance(own.get("trainer"), DictConfig):
        return []
    mine, theirs = own.trainer.get("devices"), cfg.trainer.get("devices")
    if _plain(mine) == _plain(theirs):
        return []
    from hydra.core.hydra_config import HydraConfig

    preset = HydraConfig.get().runtime.choices.get("preset")
    count = count_devices(mine)
    if isinstance(mine, (ListConfig, list)) or mine == -1 or (count is not None and count > 1):
        with open_dict(cfg):
            cfg.trainer.devices = mine
        from lightning.pytorch.utilities import rank_zero_info

        rank_zero_info(
            f"`preset={preset}` sets `trainer.devices={_plain(theirs)}`; your trainer config's "
            f"`trainer.devices={_plain(mine)}` is kept"
        )
        return []
    return [
        f"`preset={preset}` sets `trainer.devices={_plain(theirs)}` over your trainer config's "
        f"`trainer.devices={_plain(mine)}`: {_devices_here(cfg, theirs)} here. Pass `trainer.devices=N` to choose."
    ]


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


def _devices_here(cfg: DictConfig, devices: Any) -> str:
    """How many processes `devices` means on this machine, in words."""
    from lightning_accel.shape import run_shape

    count = count_devices(devices)
    if count is None:
        shape = run_shape(cfg)
        count = shape.visible_cuda if shape.on_cuda else 1  # Lightning's `auto` on a CPU is one process
    return f"{count} process{'es' if count != 1 else ''}"


def _composed_without_preset() -> DictConfig | None:
    """The running app's config composed again with `preset=null`: what your own configs set. None outside a Hydra
    app, without a preset, or when it cannot be composed (a launcher that runs the job elsewhere)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    if not (HydraConfig.initialized() and GlobalHydra.instance().is_initialized()):
        return None
    hydra = HydraConfig.get()
    if hydra.runtime.choices.get("preset") in (None, "null"):
        return None
    from hydra import compose

    overrides = [o for o in hydra.overrides.task if _key(o) != "preset"]
    # an override of a key the preset brings (`callbacks.dataloader_tuner.max_tuning_time_s=10`) has nothing to
    # override without it: then the group choices and the trainer's and Hydra's own keys, all the devices depend on
    trainer_only = [o for o in overrides if "." not in _key(o) or _key(o).startswith(("trainer.", "hydra."))]
    own = None
    for attempt in (overrides, trainer_only) if trainer_only != overrides else (overrides,):
        try:
            own = compose(config_name=hydra.job.config_name, overrides=attempt, return_hydra_config=True)
            if own.hydra.runtime.choices.get("preset") not in (None, "null"):  # the app's defaults list chose it
                own = compose(
                    config_name=hydra.job.config_name, overrides=[*attempt, "~preset"], return_hydra_config=True
                )
            break
        except Exception as err:  # a check that cannot run must not stop the app
            log.debug("could not compose the config without the preset from %s: %s", attempt, err)
            own = None
    if own is None:
        return None
    with open_dict(own):
        del own["hydra"]
    return own
