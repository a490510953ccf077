"""A configuration accel-tune found, written as a preset: `preset=tuned_<name>` for accel-train and accel-bench."""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Collection, Sequence
from dataclasses import replace
from pathlib import Path

from omegaconf import OmegaConf

from lightning_accel.autotune.search import GROUPS, Candidate, Outcome
from lightning_accel.errors import ConfigError, FileOperationError
from lightning_accel.files import atomic_write, directory_write_error

__all__ = [
    "check_preset_name",
    "pinned",
    "preset_path",
    "preset_write_error",
    "preset_yaml",
    "settled_of",
    "write_preset",
]

_NAME = re.compile(r"^[A-Za-z0-9_]+$")


_MICRO_BATCH = "callbacks.micro_batch.micro_batch_size"


def _text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def settled_of(
    loader: dict[str, object] | None,
    micro_batch: int | None,
    micro_batch_auto: bool,
    choices: Collection[tuple[str, str]] = (),
) -> tuple[tuple[str, str], ...]:
    """What a run decided for itself, as settings a preset can pin: the DataLoaderTuner's `loader` decision as
    `data.<key>` (prefetch_factor only with workers), and MicroBatchFinder's size when the candidate searched for it
    (`micro_batch=auto` among its `choices`)."""
    loader = loader or {}
    settled = [
        (f"data.{key}", _text(value))
        for key, value in loader.items()
        if value is not None and not (key == "prefetch_factor" and not loader.get("num_workers"))
    ]
    if micro_batch_auto and micro_batch and ("micro_batch", "auto") in choices:
        settled.append((_MICRO_BATCH, str(int(micro_batch))))
    return tuple(sorted(settled))


def pinned(outcome: Outcome, loader_keys: Collection[str]) -> tuple[Candidate, list[str]]:
    """The outcome's candidate with what its run settled pinned as settings, and a comment line per kind of pin.

    DataLoader settings are pinned only where the user's data config takes them (`loader_keys`: the keys under
    `data`); the DataLoaderTuner stays in the preset, so the run starts from the measured workers and the tuner keeps
    checking them (the data wait) and tunes again where they no longer hold. The micro-batch is pinned as
    MicroBatchFinder's starting size: no search at start, out-of-memory recovery still halves it.
    """
    choices = dict(outcome.candidate.choices)
    loader = {k: v for k, v in outcome.settled if k.startswith("data.") and k.split(".", 1)[1] in loader_keys}
    micro = dict(outcome.settled).get(_MICRO_BATCH)
    comment: list[str] = []
    if loader:
        choices.update(loader)
        found = ", ".join(f"{k}={v}" for k, v in sorted(loader.items()))
        comment.append(
            f"the DataLoaderTuner's decision in the measured runs: {found} (the tuner stays: it checks the "
            "data wait and tunes again where these no longer hold)"
        )
    if micro is not None:
        choices[_MICRO_BATCH] = micro
        comment.append(
            f"MicroBatchFinder's size in the measured runs: micro_batch_size={micro}: each loader batch "
            f"runs as micro-batches of {micro} with their gradients accumulated inside its optimizer step "
            f"(the global batch unchanged); `++{_MICRO_BATCH}=auto` searches again"
        )
    return replace(outcome.candidate, choices=tuple(sorted(choices.items()))), comment


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


def check_preset_name(name: str) -> None:
    """ConfigError for a preset name that is not letters, digits and underscores (it becomes a file name)."""
    if not _NAME.match(name):
        raise ConfigError(f"`name={name!r}`: a preset name takes letters, digits and underscores only.", setting="name")


def write_preset(
    config_dir: str | os.PathLike[str], name: str, candidate: Candidate, comment: Sequence[str] = ()
) -> Path:
    """Write `<config_dir>/preset/tuned_<name>.yaml` atomically and return its path; run it with
    `accel-train 'hydra.searchpath=[file://<config_dir>]' preset=tuned_<name>`.

    Raises:
        ConfigError: for a name that is not letters, digits and underscores.
    """
    check_preset_name(name)
    return atomic_write(preset_path(config_dir, name), preset_yaml(candidate, comment))


def preset_path(config_dir: str | os.PathLike[str], name: str) -> Path:
    """Where the preset `tuned_<name>` goes: `<config_dir>/preset/tuned_<name>.yaml`."""
    return Path(config_dir) / "preset" / f"tuned_{name}.yaml"


def preset_write_error(config_dir: str | os.PathLike[str], name: str) -> FileOperationError | None:
    """Why the preset could not be written (a file where `config_dir` or its `preset` folder belongs, a directory
    where the preset file goes, a read-only directory), or None: asked before the search, not after it."""
    path = preset_path(config_dir, name)
    if path.is_dir():
        return FileOperationError("write preset", path, IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR)))
    return directory_write_error(path.parent)
