"""The alerts a heartbeat carries by itself: checked on the publisher's thread from what it already holds (the latest
window of each card, the step counter), so they cost the training loop nothing per step; no Lightning imports.

Each alert fires once per episode, when its condition starts to hold, and is armed again once it stops:
- `throttling`: a card's clocks were held down by thermal or hardware slowdown more than `max_throttle_pct` of the
  last window (the power cap is left out: a busy card at its cap is working as set);
- `memory_headroom`: a card's used memory is within `min_memory_headroom_pct` of its total;
- `nonfinite_loss`: the count of non-finite losses (NonFiniteGuard's, read as an int) went up;
- `no_progress`: no optimizer step for `hung_after_steps` times the median step time, and at least `min_hung_s` (a
  hung job: a collective waiting on a dead rank, a deadlocked DataLoader);
- `health`: a card's health has problems (`telemetry.health.CardHealth.problems`: an XID, a lost card, uncorrected
  ECC errors, a pending or failed repair).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["HEARTBEAT_ALERTS", "MAX_KEPT", "HeartbeatAlertSettings", "HeartbeatAlerts"]

HEARTBEAT_ALERTS = ("throttling", "memory_headroom", "nonfinite_loss", "no_progress", "health")
MAX_KEPT = 32
"""Alerts a heartbeat carries at most (the newest)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatAlertSettings:
    """When each heartbeat alert fires; None turns that one off."""

    max_throttle_pct: float | None = 25.0
    min_memory_headroom_pct: float | None = 5.0
    hung_after_steps: float | None = 10.0
    """No step for this many median step times reads as hung."""
    min_hung_s: float = 60.0
    """...and for at least this long (a first step that compiles, an evaluation between steps)."""
    nonfinite: bool = True
    health: bool = True


class HeartbeatAlerts:
    """Checks the conditions on each heartbeat; `alerts` are the ones fired so far, as the heartbeat holds them.

    Args:
        settings: the thresholds.
        nonfinite: returns the run's count of non-finite losses so far; None: not known.
    """

    def __init__(self, settings: HeartbeatAlertSettings, nonfinite: Callable[[], int] | None = None) -> None:
        self.settings = settings
        self._nonfinite = nonfinite if settings.nonfinite else None
        self._fired: deque[dict[str, Any]] = deque(maxlen=MAX_KEPT)
        self._active: set[str] = set()
        self._step_s: deque[float] = deque(maxlen=64)
        self._last_step: int | None = None
        self._last_change = 0.0
        self._nonfinite_seen = 0

    @property
    def alerts(self) -> list[dict[str, Any]]:
        return list(self._fired)

    def check(
        self,
        now: float,
        step: int,
        latest: Mapping[int, Mapping[str, float]],
        health: Mapping[int, Sequence[str]] | None = None,
    ) -> None:
        """One heartbeat's check: `latest` per card index is the window's means (`telemetry.readings` names),
        `health` per card index its health problems in words."""
        for index, values in sorted(latest.items()):
            self._throttling(step, index, values)
            self._memory(step, index, values)
        for index, problems in sorted((health or {}).items()):
            if self.settings.health:
                self._health(step, index, problems)
        self._nonfinite_losses(step)
        self._progress(now, step)

    def _episode(self, key: str, holds: bool, name: str, step: int, message: Callable[[], str]) -> None:
        if holds and key not in self._active:
            self._active.add(key)
            self._fired.append({"name": name, "step": int(step), "message": message()})
        elif not holds:
            self._active.discard(key)

    def _throttling(self, step: int, index: int, values: Mapping[str, float]) -> None:
        # thermal and hardware slowdown only, as the shipped Prometheus rule: a busy card at its power cap is the
        # card working as set, not a fault (GPUMonitor's window alert, with `log_metrics`, counts the power cap too)
        limit = self.settings.max_throttle_pct
        parts = [values[k] for k in ("throttle_thermal_frac", "throttle_hw_slowdown_frac") if k in values]
        if limit is None or not parts:
            return
        held = max(parts)  # the longer of the two: a floor of the time either held the clocks down
        self._episode(
            f"throttling/{index}",
            held * 100 > limit,
            "throttling",
            step,
            lambda: (
                f"GPU {index}: clocks held down by thermal or hardware slowdown {held * 100:.0f}% of the last "
                f"window (over {limit:g}%): check cooling, airflow and the card (`nvidia-smi -q -d PERFORMANCE`)"
            ),
        )

    def _memory(self, step: int, index: int, values: Mapping[str, float]) -> None:
        limit, used, total = (
            self.settings.min_memory_headroom_pct,
            values.get("memory_used_mib"),
            values.get("memory_total_mib"),
        )
        if limit is None or used is None or not total:
            return
        free_pct = 100.0 * (1 - used / total)
        self._episode(
            f"memory/{index}",
            free_pct < limit,
            "memory_headroom",
            step,
            lambda: (
                f"GPU {index}: {free_pct:.1f}% of its memory free (under {limit:g}%): the next larger batch "
                "or activation runs out; lower the micro-batch or turn on activation checkpointing"
            ),
        )

    def _health(self, step: int, index: int, problems: Sequence[str]) -> None:
        self._episode(f"health/{index}", bool(problems), "health", step, lambda: f"GPU {index}: " + "; ".join(problems))

    def _nonfinite_losses(self, step: int) -> None:
        if self._nonfinite is None:
            return
        count = int(self._nonfinite())
        if count > self._nonfinite_seen:
            new = count - self._nonfinite_seen
            self._fired.append(
                {
                    "name": "nonfinite_loss",
                    "step": int(step),
                    "message": f"{new} more non-finite loss(es), {count} in this fit: lower the learning rate, "
                    "clip gradients, or use bf16 in place of fp16",
                }
            )
        self._nonfinite_seen = max(self._nonfinite_seen, count)

    def _progress(self, now: float, step: int) -> None:
        factor = self.settings.hung_after_steps
        if self._last_step is None or step < self._last_step:  # the first heartbeat, or a new fit
            self._last_step, self._last_change = step, now
            return
        if step > self._last_step:
            if self._last_step > 0:  # the time to the first step (start-up, compile) is no step time
                self._step_s.append((now - self._last_change) / (step - self._last_step))
            self._last_step, self._last_change = step, now
            self._active.discard("no_progress")
            return
        if factor is None or not self._step_s:
            return
        median = statistics.median(self._step_s)
        after = max(self.settings.min_hung_s, factor * median)
        silent = now - self._last_change
        self._episode(
            "no_progress",
            silent > after,
            "no_progress",
            step,
            lambda: (
                f"no optimizer step for {silent:.0f} s ({silent / median:.0f}x the median step time of "
                f"{median:.2f} s): a hung job (a collective waiting on a dead rank, a deadlocked DataLoader); "
                "`py-spy dump --pid <pid>` shows where each thread waits"
            ),
        )
