"""What the parts of the GPU check share: the `Part` each returns, the `CheckContext` they run in, `Skip` for a part
that cannot run here, and running one of the project's commands into a log."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["CheckContext", "Part", "Skip", "log_tail", "need_cuda", "run_command"]


@dataclass(kw_only=True, slots=True)
class Part:
    """The outcome of one part of the check."""

    name: str
    status: str = "PASS"
    """PASS, FAIL or SKIP."""
    detail: str = ""
    figures: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass(kw_only=True, slots=True)
class CheckContext:
    """What the parts of one check share: where they write, and figures a later part reads (the hand-timed matmul's
    TFLOP/s for the ladder's MFU cross-check, the preset accel-tune wrote)."""

    out_dir: Path
    facts: dict[str, object] = field(default_factory=dict)
    timeout_scale: float = 1.0
    """Multiplies the subprocess timeouts of `--full` (a slower GPU than an H200)."""


class Skip(Exception):
    """A part that cannot run here, with the reason."""


def need_cuda() -> None:
    if not torch.cuda.is_available():
        raise Skip(f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})")


def run_command(command: list[str], log: Path, timeout: float) -> int:
    """Run one of the project's commands, its output into `log`; the exit code (124 after `timeout` seconds)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        try:
            return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124


def log_tail(log: Path, lines: int = 3) -> str:
    text = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    return " / ".join(text[-lines:])
