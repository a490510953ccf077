"""Alert conditions over a window of GPU readings and rank timings: each says the number and the fix."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from lightning_accel.telemetry.ranks import RankStats
from lightning_accel.telemetry.sampler import Stat

__all__ = ["ALERTS", "Alert", "AlertThresholds", "check_alerts"]

ALERTS = ("low_utilization", "memory_headroom", "throttling", "rank_skew")


@dataclass(frozen=True, slots=True, kw_only=True)
class AlertThresholds:
    """When each alert fires; None turns that alert off."""

    low_utilization_pct: float | None = 50.0
    """A GPU's mean utilization over a window below this (%)."""
    min_memory_headroom_pct: float | None = 5.0
    """A GPU's free memory at its window peak below this (% of its memory)."""
    max_throttle_pct: float | None = 25.0
    """A GPU's clocks held down (thermal, power or hardware slowdown) more than this share of a window (%)."""
    max_rank_skew_pct: float | None = 20.0
    """The slowest rank's extra host time per step above this share of the median step time (%)."""


@dataclass(frozen=True, slots=True)
class Alert:
    name: str
    step: int
    value: float
    """The number that crossed the threshold (its unit is in the message)."""
    message: str
    gpu: str | None = None


def check_alerts(
    step: int,
    gpus: Mapping[str, Mapping[str, Stat]],
    ranks: RankStats | None,
    thresholds: AlertThresholds,
    fired: Collection[str] = (),
    allocated_pct: Mapping[str, float] | None = None,
) -> list[Alert]:
    """The alerts not yet in `fired` whose condition holds in this window (the first GPU that meets it, by key).

    `allocated_pct`: per GPU key, the peak share of its memory the run's tensors took (torch's caching allocator
    counts). NVML's used memory also holds the allocator's cached free blocks, so a GPU whose NVML reading is short of
    headroom raises `memory_headroom` only when what the run allocated is short of it too (or is unknown).
    """
    allocated_pct = allocated_pct or {}
    found: dict[str, Alert] = {}
    for key, stats in gpus.items():
        seconds = max((s.seconds for s in stats.values()), default=0.0)
        util, used = stats.get("utilization_pct"), stats.get("memory_used_pct")
        throttled = stats.get("throttle_any_frac")
        limit = thresholds.low_utilization_pct
        if "low_utilization" not in found and limit is not None and util is not None and util.mean < limit:
            found["low_utilization"] = Alert(
                "low_utilization",
                step,
                util.mean,
                (
                    f"`{key}` was busy {util.mean:.0f}% of the last {seconds:.1f} s (below "
                    f"`low_utilization_pct={limit}`): the run looks input-bound. Raise the DataLoader's `num_workers` "
                    "(or let the DataLoader tuner pick it), set `pin_memory=True` and `persistent_workers=True`, or "
                    "move preprocessing out of the step."
                ),
                key,
            )
        limit = thresholds.min_memory_headroom_pct
        allocated = allocated_pct.get(key)
        short = used is not None and 100.0 - used.max < (limit or 0.0)
        if short and allocated is not None and 100.0 - allocated >= (limit or 0.0):
            short = False  # the allocator holds cached free blocks: the run's tensors leave the headroom
        if "memory_headroom" not in found and limit is not None and short:
            assert used is not None
            peak = used.max if allocated is None else allocated
            held = "" if allocated is None else f" (the run's tensors; NVML shows {used.max:.1f}% held)"
            found["memory_headroom"] = Alert(
                "memory_headroom",
                step,
                100.0 - peak,
                (
                    f"`{key}` peaked at {peak:.1f}% of its memory{held}, {100.0 - peak:.1f}% headroom (below "
                    f"`min_memory_headroom_pct={limit}`): a longer batch or allocator fragmentation will raise CUDA "
                    "out of memory. Add MicroBatchFinder (accel-train `micro_batch=auto`): it runs the largest "
                    "micro-batch that fits with the same global batch and recovers from out-of-memory; or use bf16 "
                    "mixed precision, or checkpoint activations."
                ),
                key,
            )
        limit = thresholds.max_throttle_pct
        if "throttling" not in found and limit is not None and throttled is not None and 100 * throttled.mean > limit:
            parts = ", ".join(
                f"{what} {100 * stats[name].mean:.0f}%"
                for what, name in (
                    ("thermal", "throttle_thermal_frac"),
                    ("power", "throttle_power_frac"),
                    ("hardware slowdown", "throttle_hw_slowdown_frac"),
                )
                if name in stats
            )
            found["throttling"] = Alert(
                "throttling",
                step,
                100 * throttled.mean,
                (
                    f"`{key}` ran with reduced clocks {100 * throttled.mean:.0f}% of the last {seconds:.1f} s "
                    f"({parts}; above `max_throttle_pct={limit}`). Thermal or hardware slowdown: check cooling and "
                    "airflow (`nvidia-smi -q -d PERFORMANCE,TEMPERATURE`). Power: the card is at its power limit "
                    "(`nvidia-smi -q -d POWER`); expected at full load, otherwise raise the limit if the site allows."
                ),
                key,
            )
    limit = thresholds.max_rank_skew_pct
    if ranks is not None and limit is not None and ranks.skew_pct > limit:
        low, median, high = ranks.step_time_s
        found["rank_skew"] = Alert(
            "rank_skew",
            step,
            ranks.skew_pct,
            (
                f"Rank {ranks.slowest} is the straggler: it needs {ranks.skew_pct:.0f}% of a step more host time than "
                f"the median rank (step time {1e3 * median:.1f} ms median, {1e3 * high:.1f} ms max; data wait "
                f"{1e3 * ranks.data_time_s[2]:.1f} ms max vs {1e3 * ranks.data_time_s[1]:.1f} ms median; above "
                f"`max_rank_skew_pct={limit}`), and the other ranks wait for it at every gradient sync. Give its "
                "DataLoader more `num_workers`, balance the data shards, and check its GPU's clocks and temperature."
            ),
        )
    return [alert for name, alert in found.items() if name not in fired]
