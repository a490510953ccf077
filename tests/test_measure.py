"""lightning_accel.measure: intervals, paired ratios, verdicts, interleaving and interference through fake /proc."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_accel import measure
from lightning_accel.measure import InterferenceProbe, Interval, interleaved, ratio, summarize, verdict


def test_small_samples_get_their_range_and_larger_ones_a_bootstrap() -> None:
    assert summarize([3.0]) == Interval(3.0, 3.0, 3.0, 1, "single")
    assert summarize([1.0, 3.0, 2.0]) == Interval(2.0, 1.0, 3.0, 3, "min-max")
    many = summarize([10.0, 11.0, 9.0, 10.5, 9.5, 10.2, 30.0])  # one outlier
    assert many.method == "bootstrap 95%" and many.median == 10.2
    assert many.low >= 9.0 and many.high < 30.0  # the median's interval, not the range
    assert summarize([10.0, 11.0, 9.0, 10.5, 9.5, 10.2, 30.0]) == many  # fixed seed: reproducible
    assert summarize([1.0, math.nan, None, 2.0]).n == 2  # type: ignore[list-item]
    with pytest.raises(ValueError, match="no finite"):
        summarize([math.inf])


def test_ratios_pair_the_values_of_one_round() -> None:
    # round 2 ran under load: both sides slowed alike, and the paired ratio stays put
    paired = ratio([10.0, 20.0], [5.0, 10.0])
    assert (paired.median, paired.low, paired.high) == (2.0, 2.0, 2.0)
    # a missing value drops its round; with no full pair, every combination is summarized
    assert ratio([10.0, None, 12.0], [5.0, 6.0, None]).n == 1
    unpaired = ratio([10.0, None], [None, 5.0])
    assert unpaired.median == 2.0


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [(1.1, 1.3, "faster"), (0.7, 0.95, "slower"), (0.9, 1.2, "no clear difference"), (1.0, 1.2, "no clear difference")],
)
def test_an_interval_holding_one_is_no_clear_difference(low: float, high: float, expected: str) -> None:
    assert verdict(Interval((low + high) / 2, low, high, 3, "min-max")) == expected


def test_interleaving_runs_every_item_once_per_round() -> None:
    assert list(interleaved("ab", 2)) == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    with pytest.raises(ValueError, match="repeats"):
        list(interleaved("ab", 0))


def _proc_stat(root: Path, busy: int, steal: int = 0) -> None:
    (root / "proc").mkdir(parents=True, exist_ok=True)
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    cpus = sorted(os.sched_getaffinity(0))
    for cpu in cpus:  # the per-CPU lines are what counts; each CPU gets its share
        lines.append(f"cpu{cpu} {busy // len(cpus)} 0 0 1000 0 0 0 {steal // len(cpus)} 0 0")
    lines.append("cpu999 100000 0 0 0 0 0 0 0 0 0")  # a CPU this process may not run on: ignored
    (root / "proc" / "stat").write_text("\n".join(lines) + "\n")


def test_interference_is_the_others_cpu_time_on_our_cpus(tmp_path: Path) -> None:
    clock = iter([0.0, 1.0])
    probe = InterferenceProbe(root=tmp_path, clock=lambda: next(clock))
    _proc_stat(tmp_path, busy=0)
    probe.start()
    tick = os.sysconf("SC_CLK_TCK")
    cpus = len(os.sched_getaffinity(0))
    _proc_stat(tmp_path, busy=int(0.95 * cpus * tick), steal=0)  # 95% of our CPUs busy; we used ~0
    result = probe.stop()
    assert result.flagged and "other processes used" in result.reasons[0], result
    assert result.other_cpus == pytest.approx(0.95 * cpus - result.own_cpu_s, abs=0.05)


def test_others_on_cpus_beyond_our_quota_took_nothing_from_us(tmp_path: Path) -> None:
    """A host's other tenants on cores our quota would leave idle anyway are no interference; the same load on the
    CPUs our budget spans is."""
    cpus = len(os.sched_getaffinity(0))
    tick = os.sysconf("SC_CLK_TCK")
    results = []
    for budget in (0.25 * cpus, float(cpus)):  # a quota of a quarter of the CPUs, then all of them
        clock = iter([0.0, 1.0])
        probe = InterferenceProbe(root=tmp_path, clock=clock.__next__, budget_cpus=budget)
        _proc_stat(tmp_path, busy=0)
        probe.start()
        _proc_stat(tmp_path, busy=int(0.5 * cpus * tick))  # others keep half the CPUs busy
        results.append(probe.stop())
    assert not results[0].flagged, results[0]
    assert results[1].flagged and results[1].other_cpus == pytest.approx(0.5 * cpus - results[1].own_cpu_s, abs=0.05)


def test_steal_time_flags_a_window(tmp_path: Path) -> None:
    clock = iter([0.0, 1.0])
    probe = InterferenceProbe(root=tmp_path, clock=lambda: next(clock))
    _proc_stat(tmp_path, busy=0)
    probe.start()
    cpus = len(os.sched_getaffinity(0))
    _proc_stat(tmp_path, busy=0, steal=int(0.2 * cpus * os.sysconf("SC_CLK_TCK")))
    result = probe.stop()
    assert result.flagged and any("stole" in r for r in result.reasons)


def test_an_unreadable_proc_stat_is_not_measured_and_not_flagged(tmp_path: Path) -> None:
    with InterferenceProbe(root=tmp_path / "missing") as probe:
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


def test_measure_imports_no_lightning() -> None:
    code = "import sys, lightning_accel.measure; print(any(m.split('.')[0] == 'lightning' for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    assert measure.__all__
