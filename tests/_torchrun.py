"""Running a test's case script on several CPU processes under torchrun, and reading what each rank wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from _hung import run_with_stacks

TESTS = Path(__file__).parent


def torchrun(
    script: str | os.PathLike[str], *args: str, ranks: int = 2, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """`python -m torch.distributed.run --standalone --nproc-per-node=RANKS SCRIPT ARGS`, capturing output; the
    script's folder and `tests/` are on its PYTHONPATH (for its sibling and shared helper modules).

    Raises:
        subprocess.TimeoutExpired: past `timeout`, with every process's Python stacks in its `stderr` (a hang says
            where each rank waits).
    """
    path = os.pathsep.join([str(Path(script).parent), str(TESTS), os.environ.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(script)]
    return run_with_stacks([*command, *args], env={**os.environ, "PYTHONPATH": path, **(env or {})}, timeout=timeout)


def rank_results(
    script: str | os.PathLike[str],
    out: Path,
    *args: str,
    ranks: int = 2,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> list[dict[str, Any]]:
    """Run `script OUT ARGS` under torchrun, assert it succeeded, and return each rank's `OUT/rank<k>.json`."""
    proc = torchrun(script, str(out), *args, ranks=ranks, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)]
