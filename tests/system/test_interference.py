"""lightning_accel.system.interference: other processes' CPU time on our CPUs, steal time and GPU neighbours, through
scripted per-CPU times and real busy processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_accel.system.interference import InterferenceProbe


class _CpuTimes:
    """Scripted `psutil.cpu_times(percpu=True)`: `set(busy, steal)` spreads the seconds over the CPUs this process may
    run on; one more CPU it may not run on is always busy and never counts."""

    def __init__(self) -> None:
        self.busy = self.steal = 0.0

    def set(self, busy: float, steal: float = 0.0) -> None:
        self.busy, self.steal = busy, steal

    def __call__(self) -> list[Any]:
        from types import SimpleNamespace

        ours = sorted(os.sched_getaffinity(0))
        times = []
        for cpu in range(max(ours) + 2):
            share = 1 / len(ours) if cpu in ours else 0.0
            busy = self.busy * share if cpu in ours else 1e5  # the last one: not ours, busy, ignored
            times.append(
                SimpleNamespace(
                    user=busy, nice=0.0, system=0.0, idle=1000.0, irq=0.0, softirq=0.0, steal=self.steal * share
                )
            )
        return times


def test_interference_is_the_others_cpu_time_on_our_cpus(tmp_path: Path) -> None:
    clock, times = iter([0.0, 1.0]), _CpuTimes()
    probe = InterferenceProbe(cpu_times=times, clock=lambda: next(clock))
    probe.start()
    cpus = len(os.sched_getaffinity(0))
    times.set(busy=0.95 * cpus)  # 95% of our CPUs busy for the second; we used ~0
    result = probe.stop()
    assert result.flagged and "other processes used" in result.reasons[0], result
    assert result.other_cpus == pytest.approx(0.95 * cpus - result.own_cpu_s, abs=0.05)


def test_others_on_cpus_beyond_our_quota_took_nothing_from_us(tmp_path: Path) -> None:
    """A host's other tenants on cores our quota would leave idle anyway are no interference; the same load on the
    CPUs our budget spans is."""
    cpus = len(os.sched_getaffinity(0))
    results = []
    for budget in (0.25 * cpus, float(cpus)):  # a quota of a quarter of the CPUs, then all of them
        clock, times = iter([0.0, 1.0]), _CpuTimes()
        probe = InterferenceProbe(cpu_times=times, clock=clock.__next__, budget_cpus=budget)
        probe.start()
        times.set(busy=0.5 * cpus)  # others keep half the CPUs busy
        results.append(probe.stop())
    assert not results[0].flagged, results[0]
    assert results[1].flagged and results[1].other_cpus == pytest.approx(0.5 * cpus - results[1].own_cpu_s, abs=0.05)


def test_steal_time_flags_a_window(tmp_path: Path) -> None:
    clock, times = iter([0.0, 1.0]), _CpuTimes()
    probe = InterferenceProbe(cpu_times=times, clock=lambda: next(clock))
    probe.start()
    cpus = len(os.sched_getaffinity(0))
    times.set(busy=0.0, steal=0.2 * cpus)
    result = probe.stop()
    assert result.flagged and any("stole" in r for r in result.reasons)


def test_unreadable_cpu_times_are_not_measured_and_not_flagged(tmp_path: Path) -> None:
    def unreadable() -> list[Any]:
        raise OSError("no /proc here")

    with InterferenceProbe(cpu_times=unreadable) as probe:
        pass
    assert probe.result is not None and not probe.result.flagged and probe.result.other_cpu_s is None
    assert "not measured" in probe.result.describe()


def test_another_process_on_the_gpu_flags_the_window() -> None:
    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        with InterferenceProbe(gpu_pids=lambda: {os.getpid(), sleeper.pid, 2**22 + 7}) as probe:
            pass
    finally:
        sleeper.kill()
        sleeper.wait()
    # our own pid is ours (sleep is our child: ours too); a pid this process cannot see is not taken for another's
    assert probe.result is not None and probe.result.gpu_processes == (), probe.result
    with InterferenceProbe(gpu_pids=lambda: {1}) as probe:
        pass
    assert probe.result is not None and probe.result.flagged and probe.result.gpu_processes == (1,)
    assert any("on the GPU (pid 1)" in reason for reason in probe.result.reasons)


SPIN_CHILD = "import time\nt = time.time()\nwhile time.time() - t < 0.4: pass"


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_real_busy_process_is_flagged(busy_process: int) -> None:
    with InterferenceProbe() as probe:
        child = subprocess.Popen([sys.executable, "-c", SPIN_CHILD])
        _spin(0.4)
        child.wait()
    assert probe.result is not None and probe.result.flagged, probe.result
    assert probe.result.other_cpus is not None and probe.result.other_cpus >= 0.5


def test_our_own_children_are_not_interference() -> None:
    before = os.times()
    with InterferenceProbe() as probe:
        child = subprocess.Popen([sys.executable, "-c", SPIN_CHILD])
        _spin(0.4)
        child.wait()
    after = os.times()
    ours = sum(after[:4]) - sum(before[:4])  # this process's and its reaped child's CPU time, by the kernel's count
    assert probe.result is not None
    assert probe.result.own_cpu_s == pytest.approx(ours, abs=0.05), probe.result
    # quiet unless something else on this machine really ran: then it says what
    assert not probe.result.flagged or "other processes used" in probe.result.reasons[0]
