"""A configuration accel-tune found, written as a preset: `preset=tuned_<name>` for accel-train and accel-bench."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

from omegaconf import OmegaConf

from lightning_accel.benchmark.search import GROUPS, Candidate
from lightning_accel.errors import ConfigError

__all__ = ["preset_yaml", "write_preset"]

_NAME = re.compile(r"^[A-Za-z0-9_]+$")


def preset_yaml(candidate: Candidate, comment: Sequence[str] = ()) -> str:
    """The preset file of `candidate`: `# @package _global_`, a defaults list overriding its config groups, and its
    settings as nested keys (typed as YAML reads them: `true`, `2`)."""
    lines = ["# @package _global_", *(f"# {line}" for line in comment)]
    groups = [(k, v) for k, v in candidate.choices if k in GROUPS]
    settings = [f"{k}={v}" for k, v in candidate.choices if k not in GROUPS]
    if groups:
        lines.append("defaults:")
        lines += [f"  - override /{key}: {value}" for key, value in groups]
    if settings:
        lines.append(OmegaConf.to_yaml(OmegaConf.from_dotlist(settings)).rstrip("\n"))
    return "\n".join(lines) + "\n"


def write_preset(config_dir: str | os.PathLike[str], name: str, candidate: Candidate,
                 comment: Sequence[str] = ()) -> Path:  # fmt: skip
    """Write `<config_dir>/preset/tuned_<name>.yaml` atomically and return its path; run it with
    `accel-train 'hydra.searchpath=[file://<config_dir>]' preset=tuned_<name>`.

    Raises:
        ConfigError: for a name that is not letters, digits and underscores.
    """
    if not _NAME.match(name):
        raise ConfigError(f"`name={name!r}`: a preset name takes letters, digits and underscores only.", setting="name")
    folder = Path(config_dir) / "preset"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"tuned_{name}.yaml"
    with tempfile.NamedTemporaryFile("w", dir=folder, prefix=f".{path.name}.", delete=False) as tmp:
        tmp.write(preset_yaml(candidate, comment))
    os.replace(tmp.name, path)
    return path
