"""Checking a reused decision on the live training loop: the share of step time it waits for data (`LiveWait`) and
whether that fails the decision (`verdict`); no Trainer."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VERIFY_MARGIN", "LiveWait", "verdict", "verdict_line"]

VERIFY_MARGIN = 0.15
"""A reused decision fails its verification when the live loop waits for data more than this share of step time
above what the decision recorded (and more than `tolerance`)."""


@dataclass(kw_only=True, slots=True)
class LiveWait:
    """The share of step time the live training loop waits for batches, from the times of its batch hooks.

    A wait is the time from the end of one batch (`batch_end`) to the start of the next (`batch_start`), a step from
    start to end; the first `skip` batches (workers starting) are not counted, then `steps` pairs are. `pause()`
    forgets the last end (validation or an epoch boundary comes between two batches).
    """

    skip: int
    steps: int
    seen: int = 0
    counted: int = 0
    wait_s: float = 0.0
    step_s: float = 0.0
    _end: float | None = None
    _start: float | None = None
    _gap: float | None = None

    def batch_start(self, now: float) -> None:
        self._gap = now - self._end if self._end is not None and self.seen >= self.skip else None
        self._start = now

    def batch_end(self, now: float) -> None:
        if self._start is not None and self._gap is not None and not self.complete:
            self.wait_s, self.step_s, self.counted = (
                self.wait_s + self._gap,
                self.step_s + now - self._start,
                (self.counted + 1),
            )
        self.seen, self._end, self._start, self._gap = self.seen + 1, now, None, None

    def pause(self) -> None:
        self._end = self._start = self._gap = None

    @property
    def complete(self) -> bool:
        return self.counted >= self.steps

    @property
    def share(self) -> float:
        total = self.wait_s + self.step_s
        return self.wait_s / total if total > 0 else 0.0


def verdict(live: LiveWait, recorded_share: float, tolerance: float, final: bool) -> tuple[bool, bool]:
    """(enough, failed) of this rank's window: enough steps were counted (all `live.steps`, or at the fit's end at
    least a quarter of them), and over them the loop waited for data more than `tolerance` and more than
    `VERIFY_MARGIN` above the share the decision recorded (`recorded_share`)."""
    enough = live.complete or (final and live.counted >= max(1, live.steps // 4))
    return enough, enough and live.share > max(tolerance, recorded_share + VERIFY_MARGIN)


def verdict_line(live: LiveWait, recorded_share: float, failed: bool) -> str:
    """The log line of a finished check."""
    return (
        f"DataLoaderTuner: the reused decision {'failed' if failed else 'passed'} its check: the loop waited for "
        f"data {100 * live.share:.0f}% of {live.counted} steps (recorded when tuned: {100 * recorded_share:.0f}%)."
    )
