"""`TunerDecision`: the DataLoaderTuner's one decision object (cache entry, checkpoint state, result), and what a
decision may claim: the speedup over the loader's own settings, never above what their data wait allows
(`LoaderBound`)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_accel.measure import Interval, ratio, summarize
from lightning_accel.tuning.dataloader.loader_settings import LoaderSettings
from lightning_accel.tuning.dataloader.timing import Trial

MAX_PREFETCH_FACTOR = 64
"""The most batches per worker a cached decision may keep in flight (the tuner tries at most a few)."""
WAIT_CEILING = 0.99
"""The largest data-wait share a bound is computed from (a share of 1 would allow an infinite speedup)."""

__all__ = [
    "MAX_PREFETCH_FACTOR",
    "WAIT_CEILING",
    "LoaderBound",
    "TunerDecision",
    "credited",
    "loader_bound",
    "measured_speedup",
    "runs_of",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class LoaderBound:
    """The most any DataLoader setting can speed up a step over the loader's own settings.

    A DataLoader setting changes how long the step waits for its batch, not the step itself: with the loader's own
    settings waiting a share `w` of step time, a setting that removes all of that wait makes the step at most
    `1 / (1 - w)` times faster. `w` is measured, so the bound carries its interval: `low` and `high` from the ends
    of the share's interval (`loader_bound`). A measured speedup above `high` is noise or another job's load, not
    the loader's.
    """

    wait_share: float
    """The loader's own settings' share of step time spent waiting for data (their median run), 0..1."""
    wait_low: float
    wait_high: float
    """The interval of `wait_share` (`loader_bound`: over their repeated runs, or over the steps of a single one)."""

    @staticmethod
    def _speedup(share: float) -> float:
        return 1.0 / (1.0 - min(max(share, 0.0), WAIT_CEILING))

    @property
    def speedup(self) -> float:
        """1 / (1 - `wait_share`)."""
        return self._speedup(self.wait_share)

    @property
    def low(self) -> float:
        return self._speedup(self.wait_low)

    @property
    def high(self) -> float:
        """1 / (1 - `wait_high`): the most a decision is credited with."""
        return self._speedup(self.wait_high)

    def describe(self) -> str:
        """`13% [5%, 18%] of step time waiting for data: at most 1.15x [1.05, 1.22]`."""
        return (
            f"{100 * self.wait_share:.0f}% [{100 * self.wait_low:.0f}%, {100 * self.wait_high:.0f}%] of step time "
            f"waiting for data: at most {self.speedup:.2f}x [{self.low:.2f}, {self.high:.2f}]"
        )

    def as_list(self) -> list[float]:
        return [self.wait_share, self.wait_low, self.wait_high]


def runs_of(trials: Sequence[Trial], settings: LoaderSettings) -> list[Trial]:
    """The runs of `settings` that timed steps: the finished ones, else the cut-short ones (a cut trial gives an
    estimate), in the order run."""
    runs = [t for t in trials if t.settings == settings and t.steps and t.status in ("done", "cut")]
    return [t for t in runs if t.status == "done"] or runs


def _median_of(runs: Sequence[Trial]) -> Trial | None:
    """The median-throughput run (the lower of the middle two for an even count)."""
    return sorted(runs, key=lambda t: t.samples_per_s)[(len(runs) - 1) // 2] if runs else None


def loader_bound(trials: Sequence[Trial], original: LoaderSettings) -> LoaderBound | None:
    """The bound the loader's own settings' runs set (`LoaderBound`), None when they were not timed.

    The share is their median run's. Its interval: timed more than once (the search repeats a comparison within the
    noise), the interval of the runs' shares by `measure.summarize` (their range for up to five), widened to the
    median run's share with the median step (`Trial.loader_share`, which steps lengthened by another job do not
    shrink); timed once, that run's own interval over its steps (`Trial.wait_low`, `Trial.wait_high`)."""
    runs = runs_of(trials, original)
    median = _median_of(runs)
    if median is None:
        return None
    if len(runs) == 1:
        return LoaderBound(wait_share=median.wait_share, wait_low=median.wait_low, wait_high=median.wait_high)
    spread = summarize([r.wait_share for r in runs])
    return LoaderBound(
        wait_share=median.wait_share,
        wait_low=min(spread.low, median.wait_share),
        wait_high=max(spread.high, median.wait_share, median.loader_share),
    )


def _rounds(trials: Sequence[Trial], a: LoaderSettings, b: LoaderSettings) -> tuple[list[float], list[float]]:
    """The rates of `a` and `b` from the runs timed one right after the other (an interleaved round, A B or B A):
    both shared one stretch of the machine's load. Scanned in the order run, each run in at most one round."""
    done = [t for t in trials if t.steps and t.status in ("done", "cut")]
    tops: list[float] = []
    bottoms: list[float] = []
    index = 0
    while index + 1 < len(done):
        first, second = done[index], done[index + 1]
        if {first.settings, second.settings} == {a, b}:
            mine, own = (first, second) if first.settings == a else (second, first)
            tops.append(mine.samples_per_s)
            bottoms.append(own.samples_per_s)
            index += 2
        else:
            index += 1
    return tops, bottoms


