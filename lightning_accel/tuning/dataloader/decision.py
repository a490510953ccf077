"""`TunerDecision`: the DataLoaderTuner's one decision object (cache entry, checkpoint state, result)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_accel.tuning.dataloader.settings import LoaderSettings
from lightning_accel.tuning.dataloader.timing import Trial

MAX_PREFETCH_FACTOR = 64
"""The most batches per worker a cached decision may keep in flight (the tuner tries at most a few)."""

__all__ = ["MAX_PREFETCH_FACTOR", "TunerDecision"]

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
    """Throughput over the loader's own settings; None when those were not timed."""
    confident: bool = True
    """False when the decision was made under interference or the deciding comparison stayed within noise: such a
    decision is applied to the fit but never cached."""
    note: str = ""
    """Why the decision is not confident, or what replaced it (a verification)."""
    tuned_at: str = ""
    facts: Mapping[str, Any] = field(default_factory=dict)
    """What the fingerprint hashes (dataset, batch size, model, hardware, world size)."""

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
    ) -> TunerDecision:
        """The decision for `chosen`, with its speedup over the loader's own settings `original` (when timed)."""
        own = _median_run(trials, original)
        speedup = chosen.samples_per_s / own.samples_per_s if own is not None and own.samples_per_s > 0 else None
        return cls(
            fingerprint=key,
            settings=chosen.settings,
            samples_per_s=chosen.samples_per_s,
            wait_share=chosen.wait_share,
            speedup=speedup,
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
        None or a finite number > 0.
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
            confident=confident,
            note=note,
            tuned_at=tuned_at,
            facts=dict(facts),
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _median_run(trials: Sequence[Trial], settings: LoaderSettings) -> Trial | None:
    """The median-throughput run of `settings` (the lower of the middle two for an even count), as `policy.medians`
    judges the chosen one: finished runs, else the cut-short ones (a cut trial gives an estimate). The speedup then
    sets a median against a median, not one run against another (it read 0.82x for the tuner's own choice)."""
    runs = [t for t in trials if t.settings == settings and t.steps]
    runs = [t for t in runs if t.status == "done"] or runs
    return sorted(runs, key=lambda t: t.samples_per_s)[(len(runs) - 1) // 2] if runs else None
