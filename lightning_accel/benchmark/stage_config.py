"""Compose a stage's Hydra config from the packaged tree: the presets, the built-in stages, the default ladder."""

from __future__ import annotations

import re
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from omegaconf import DictConfig, open_dict

from lightning_accel.errors import ConfigError

__all__ = [
    "BUILTIN_STAGES",
    "CONF_MODULE",
    "available_presets",
    "compose_config",
    "compose_user_config",
    "default_ladder",
    "hydra_value",
    "stage_overrides",
]

CONF_MODULE = "lightning_accel.conf"
# Stages the bench knows without a preset file: the article's last rung, "model parallel + gradient accumulation +
# OneCycleLR", built from the groups that exist (a preset of the same name, when one is added, wins).
BUILTIN_STAGES: dict[str, list[str]] = {
    "model_parallel": ["preset=ddp", "strategy=model_parallel", "accumulation=fixed", "scheduler=onecycle"],
    "amp_compile": ["preset=amp", "compile=default"],  # amp + torch.compile: the one-GPU rung (`--profile gpu`)
}
_MODEL_PARALLEL_PRESETS = ("model_parallel",)  # a preset of this name replaces the built-in stage


def available_presets() -> list[str]:
    """The presets of the packaged config tree (`conf/preset/*.yaml`)."""
    folder = resources.files(CONF_MODULE).joinpath("preset")
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def default_ladder(presets: Sequence[str] | None = None) -> list[str]:
    """baseline -> amp -> ddp -> the article's last rung: model parallel + accumulation + OneCycleLR (a `model_parallel`
    preset when the config tree has one, else the built-in stage). `pipeline` is a rung to ask for by name
    (`--ladder baseline,amp,ddp,pipeline`): it pays for deep models on slow interconnects, not in general."""
    presets = available_presets() if presets is None else presets
    last = next((p for p in _MODEL_PARALLEL_PRESETS if p in presets), "model_parallel")
    return ["baseline", "amp", "ddp", last]


def stage_overrides(name: str, presets: Sequence[str]) -> list[str]:
    """The overrides that select a stage; ConfigError naming the available ones for an unknown name."""
    if name in presets:
        return [f"preset={name}"]
    if name in BUILTIN_STAGES:
        return list(BUILTIN_STAGES[name])
    known = ", ".join(sorted({*presets, *BUILTIN_STAGES}))
    raise ConfigError(f"`--ladder` stage `{name}` is not a preset or a built-in stage; use any of: {known}.")


def compose_config(overrides: Sequence[str], run_dir: str) -> DictConfig:
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from lightning_accel.launch import register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONF_MODULE, version_base="1.3"):
            cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
            with open_dict(cfg):
                cfg.hydra.runtime.output_dir = run_dir
                cfg.hydra.job.num = 0
            HydraConfig.instance().set_config(cfg)
            return cfg
    finally:
        GlobalHydra.instance().clear()


def compose_user_config(overrides: Sequence[str], run_dir: str) -> DictConfig:
    """Compose and check the user's overrides alone (no preset): a bad one is the user's error, before any stage.

    Raises:
        ConfigError: for an override Hydra rejects or a setting `check_config` rejects.
    """
    from lightning_accel.checks import check_config
    from lightning_accel.schema import composition_error
    from lightning_accel.shape import run_shape

    try:
        cfg = compose_config(overrides, run_dir)
    except Exception as err:  # Hydra's own errors name the override and list the options
        named = composition_error(err)
        if named is not None:
            raise named from None
        raise ConfigError(f"the Hydra overrides {list(overrides)} do not compose: {err}") from None
    check_config(cfg, shape=run_shape(cfg))  # compose -> shape -> checks
    return cfg


def hydra_value(path: Path) -> str:
    """A path as a Hydra override value: quoted when it holds characters the override grammar reads (space, =, ...)."""
    text = str(path)
    if re.fullmatch(r"[\w/.\-]+", text):
        return text
    # Hydra's quoted strings read a backslash as an escape only before a quote or at the end of the string
    escaped = re.sub(r"(\\+)(?='|$)", r"\1\1", text).replace("'", "\\'")
    return "'" + escaped + "'"
