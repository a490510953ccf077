"""Interference, measured rather than assumed: what else ran on the CPUs (and GPUs) this process may use while a
measurement ran.

`InterferenceProbe` watches one window: the CPU time that processes other than ours took from the CPUs we may run on
(psutil's per-CPU times minus our process tree's own time), steal time, the load average at the start and the end,
and on CUDA other processes on the GPUs (`nvml_compute_pids`). A window during which others held more than
`threshold` of our CPUs, while fewer CPUs than our budget (affinity, cgroup quota: `system.cgroup`) stayed idle, is
flagged with the reason. accel-bench, accel-tune, the DataLoaderTuner and `accel-doctor` read it; the medians and
intervals of what was measured are `lightning_accel.measure`'s.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "INTERFERENCE_THRESHOLD",
    "STEAL_THRESHOLD",
    "Interference",
    "InterferenceProbe",
    "nvml_compute_pids",
    "read_cpu_seconds",
]

INTERFERENCE_THRESHOLD = 0.10
"""A measurement is flagged when other processes took more than this share of the CPUs we may run on ..."""
MIN_OTHER_CPUS = 0.2
"""... and at least this many CPUs' worth (jiffy rounding on a short window stays under it)."""
STEAL_THRESHOLD = 0.05
"""... or when the hypervisor stole more than this share of our CPUs' time."""


def _allowed_cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        return None


def read_cpu_seconds(
    cpus: Iterable[int] | None = None, per_cpu: Sequence[Any] | None = None
) -> tuple[float, float] | None:
    """(busy, steal) CPU seconds since boot summed over `cpus` (all CPUs when None), from psutil's per-CPU times, or
    None when they cannot be read. Busy is user + nice + system + irq + softirq (guest time is within user).

    Args:
        cpus: CPU numbers (this process's affinity).
        per_cpu: `psutil.cpu_times(percpu=True)` as read (tests hand in their own); None reads it.
    """
    if per_cpu is None:
        import psutil

        try:
            per_cpu = psutil.cpu_times(percpu=True)
        except (OSError, RuntimeError):
            return None
    wanted = None if cpus is None else set(cpus)
    busy = steal = 0.0
    found = False
    for index, t in enumerate(per_cpu):
        if wanted is not None and index not in wanted:
            continue
        busy += t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
        steal += getattr(t, "steal", 0.0)
        found = True
    return (busy, steal) if found else None


def _family_pids(extra_pids: Iterable[int]) -> set[int]:
    """This process, the given processes and all their descendants alive now."""
    import psutil

    pids = {os.getpid(), *extra_pids}
    for pid in list(pids):
        try:
            pids.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            continue
    return pids


def _family_cpu_s(extra_pids: Iterable[int]) -> float:
    """CPU seconds of `_family_pids`, each with the CPU time of the children it has reaped: a process that ends
    within a window moves its time into its reaper's, so the sum's change over the window counts every second of
    ours once."""
    import psutil

    total = 0.0
    for pid in _family_pids(extra_pids):
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:  # gone since it was listed: its time is in its reaper's
            continue
        total += t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)
    return total


def _load_1m() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class Interference:
    """What else ran on the machine during one measurement window."""

    wall_s: float
    cpus: int
    """CPUs this process may run on (its affinity)."""
    other_cpu_s: float | None
    """CPU seconds other processes took on those CPUs; None when the CPU times are unreadable."""
    own_cpu_s: float
    steal_s: float | None
    load_start: float | None
    load_end: float | None
    gpu_processes: tuple[int, ...] = ()
    """PIDs of other processes on the GPUs (NVML), as far as this process can see them."""
    flagged: bool = False
    reasons: tuple[str, ...] = ()

    @property
    def other_cpus(self) -> float | None:
        """Other processes' CPU use, in CPUs (1.0 = one CPU kept busy the whole window)."""
        return None if self.other_cpu_s is None or self.wall_s <= 0 else self.other_cpu_s / self.wall_s

    def describe(self) -> str:
        """One line: the flag's reasons, or what was seen on a quiet window."""
        if self.flagged:
            return "; ".join(self.reasons)
        if self.other_cpus is None:
            return "interference not measured (the CPU times are unreadable)"
        return f"quiet: others used {self.other_cpus:.2f} of {self.cpus} CPU(s)"

    def as_dict(self) -> dict[str, object]:
        return {
            "wall_s": self.wall_s,
            "cpus": self.cpus,
            "other_cpu_s": self.other_cpu_s,
            "other_cpus": self.other_cpus,
            "own_cpu_s": self.own_cpu_s,
            "steal_s": self.steal_s,
            "load_start": self.load_start,
            "load_end": self.load_end,
            "gpu_processes": list(self.gpu_processes),
            "flagged": self.flagged,
            "reasons": list(self.reasons),
        }