def measured_speedup(trials: Sequence[Trial], chosen: LoaderSettings, original: LoaderSettings) -> Interval | None:
    """`chosen`'s throughput over the loader's own settings `original`, as measured: the median run over the median
    run (the point), with the interval of the ratios of the rounds in which the two ran one right after the other
    (`_rounds`: a slow stretch of another job's load slows both of a round), by `measure.summarize`; every run over
    every run when no round holds both. Widened to hold the point. None when either was not timed."""
    mine, own = _median_of(runs_of(trials, chosen)), _median_of(runs_of(trials, original))
    if mine is None or own is None or own.samples_per_s <= 0:
        return None
    point = mine.samples_per_s / own.samples_per_s
    if chosen == original:
        return Interval(1.0, 1.0, 1.0, 1, "single")
    tops, bottoms = _rounds(trials, chosen, original)
    if tops:
        paired = ratio(tops, bottoms)
    else:  # never run side by side: every run over every run
        rates = [t.samples_per_s for t in runs_of(trials, original) if t.samples_per_s > 0]
        paired = summarize([m.samples_per_s / o for m in runs_of(trials, chosen) for o in rates] or [point])
    return Interval(point, min(paired.low, point), max(paired.high, point), paired.n, paired.method)


def credited(measured: Interval, bound: LoaderBound | None) -> Interval:
    """The speedup a decision is credited with: `measured`, each end capped at `bound.high` (what the loader's own
    data wait allows); `measured` itself without a bound."""
    cap = math.inf if bound is None else bound.high
    return Interval(
        min(measured.median, cap), min(measured.low, cap), min(measured.high, cap), measured.n, measured.method
    )


_KEYS = ("fingerprint", "settings", "samples_per_s", "wait_share")


