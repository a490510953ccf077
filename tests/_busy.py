"""CPU-bound processes that are not ours: what another job on a shared machine looks like to the code under test.

Each is started through a shell that exits at once, so init adopts it: it is no descendant of the test process,
and an `InterferenceProbe` counts its CPU time as another's, as it would a user's other job.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import psutil
from _wait import wait_until


def start_busy_processes(count: int = 1) -> list[int]:
    """Start `count` processes that spin in Python; returns their pids (kill them with `stop_processes`)."""
    pids = []
    for _ in range(count):
        out = subprocess.run(
            ["sh", "-c", f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        pids.append(int(out))
    return pids


def stop_processes(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


@contextlib.contextmanager
def busy(count: int = 1, spun_s: float = 0.1, timeout_s: float = 30.0) -> Iterator[list[int]]:
    """`count` busy processes for the duration of the block, entered once each has used `spun_s` of CPU (it then
    spins: Python starts in less)."""
    pids = start_busy_processes(count)
    try:
        wait_until(lambda: all(_cpu_s(pid) >= spun_s for pid in pids), timeout_s, f"{count} busy process(es) to spin")
        yield pids
    finally:
        stop_processes(pids)
