"""What each rank sends once per logging step (step timing, its node's GPU window) and what rank zero makes of it."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from lightning_accel.telemetry.readings import METRICS
from lightning_accel.telemetry.sampler import Stat, Window

__all__ = [
    "RankStats",
    "RankTiming",
    "allocated_by_device",
    "pack_row",
    "rank_stats",
    "row_size",
    "spread",
    "unpack_rows",
    "window_metrics",
]

_SPREAD = ("utilization_pct", "memory_used_pct", "power_w", "temperature_c", "sm_clock_mhz")
_HEAD = 7  # node_rank, has_sampler, step_time_s, data_time_s, steps, cuda index, allocated %
_STAT = 5  # weighted, seconds, min, max, last
_SLOT = 1 + _STAT * len(METRICS)  # device index, then each metric's aggregate


@dataclass(frozen=True, slots=True)
class RankTiming:
    """One rank's mean step time (training batch end to batch end) and data wait (batch end to next batch start)."""

    rank: int
    node: int
    step_time_s: float
    data_time_s: float
    steps: int
    device: int = -1
    """The rank's CUDA device index (-1: none)."""
    allocated_pct: float = math.nan
    """The peak memory the rank's tensors took on it (`torch.cuda.max_memory_allocated`), % of the device's memory:
    what the run needs, where NVML's used memory also holds the caching allocator's free blocks."""


@dataclass(frozen=True, slots=True)
class RankStats:
    """Step timing across ranks for one window."""

    step_time_s: tuple[float, float, float]
    """min, median, max over ranks."""
    data_time_s: tuple[float, float, float]
    slowest: int
    """The rank with the most host time per step (step time + data wait)."""
    skew_pct: float
    """(slowest rank's host time - the median rank's) / median step time x 100: the share of a step that the other
    ranks spend waiting for the slowest at the next gradient sync."""


def row_size(num_devices: int) -> int:
    return _HEAD + num_devices * _SLOT


def pack_row(
    node: int,
    indices: Sequence[int],
    window: Window | None,
    step_time_s: float,
    data_time_s: float,
    steps: int,
    has_sampler: bool,
    device: int = -1,
    allocated_pct: float = math.nan,
) -> list[float]:
    """One rank's row of floats for all_gather; every rank of a run packs rows of the same length."""
    row = [float(node), float(has_sampler), step_time_s, data_time_s, float(steps), float(device), allocated_pct]
    for index in indices:
        stats = {} if window is None else window.devices.get(index, {})
        row.append(float(index))
        for metric in METRICS:
            stat = stats.get(metric.name)
            row.extend(
                (math.nan,) * _STAT if stat is None else (stat.weighted, stat.seconds, stat.min, stat.max, stat.last)
            )
    return row


def unpack_rows(
    rows: Sequence[Sequence[float]], num_devices: int
) -> tuple[list[RankTiming], dict[tuple[int, int], dict[str, Stat]]]:
    """Per-rank timings, and (node, device index) -> metric -> window aggregate from the rows of sampling ranks."""
    timings, devices = [], {}
    for rank, row in enumerate(rows):
        assert len(row) == row_size(num_devices), (len(row), num_devices)
        node = int(row[0])
        timings.append(RankTiming(rank, node, row[2], row[3], int(row[4]), int(row[5]), row[6]))
        if not row[1]:
            continue
        for slot in range(num_devices):
            base = _HEAD + slot * _SLOT
            stats = {}
            for position, metric in enumerate(METRICS):
                weighted, seconds, low, high, last = row[
                    base + 1 + position * _STAT : base + 1 + (position + 1) * _STAT
                ]
                if not math.isnan(seconds):
                    stats[metric.name] = Stat(weighted, seconds, low, high, last)
            if stats:
                devices[(node, int(row[base]))] = stats
    return timings, devices


def allocated_by_device(timings: Sequence[RankTiming]) -> dict[tuple[int, int], float]:
    """(node, CUDA device index) -> the highest peak allocation (%) any rank reported on that device."""
    found: dict[tuple[int, int], float] = {}
    for t in timings:
        if t.device >= 0 and not math.isnan(t.allocated_pct):
            key = (t.node, t.device)
            found[key] = max(found.get(key, 0.0), t.allocated_pct)
    return found


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """min, median, max."""
    return min(values), statistics.median(values), max(values)


def rank_stats(timings: Sequence[RankTiming]) -> RankStats | None:
    """Cross-rank step timing; None with fewer than two ranks that stepped in the window."""
    stepped = [t for t in timings if t.steps > 0]
    if len(stepped) < 2:
        return None
    host = [t.step_time_s + t.data_time_s for t in stepped]
    step = spread([t.step_time_s for t in stepped])
    slowest = stepped[max(range(len(stepped)), key=host.__getitem__)]
    skew = 100.0 * (max(host) - statistics.median(host)) / step[1] if step[1] > 0 else 0.0
    return RankStats(step, spread([t.data_time_s for t in stepped]), slowest.rank, skew)


def window_metrics(
    gpus: Mapping[str, Mapping[str, Stat]],
    ranks: RankStats | None,
    energy_wh: Callable[[str], float],
    log_min_max: bool = True,
) -> dict[str, float]:
    """The logged metrics of one window (keys as listed in GPUMonitor's docstring); `energy_wh(gpu)` is the run's."""
    metrics: dict[str, float] = {}
    for key, stats in gpus.items():
        for metric in METRICS:
            stat = stats.get(metric.name)
            if stat is None:
                continue
            if metric.stats == ("last",):
                metrics[f"{key}/{metric.name}"] = energy_wh(key)
                continue
            metrics[f"{key}/{metric.name}"] = stat.mean
            if log_min_max and "min" in metric.stats:
                metrics[f"{key}/{metric.name}/min"], metrics[f"{key}/{metric.name}/max"] = stat.min, stat.max
    for name in _SPREAD if len(gpus) > 1 else ():
        values = [stats[name].mean for stats in gpus.values() if name in stats]
        if len(values) > 1:
            metrics.update(_spread_keys(f"gpus/{name}", spread(values)))
    if ranks is not None:
        metrics.update(_spread_keys("ranks/step_time_s", ranks.step_time_s))
        metrics.update(_spread_keys("ranks/data_time_s", ranks.data_time_s))
        metrics["ranks/slowest"], metrics["ranks/skew_pct"] = float(ranks.slowest), ranks.skew_pct
    return metrics


def _spread_keys(prefix: str, values: tuple[float, float, float]) -> dict[str, float]:
    return {f"{prefix}/min": values[0], f"{prefix}/median": values[1], f"{prefix}/max": values[2]}
