"""The `accel-train` console entry point: the thread environment that must be set before torch loads, then the
command, handed off by name.

libgomp reads `OMP_WAIT_POLICY` once, when `import torch` loads it, so `set_early_environment` runs first (it imports
no torch). The command, `lightning_accel.train`, is imported by name only then, and it loads torch and Lightning only
once Hydra has composed a run: `--help`, `--cfg job` and a config that does not compose are answered before.
`python -m lightning_accel.train` sets the same environment itself.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib import import_module

__all__ = ["ANSWER_FLAGS", "COMMAND", "accel_train"]

COMMAND = "lightning_accel.train"
"""The module whose `main()` accel-train runs."""

ANSWER_FLAGS = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-sc", "--shell-completion")
"""Hydra's flags that answer and run nothing: torch never loads, so the thread environment is left as it is."""


def _answers_only(argv: Sequence[str]) -> bool:
    return any(arg in ANSWER_FLAGS or arg.startswith(("--cfg=", "--info=")) for arg in argv)


def accel_train() -> None:
    """Console entry point of `accel-train`: the wait policy first, then the command (`COMMAND`'s `main`)."""
    if not _answers_only(sys.argv[1:]):
        from lightning_accel.thread_env import set_early_environment

        set_early_environment(sys.argv[1:])
    import_module(COMMAND).main()
