"""Rank rows for all_gather, cross-rank timing, and the alert conditions."""

from __future__ import annotations

import math

import pytest

from lightning_accel.telemetry.alerts import AlertThresholds, check_alerts
from lightning_accel.telemetry.ranks import (
    RankTiming,
    allocated_by_device,
    pack_row,
    rank_stats,
    row_size,
    unpack_rows,
)
from lightning_accel.telemetry.readings import METRICS
from lightning_accel.telemetry.sampler import Stat, Window


def _stat(mean: float, low: float | None = None, high: float | None = None, seconds: float = 10.0) -> Stat:
    return Stat(mean * seconds, seconds, mean if low is None else low, mean if high is None else high, mean)


def test_rows_round_trip_and_skip_ranks_without_a_sampler() -> None:
    window = Window(
        0.0,
        2.0,
        4,
        {
            3: {"utilization_pct": Stat(120.0, 2.0, 40.0, 80.0, 80.0), "energy_wh": Stat(0.2, 2.0, 0.05, 0.1, 0.1)},
            5: {"power_w": _stat(300.0)},
        },
    )
    leader = pack_row(1, [3, 5], window, 0.25, 0.01, 8, has_sampler=True, device=3, allocated_pct=61.0)
    other = pack_row(1, [3, 5], None, 0.5, 0.2, 8, has_sampler=False, device=5, allocated_pct=70.0)
    assert len(leader) == len(other) == row_size(2)
    timings, devices = unpack_rows([other, leader], 2)
    assert timings == [RankTiming(0, 1, 0.5, 0.2, 8, 5, 70.0), RankTiming(1, 1, 0.25, 0.01, 8, 3, 61.0)]
    assert allocated_by_device(timings) == {(1, 5): 70.0, (1, 3): 61.0}
    assert set(devices) == {(1, 3), (1, 5)}
    assert devices[(1, 3)] == window.devices[3] and devices[(1, 5)] == window.devices[5]
    assert len(METRICS) == 24


def test_rank_stats_name_the_straggler() -> None:
    timings = [
        RankTiming(0, 0, 0.1, 0.0, 10),
        RankTiming(1, 0, 0.1, 0.03, 10),
        RankTiming(2, 1, 0.1, 0.002, 10),
        RankTiming(3, 1, 0.0, 0.0, 0),
    ]  # rank 3 did not step in this window
    stats = rank_stats(timings)
    assert stats.slowest == 1
    assert stats.step_time_s == (0.1, 0.1, 0.1) and stats.data_time_s == (0.0, 0.002, 0.03)
    assert stats.skew_pct == pytest.approx(100 * (0.13 - 0.102) / 0.1)
    assert rank_stats(timings[:1]) is None


def _gpu(util: float = 90.0, used_max: float = 50.0, throttled: float = 0.0) -> dict[str, Stat]:
    return {
        "utilization_pct": _stat(util),
        "memory_used_pct": _stat(used_max - 5, high=used_max),
        "throttle_any_frac": _stat(throttled),
        "throttle_thermal_frac": _stat(throttled),
        "throttle_power_frac": _stat(0.0),
    }


def test_each_alert_fires_on_its_condition_with_number_and_fix() -> None:
    thresholds = AlertThresholds(
        low_utilization_pct=50, min_memory_headroom_pct=5, max_throttle_pct=25, max_rank_skew_pct=20
    )
    healthy = {"gpu/0": _gpu(), "gpu/1": _gpu()}
    assert check_alerts(10, healthy, None, thresholds) == []
    gpus = {"gpu/0": _gpu(), "gpu/1": _gpu(util=31.0, used_max=96.5, throttled=0.4)}
    ranks = rank_stats([RankTiming(0, 0, 0.1, 0.0, 5), RankTiming(1, 0, 0.1, 0.05, 5)])
    alerts = {a.name: a for a in check_alerts(10, gpus, ranks, thresholds)}
    assert set(alerts) == {"low_utilization", "memory_headroom", "throttling", "rank_skew"}
    assert all(a.step == 10 for a in alerts.values())
    low = alerts["low_utilization"]
    assert (low.gpu, low.value) == ("gpu/1", 31.0)
    assert "busy 31% of the last 10.0 s" in low.message and "`num_workers`" in low.message
    headroom = alerts["memory_headroom"]
    assert headroom.value == pytest.approx(3.5) and "3.5% headroom" in headroom.message
    assert "MicroBatchFinder" in headroom.message and "micro_batch=auto" in headroom.message
    throttle = alerts["throttling"]
    assert throttle.value == pytest.approx(40.0) and "thermal 40%, power 0%" in throttle.message
    assert "cooling" in throttle.message
    skew = alerts["rank_skew"]
    assert skew.value == pytest.approx(25.0) and skew.gpu is None
    assert "Rank 1 is the straggler" in skew.message and "`num_workers`" in skew.message
    fired = {"low_utilization", "throttling"}
    assert {a.name for a in check_alerts(11, gpus, ranks, thresholds, fired)} == {"memory_headroom", "rank_skew"}


def test_memory_headroom_sees_what_the_run_allocated_not_the_allocators_cache() -> None:
    """NVML shows 97% used; the caching allocator holds most of it as free blocks: the run's tensors peaked at 60%."""
    thresholds = AlertThresholds(
        low_utilization_pct=None, min_memory_headroom_pct=5, max_throttle_pct=None, max_rank_skew_pct=None
    )
    gpus = {"gpu/0": _gpu(used_max=97.0)}
    assert check_alerts(10, gpus, None, thresholds, allocated_pct={"gpu/0": 60.0}) == []
    tight = check_alerts(10, gpus, None, thresholds, allocated_pct={"gpu/0": 96.0})
    assert [a.name for a in tight] == ["memory_headroom"] and tight[0].value == pytest.approx(4.0)
    assert "the run's tensors; NVML shows 97.0% held" in tight[0].message
    unknown = check_alerts(10, gpus, None, thresholds)  # no allocator figure (another process's GPU): NVML decides
    assert [a.name for a in unknown] == ["memory_headroom"] and unknown[0].value == pytest.approx(3.0)


def test_thresholds_of_none_turn_alerts_off() -> None:
    off = AlertThresholds(
        low_utilization_pct=None, min_memory_headroom_pct=None, max_throttle_pct=None, max_rank_skew_pct=None
    )
    gpus = {"gpu/0": _gpu(util=1.0, used_max=100.0, throttled=1.0)}
    ranks = rank_stats([RankTiming(0, 0, 0.1, 0.0, 5), RankTiming(1, 0, 0.1, 1.0, 5)])
    assert check_alerts(10, gpus, ranks, off) == []
    assert math.isnan(Stat().mean)
