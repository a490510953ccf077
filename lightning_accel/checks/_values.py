"""What several checks share: how a value is shown in a message, and the integer and choice checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_accel.errors import ConfigError

__all__: list[str] = []


_EXAMPLE_DATA = {
    "GPTLanguageModel": ("StdlibTextDataModule", "stdlib_text", "gpt"),
    "DigitsClassifier": ("DigitsDataModule", "digits", "classifier"),
}


def _show(value: Any) -> str:
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    return repr(value)


def _check_choice(setting: str, value: Any, choices: Sequence[str], hint: str = "") -> None:
    if isinstance(value, (DictConfig, Mapping)) and "_target_" in value:
        return
    if str(value) not in choices:
        options = ", ".join(f"`{c}`" for c in choices)
        hint = f" {hint}" if hint else ""
        raise ConfigError(f"`{setting}={_show(value)}` is not supported; use one of {options}{hint}.")


def _check_int(setting: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"`{setting}={_show(value)}` must be an integer >= {minimum}.")


_CPU_OVERSUBSCRIPTION = 4  # CPU ranks per usable CPU still accepted: tests run 4 pipeline ranks on 2 cores