@dataclass(kw_only=True)
class InterferenceProbe:
    """Measures the interference over a window: `start()`, the measured work, `stop()`.

    Ours is this process, `pids` (other ranks, a stage's process) and all their descendants, dead or alive; others are
    everything else on the CPUs this process may run on. Use as a context manager (`with probe: ...`, then
    `probe.result`) or call `start`/`stop`.

    Args:
        pids: more processes of ours (their descendants count too), read at start and at stop.
        threshold: flag when others took more than this share of our CPUs (and at least `MIN_OTHER_CPUS`) while
            fewer CPUs stayed idle than our budget (`budget_cpus`, less `threshold`): they took time our threads
            could have used. Others on a large host's idle cores, beyond a CPU quota, took nothing from us.
        steal_threshold: flag when steal time exceeds this share of our CPUs' time.
        gpu_pids: returns the PIDs on the GPUs we use (None when unknown); any one not ours that this process can see
            flags the window.
        cpu_times: the per-CPU times (`psutil.cpu_times(percpu=True)`; tests hand in scripted ones).
        clock: the wall clock.
        budget_cpus: the CPUs our work may use; None: `system.cgroup.read_cpu_budget().effective`
            (affinity and cgroup CPU quota).
    """

    pids: Callable[[], Iterable[int]] = tuple
    threshold: float = INTERFERENCE_THRESHOLD
    steal_threshold: float = STEAL_THRESHOLD
    gpu_pids: Callable[[], Iterable[int] | None] | None = None
    cpu_times: Callable[[], Sequence[Any]] | None = None
    clock: Callable[[], float] = time.perf_counter
    budget_cpus: float | None = None
    result: Interference | None = field(default=None, init=False)
    _start: tuple[float, tuple[float, float] | None, float, float | None] | None = field(default=None, init=False)
    _gpu_seen: set[int] = field(default_factory=set, init=False)

    def _cpus(self) -> set[int] | None:
        return _allowed_cpus()

    def _budget(self) -> float:
        """CPUs our work may use: `budget_cpus`, else the cgroup-aware budget (`system.cgroup.read_cpu_budget`)."""
        if self.budget_cpus is not None:
            return float(self.budget_cpus)
        try:
            from lightning_accel.system.cgroup import read_cpu_budget

            return float(read_cpu_budget().effective)
        except Exception:  # facts that cannot be read: every CPU
            return float(len(self._cpus() or ()) or (os.cpu_count() or 1))

    def _read(self, cpus: set[int] | None) -> tuple[float, float] | None:
        try:
            return read_cpu_seconds(cpus, self.cpu_times() if self.cpu_times is not None else None)
        except Exception:  # a reading that fails: interference not measured
            return None

    def start(self) -> None:
        self.result = None
        self._gpu_seen = set(self._gpu_others())
        cpus = self._cpus()
        self._start = (self.clock(), self._read(cpus), _family_cpu_s(self.pids()), _load_1m())

    def stop(self) -> Interference:
        assert self._start is not None, "InterferenceProbe.stop() before start()"
        own_end, times_end, end = _family_cpu_s(self.pids()), self._read(self._cpus()), self.clock()
        started, times_start, own_start, load_start = self._start
        wall, own = max(0.0, end - started), max(0.0, own_end - own_start)
        cpus = len(self._cpus() or ()) or (os.cpu_count() or 1)
        other = steal = None
        if times_start is not None and times_end is not None:
            busy = times_end[0] - times_start[0]
            other, steal = max(0.0, busy - own), max(0.0, times_end[1] - times_start[1])
        gpu = tuple(sorted(self._gpu_seen | set(self._gpu_others())))
        reasons = []
        # Others took CPU we could have used when fewer CPUs than our budget stayed idle. Average use hides the cost:
        # torch's intra-op threads want every CPU of the budget at once, so one busy core slows a step that averages
        # well below full use. Others on a large host's idle cores (under a CPU quota) took nothing from us.
        idle = cpus - (other + own) / wall if other is not None and wall > 0 else math.inf
        contended = idle < min(float(cpus), self._budget()) * (1.0 - self.threshold)
        if contended and other is not None and other / wall > max(MIN_OTHER_CPUS, self.threshold * cpus):
            reasons.append(f"other processes used {other / wall:.2f} of {cpus} CPU(s) ({other / wall / cpus:.0%})")
        if steal is not None and wall > 0 and steal / (wall * cpus) > self.steal_threshold:
            reasons.append(f"the hypervisor stole {steal / (wall * cpus):.0%} of the CPU time")
        if gpu:
            reasons.append(f"{len(gpu)} other process(es) on the GPU (pid {', '.join(map(str, gpu[:5]))})")
        self.result = Interference(
            wall_s=wall,
            cpus=cpus,
            other_cpu_s=other,
            own_cpu_s=own,
            steal_s=steal,
            load_start=load_start,
            load_end=_load_1m(),
            gpu_processes=gpu,
            flagged=bool(reasons),
            reasons=tuple(reasons),
        )
        self._start = None
        return self.result

    def _gpu_others(self) -> list[int]:
        if self.gpu_pids is None:
            return []
        try:
            found = self.gpu_pids()
        except Exception:  # monitoring never stops the measurement
            return []
        if not found:
            return []
        import psutil

        ours = _family_pids(self.pids())
        # NVML reports PIDs of the host's namespace: one this process cannot see is not taken for another's
        return [pid for pid in found if pid not in ours and psutil.pid_exists(pid)]

    def __enter__(self) -> InterferenceProbe:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def nvml_compute_pids(indices: Iterable[int] | None = None) -> set[int] | None:
    """PIDs of the compute processes NVML lists on the GPUs at `indices` (all when None); None when NVML cannot say.

    For `InterferenceProbe(gpu_pids=...)`; initialises and shuts down NVML around the call.
    """
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        pids: set[int] = set()
        for index in range(count) if indices is None else indices:
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                pids.update(int(p.pid) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
            except Exception:  # a device this process may not open, or an old driver: not known
                continue
        return pids
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
