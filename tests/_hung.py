"""Running a test's subprocess so that a hang says where it hung: past its timeout every process under it gets SIGABRT,
on which faulthandler (`PYTHONFAULTHANDLER=1`) prints every thread's stack (child ranks and DataLoader workers too)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

__all__ = ["run_with_stacks", "stacks_of_hung_run", "without_module_lists"]


def run_with_stacks(
    command: Sequence[str], *, env: Mapping[str, str], timeout: float, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`command` in a session of its own with faulthandler on, its output captured.

    Raises:
        subprocess.TimeoutExpired: past `timeout`, with every process's Python stacks in its `stderr`.
    """
    with subprocess.Popen(
        list(command),
        cwd=cwd,
        env={**env, "PYTHONFAULTHANDLER": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the stacks, and the cleanup, reach every process of it
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stdout, stderr = stacks_of_hung_run(proc)
            raise subprocess.TimeoutExpired(proc.args, timeout, output=stdout, stderr=stderr) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def stacks_of_hung_run(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGABRT to the run and every process under it (faulthandler prints every thread's stack), then SIGKILL; its
    output, with faulthandler's lists of extension modules left out (one per process, interleaved, they pushed the
    stacks out of the failure message).

    Signalled one by one, not only through the run's process group: torchrun starts each rank in a session of its
    own, and a rank left alive would hold the output pipes open, so reading them would wait for ever."""
    tree = _tree(proc.pid)
    for sig, grace in ((signal.SIGABRT, 20.0), (signal.SIGKILL, 20.0)):
        for pid in tree:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)  # and whatever else is in the run's group (started after the tree was read)
        try:
            stdout, stderr = proc.communicate(timeout=grace)
            return stdout, without_module_lists(stderr)
        except subprocess.TimeoutExpired:
            tree = _tree(proc.pid) or tree
    stdout, stderr = proc.communicate(timeout=grace)
    return stdout, without_module_lists(stderr)


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants, children first (so a launcher does not restart a rank it sees die)."""
    try:
        root = psutil.Process(pid)
        return [child.pid for child in reversed(root.children(recursive=True))] + [pid]
    except psutil.Error:
        return [pid]


def without_module_lists(text: str) -> str:
    """`text` without faulthandler's "Extension modules: ..." lines (and their interleaved fragments)."""
    keep = []
    for line in text.splitlines():
        stack = 'File "' in line or "Thread 0x" in line or "thread 0x" in line or "Fatal Python" in line
        if stack or ("Extension modules" not in line and "(total: " not in line and line.count(", ") < 4):
            keep.append(line)
    return "\n".join(keep)
