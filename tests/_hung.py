"""A hung run's Python stacks: SIGABRT to its process group, where faulthandler (`PYTHONFAULTHANDLER=1`) prints every
thread's stack in every process (child ranks and DataLoader workers too)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import psutil

__all__ = ["stacks_of_hung_run", "without_module_lists"]


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