@dataclass(frozen=True, kw_only=True, slots=True)
class TunerDecision:
    """The settings chosen for one fingerprint, what they measured, and whether the decision may be cached.

    The same object is written to the cache, kept in checkpoints (`as_dict`, plain types) and read back from both
    (`from_dict`, which validates every field: an entry that fails is a miss and the tuner tunes again).
    """

    fingerprint: str
    """Hash of what the decision depends on (`cache.fingerprint`)."""
    settings: LoaderSettings
    samples_per_s: float
    """Training samples per second per rank with `settings`, as measured (median of its repeats)."""
    wait_share: float
    """Share of step time spent waiting for data with `settings` (0..1): what verification compares against."""
    speedup: float | None = None
    """Throughput over the loader's own settings, as credited: the measured median over median, capped at what their
    data wait allows (`LoaderBound.high`); None when those were not timed."""
    speedup_low: float | None = None
    speedup_high: float | None = None
    """The credited speedup's interval (the measured one, each end capped at the bound)."""
    measured_speedup: float | None = None
    """The speedup as measured, before the cap: above `bound`, the excess is noise or interference."""
    baseline: LoaderBound | None = None
    """The loader's own settings' data wait and the bound it sets; None when they were not timed."""
    kept: bool = False
    """True when the decision keeps the user's own settings (no setting was measurably faster)."""
    reason: str = ""
    """Why these settings: "no setting measurably faster (...)", what the CPU budget bound, what the bound cut."""
    confident: bool = True
    """False when the decision was made under interference or the deciding comparison stayed within noise: such a
    decision is applied to the fit but never cached."""
    note: str = ""
    """Why the decision is not confident, or what replaced it (a verification)."""
    tuned_at: str = ""
    facts: Mapping[str, Any] = field(default_factory=dict)
    """What the fingerprint hashes (dataset, batch size, model, hardware, world size)."""

    @property
    def bound(self) -> float | None:
        """The most a setting could gain over the loader's own settings (`LoaderBound.high`); None untimed."""
        return None if self.baseline is None else self.baseline.high

    @classmethod
    def from_trials(
        cls,
        key: str,
        facts: Mapping[str, Any],
        chosen: Trial,
        trials: Sequence[Trial],
        original: LoaderSettings,
        *,
        confident: bool = True,
        note: str = "",
        kept: bool = False,
        reason: str = "",
        settings: LoaderSettings | None = None,
    ) -> TunerDecision:
        """The decision for `chosen`, with its speedup over the loader's own settings `original` (when timed),
        credited up to the bound their data wait sets (`credited`). `settings`: what the decision applies, when not
        `chosen.settings` (the user's exact settings, when kept)."""
        measured = measured_speedup(trials, chosen.settings, original)
        baseline = loader_bound(trials, original)
        credit = None if measured is None else credited(measured, baseline)
        return cls(
            fingerprint=key,
            settings=chosen.settings if settings is None else settings,
            samples_per_s=chosen.samples_per_s,
            wait_share=chosen.wait_share,
            speedup=None if credit is None else credit.median,
            speedup_low=None if credit is None else credit.low,
            speedup_high=None if credit is None else credit.high,
            measured_speedup=None if measured is None else measured.median,
            baseline=baseline,
            kept=kept,
            reason=reason,
            confident=confident,
            note=note,
            tuned_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            facts=dict(facts),
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain types only (JSON and `torch.load(weights_only=True)` read them)."""
        return {
            "fingerprint": self.fingerprint,
            "settings": self.settings.as_dict(),
            "samples_per_s": self.samples_per_s,
            "wait_share": self.wait_share,
            "speedup": self.speedup,
            "speedup_low": self.speedup_low,
            "speedup_high": self.speedup_high,
            "measured_speedup": self.measured_speedup,
            "baseline": None if self.baseline is None else self.baseline.as_list(),
            "kept": self.kept,
            "reason": self.reason,
            "confident": self.confident,
            "note": self.note,
            "tuned_at": self.tuned_at,
            "facts": dict(self.facts),
        }

    @classmethod
    def from_dict(cls, entry: object, *, fingerprint: str, max_workers: int) -> TunerDecision | None:
        """The decision an entry holds, or None when it is not one for `fingerprint` with valid fields.

        Checked: the keys are there; `num_workers` is an int in 0..`max_workers`; `prefetch_factor` is an int in
        1..`MAX_PREFETCH_FACTOR` with workers and None without; `pin_memory`/`persistent_workers` are bools
        (persistent only with workers); `samples_per_s` is a finite number >= 0, `wait_share` within 0..1, `speedup`
        and its interval and `measured_speedup` None or finite numbers > 0, `baseline` None or three shares within
        0..1, `kept` a bool and `reason` a string (entries written before these fields read as None, False, "").
        """
        if not isinstance(entry, Mapping) or any(k not in entry for k in _KEYS) or entry["fingerprint"] != fingerprint:
            return None
        raw = entry["settings"]
        if not isinstance(raw, Mapping) or set(raw) != set(LoaderSettings.__slots__):
            return None
        workers, prefetch = raw["num_workers"], raw["prefetch_factor"]
        if not _is_int(workers) or not 0 <= workers <= max_workers:
            return None
        if (workers == 0 and prefetch is not None) or (
            workers > 0 and not (_is_int(prefetch) and 1 <= prefetch <= MAX_PREFETCH_FACTOR)
        ):
            return None  # bounded like a setting a user writes: 10**9 batches in flight hung a run for 12 minutes
        if not all(isinstance(raw[k], bool) for k in ("pin_memory", "persistent_workers")):
            return None
        if raw["persistent_workers"] and workers == 0:
            return None
        rate, wait, speedup = entry["samples_per_s"], entry["wait_share"], entry.get("speedup")
        if not (_is_number(rate) and rate >= 0 and _is_number(wait) and 0.0 <= wait <= 1.0):
            return None
        if speedup is not None and not (_is_number(speedup) and speedup > 0):
            return None
        extra = {k: entry.get(k) for k in ("speedup_low", "speedup_high", "measured_speedup")}
        if any(v is not None and not (_is_number(v) and v > 0) for v in extra.values()):
            return None
        raw_baseline, kept, reason = entry.get("baseline"), entry.get("kept", False), entry.get("reason", "")
        if raw_baseline is not None and not (
            isinstance(raw_baseline, (list, tuple))
            and len(raw_baseline) == 3
            and all(_is_number(v) and 0.0 <= v <= 1.0 for v in raw_baseline)
        ):
            return None
        if not (isinstance(kept, bool) and isinstance(reason, str)):
            return None
        baseline = None
        if raw_baseline is not None:
            share, low, high = (float(v) for v in raw_baseline)
            baseline = LoaderBound(wait_share=share, wait_low=low, wait_high=high)
        confident, note, tuned_at = entry.get("confident", True), entry.get("note", ""), entry.get("tuned_at", "")
        facts = entry.get("facts", {})
        if not (
            isinstance(confident, bool)
            and isinstance(note, str)
            and isinstance(tuned_at, str)
            and isinstance(facts, Mapping)
        ):
            return None
        settings = LoaderSettings(
            num_workers=workers,
            prefetch_factor=prefetch,
            pin_memory=raw["pin_memory"],
            persistent_workers=raw["persistent_workers"],
        )
        return cls(
            fingerprint=fingerprint,
            settings=settings,
            samples_per_s=float(rate),
            wait_share=float(wait),
            speedup=None if speedup is None else float(speedup),
            speedup_low=None if extra["speedup_low"] is None else float(extra["speedup_low"]),
            speedup_high=None if extra["speedup_high"] is None else float(extra["speedup_high"]),
            measured_speedup=None if extra["measured_speedup"] is None else float(extra["measured_speedup"]),
            baseline=baseline,
            kept=kept,
            reason=reason,
            confident=confident,
            note=note,
            tuned_at=tuned_at,
            facts=dict(facts),
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
