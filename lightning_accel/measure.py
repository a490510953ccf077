"""Repeated, interleaved measurement: medians with intervals, "no clear difference", and interference checks.

Every figure that steers a decision (accel-bench's speedups, the DataLoaderTuner's choice) goes through here, so
they share one method (after hyperfine and criterion.rs):

- Compare things **interleaved**, round by round (A B C, A B C, ...), never all repeats of one in a row, so a burst
  of load or a warming machine touches every candidate alike (`interleaved`).
- Report the **median with an interval** (`summarize`): for up to `BOOTSTRAP_MIN - 1` values the interval is their
  range (min-max: with 2-5 values nothing finer is honest); from `BOOTSTRAP_MIN` on, a 95% percentile bootstrap of
  the median (fixed seed: the same values give the same interval).
- A **ratio** (a speedup) pairs the values of the same round (`ratio`): both sides of a pair ran under the same
  conditions, so a slow round slows both. Its interval follows the same rule.
- When an interval holds 1.0 (`verdict`), there is **no clear difference**: say so instead of printing a win.
- **Interference** is measured, not assumed: each measured window runs under the interference probe of the facts
  about the machine (`lightning_accel.system.interference.InterferenceProbe`), which flags a window that other
  processes shared, with the reason.

No Lightning imports and no import of `system/`: the tuners, accel-bench and accel-tune all use it.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard, TypeVar

from lightning_accel.errors import ConfigError

__all__ = [
    "BOOTSTRAP_MIN",
    "Interval",
    "Verdict",
    "interleaved",
    "ratio",
    "summarize",
    "verdict",
]

BOOTSTRAP_MIN = 6
"""From this many values on, intervals are a 95% bootstrap of the median; below it, the values' range."""
Verdict = Literal["faster", "slower", "no clear difference"]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Interval:
    """A median and the interval around it, from `n` values."""

    median: float
    low: float
    high: float
    n: int
    method: str
    """`single` (one value: no spread known), `min-max`, or `bootstrap 95%`."""

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    @property
    def relative_width(self) -> float:
        """(high - low) / |median|: 0.1 means the values spread over 10% of the median; inf for a median of 0."""
        return (self.high - self.low) / abs(self.median) if self.median else math.inf

    def format(self, spec: str = ".2f", unit: str = "") -> str:
        """`1.43x [1.38, 1.50]`-style text: the median, then the interval (none for a single value)."""
        if self.n < 2:
            return f"{self.median:{spec}}{unit}"
        return f"{self.median:{spec}}{unit} [{self.low:{spec}}, {self.high:{spec}}]"

    def as_dict(self) -> dict[str, float | int | str]:
        return {"median": self.median, "low": self.low, "high": self.high, "n": self.n, "method": self.method}


def summarize(values: Iterable[float], *, confidence: float = 0.95, resamples: int = 2000, seed: int = 0) -> Interval:
    """The median of `values` and its interval (min-max below `BOOTSTRAP_MIN` values, else a percentile bootstrap).

    Raises:
        ValueError: for no finite value, or a `confidence` outside (0, 1).
    """
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not finite:
        raise ValueError("`values` holds no finite number to summarize.")
    if not 0.0 < confidence < 1.0:
        raise ConfigError(f"`confidence={confidence!r}` must be within (0, 1), e.g. 0.95.")
    median = statistics.median(finite)
    if len(finite) == 1:
        return Interval(median, median, median, 1, "single")
    if len(finite) < BOOTSTRAP_MIN:
        return Interval(median, min(finite), max(finite), len(finite), "min-max")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(finite, k=len(finite))) for _ in range(resamples))
    tail = (1.0 - confidence) / 2
    low = medians[int(math.floor(tail * (resamples - 1)))]
    high = medians[int(math.ceil((1.0 - tail) * (resamples - 1)))]
    return Interval(median, min(low, median), max(high, median), len(finite), f"bootstrap {confidence:.0%}")


def ratio(numerators: Sequence[float | None], denominators: Sequence[float | None], **kwargs: Any) -> Interval:
    """The interval of `numerator / denominator` (a speedup: reference time over stage time).

    Values at the same index were measured in the same round and are paired; a round where either is missing (None,
    not finite, or a zero denominator) is left out. Without a full pair, every numerator over every denominator is
    summarized (unpaired). Keyword arguments go to `summarize`.

    Raises:
        ValueError: when no ratio can be formed.
    """
    pairs = [(a, b) for a, b in zip(numerators, denominators, strict=False) if _usable(a) and _usable(b) and b]
    if pairs:
        return summarize([a / b for a, b in pairs], **kwargs)
    tops = [a for a in numerators if _usable(a)]
    bottoms = [b for b in denominators if _usable(b) and b]
    return summarize([a / b for a in tops for b in bottoms], **kwargs)


def _usable(value: float | None) -> TypeGuard[float]:
    return value is not None and math.isfinite(value)


def verdict(interval: Interval, reference: float = 1.0) -> Verdict:
    """`faster` when the whole interval lies above `reference`, `slower` when below, else `no clear difference`.

    A single value (no spread known) is read as it is.
    """
    if interval.low > reference:
        return "faster"
    if interval.high < reference:
        return "slower"
    return "no clear difference"


def interleaved(items: Sequence[T], repeats: int) -> Iterator[tuple[int, T]]:
    """(round, item) in the order to measure them: every item once per round, `repeats` rounds (A B, A B, ...).

    Raises:
        ValueError: for `repeats < 1`.
    """
    if repeats < 1:
        raise ConfigError(f"`repeats={repeats!r}` must be >= 1.")
    for round_index in range(repeats):
        for item in items:
            yield round_index, item
