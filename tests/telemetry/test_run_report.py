"""The run report: totals by hand, resume continuity through a checkpoint-like round trip, and the files written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lightning_accel.telemetry.alerts import Alert
from lightning_accel.telemetry.ranks import RankTiming
from lightning_accel.telemetry.run_report import RunReport
from lightning_accel.telemetry.sampler import Stat


def _window(
    util: tuple[float, float, float],
    power: float,
    throttled: float,
    temp_max: float,
    mem_max_mib: float,
    energy: float,
    seconds: float,
) -> dict[str, dict[str, Stat]]:
    mean, low, high = util
    return {
        "gpu/0": {
            "utilization_pct": Stat(mean * seconds, seconds, low, high, high),
            "power_w": Stat(power * seconds, seconds, power, power, power),
            "throttle_any_frac": Stat(throttled * seconds, seconds, 0.0, 1.0, 0.0),
            "temperature_c": Stat(60 * seconds, seconds, 50.0, temp_max, 60.0),
            "memory_used_mib": Stat(mem_max_mib * seconds, seconds, 0.0, mem_max_mib, mem_max_mib),
            "memory_total_mib": Stat(81920 * seconds, seconds, 81920.0, 81920.0, 81920.0),
            "energy_wh": Stat(0.0, seconds, 0.0, energy, energy),
        }
    }


W1 = _window((60.0, 20.0, 90.0), 300.0, 0.1, 70.0, 30720.0, 0.5, 10.0)
W2 = _window((90.0, 80.0, 100.0), 400.0, 0.0, 75.0, 40960.0, 2.0, 30.0)
EXPECTED = {
    "utilization_mean_pct": 82.5,
    "utilization_peak_pct": 100.0,
    "memory_peak_gib": 40.0,
    "memory_total_gib": 80.0,
    "power_mean_w": 375.0,
    "throttled_pct": 2.5,
    "temperature_max_c": 75.0,
    "energy_wh": 2.0,
    "seconds": 40.0,
}


def _row(report: RunReport) -> dict[str, float]:
    [row] = report.gpu_rows()
    return {k: pytest.approx(row[k]) for k in EXPECTED}


def test_totals_over_windows() -> None:
    report = RunReport()
    report.add_window(10.0, 9, W1, [RankTiming(0, 0, 0.1, 0.01, 10), RankTiming(1, 0, 0.2, 0.05, 10)])
    report.add_window(40.0, 19, W2, [RankTiming(0, 0, 0.3, 0.03, 10), RankTiming(1, 0, 0.2, 0.05, 10)])
    assert _row(report) == EXPECTED
    assert report.rank_rows() == [
        {"rank": 0, "step_time_ms": pytest.approx(200.0), "data_time_ms": pytest.approx(20.0), "steps": 20},
        {"rank": 1, "step_time_ms": pytest.approx(200.0), "data_time_ms": pytest.approx(50.0), "steps": 20},
    ]
    assert [(p["t"], p["step"], p["gpus"]["gpu/0"]["utilization_pct"]) for p in report.history] == [
        (10.0, 9, 60.0),
        (40.0, 19, 90.0),
    ]


def test_a_resumed_report_continues_the_run() -> None:
    first = RunReport()
    first.begin_fit()
    first.add_window(10.0, 9, W1)
    first.add_alert(Alert("throttling", 9, 10.0, "clocks held down", "gpu/0"))
    first.fit_s, first.overhead_s = 10.0, 0.01
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps: plain data
    resumed = RunReport()
    resumed.load_state_dict(state)
    resumed.begin_fit()  # the energy counter restarts with the new process
    resumed.add_window(40.0, 19, _window((90.0, 80.0, 100.0), 400.0, 0.0, 75.0, 40960.0, 1.5, 30.0))
    assert _row(resumed) == EXPECTED  # 0.5 Wh before the resume + 1.5 Wh after
    assert resumed.fired == {"throttling"} and len(resumed.history) == 2
    assert (resumed.fit_s, resumed.overhead_s, resumed.last_step) == (10.0, 0.01, 19)


def test_curves_are_thinned_evenly() -> None:
    report = RunReport(max_points=4)
    for step in range(9):
        report.add_window(float(step), step, W1)
    assert [p["step"] for p in report.history] == [0, 4, 8]


def test_report_files(tmp_path: Path) -> None:
    report = RunReport()
    report.info["gpu/0"] = {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-a", "nvml_index": 0}
    report.add_window(10.0, 9, W1)
    report.add_window(40.0, 19, W2)
    report.add_alert(Alert("low_utilization", 19, 31.0, "`gpu/0` was busy 31%", "gpu/0"))
    report.fit_s, report.overhead_s = 40.0, 0.02
    paths = report.write(tmp_path / "run", "gpu_report")
    assert [p.name for p in paths] == ["gpu_report.json", "gpu_report.md", "gpu_report.png"]
    data = json.loads(paths[0].read_text())
    assert data["gpus"][0]["utilization_mean_pct"] == 82.5 and data["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"
    assert data["monitor_overhead_pct"] == pytest.approx(0.05) and data["alerts"][0]["step"] == 19
    markdown = paths[1].read_text()
    assert "| gpu/0 | NVIDIA H100 80GB HBM3 | 82.5 | 100.0 | 40.00 | 80.00 | 375.0 | 2.5 | 75.0 | 2.000 |" in markdown
    assert "- step 19, `low_utilization`: `gpu/0` was busy 31%" in markdown
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[2].stat().st_size > 10_000
    assert report.write(tmp_path / "noplot", "r", plot=False)[-1].suffix == ".md"
    assert not RunReport().plot(tmp_path / "empty.png")
    assert math.isnan(RunReport().energy_wh("gpu/0") * math.nan)
