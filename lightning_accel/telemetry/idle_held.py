"""Idle-held cards: a card that a process holds (memory on it) while its SM activity stays below a threshold.

A card counts as idle-held once its lead signal (SM activity where the card gives NVML GPM, else utilisation, as
`heartbeat.lead_signal` picks it) has stayed below `threshold_pct` for `after_s` while someone holds it: a running
job of ours (its heartbeat lists the card), or any process NVML shows on it. The episode starts at the first reading
below the threshold and ends at the first reading at or above it, or when the card is let go; its idle GPU-hours are
its length in hours (one card). A reading without a lead signal says nothing: the episode is dropped, never guessed.

The tracker is fed what accel-dash reads each time it builds the page. A heartbeat carries ten minutes of history
(`heartbeat.HISTORY_S`), so a tracker that starts late (accel-dash just started, `--once`) dates the episode back
through the trailing run of points below the threshold (each point the mean of 10 s: a point that mixes the busy and
the idle seconds ends the run, so a late start dates an episode late, never early). Readings at most `max_gap_s` apart
are one watch, dated by the tracker's own readings; after a longer gap the episode is dated from the history again,
or from now. No Lightning imports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "DEFAULT_IDLE_AFTER_S",
    "DEFAULT_IDLE_PCT",
    "DEFAULT_MAX_GAP_S",
    "CardSeen",
    "IdleHeld",
    "IdleHeldTracker",
    "holding_processes",
    "job_holder",
    "processes_holder",
    "trailing_below_since",
]

DEFAULT_IDLE_PCT = 5.0
"""SM activity (or utilisation) below this, in %, counts as idle: a training loop keeps a card well above it, an
open notebook's idle context or a job stuck on its data reads 0 to 2%."""
DEFAULT_IDLE_AFTER_S = 300.0
"""Idle this long while held flags the card: longer than a checkpoint write, an evaluation on the CPU or a
DataLoader's first fill, shorter than the hour after which clusters' job-defence tools write to the owner."""
DEFAULT_MAX_GAP_S = 30.0
"""Readings further apart than this are not one watch: the episode is dated from the history again, or from now (the
page reads every 2 s; a busy spell shorter than the readings' spacing is not seen)."""


def holding_processes(processes: Sequence[Mapping[str, Any]] | None) -> list[Mapping[str, Any]]:
    """The processes (`telemetry.host_gpus`' `pid`, `user`, `name`, `memory_mib`) that hold memory on a card: those
    with memory, and those whose memory NVML does not tell."""
    return [p for p in processes or [] if p.get("memory_mib") is None or p["memory_mib"] > 0]


def processes_holder(holding: Sequence[Mapping[str, Any]]) -> str:
    """The holder of a card no job of ours holds, as the page and the usage name it: `pid 41 python, pid 77 jupyter`."""
    return ", ".join(f"pid {p['pid']} {p['name']}" for p in holding)


def job_holder(beat: Mapping[str, Any]) -> str:
    """The holder of a job's cards, as the page and the usage name it: the run's name and id."""
    return f"{beat['name']} {beat['run_id']}"


@dataclass(frozen=True)
class CardSeen:
    """One reading of a card as accel-dash sees it.

    Attributes:
        host: the machine.
        uuid: the card's NVML UUID.
        index: its NVML index on the host.
        name: its product name.
        owner: the user holding it (a job's user, or the users of the processes on it).
        holder: what holds it: a job (`<run name> <run id>`) or processes (`pid 4242 python`).
        job: the run id of a job of ours, or None for other processes.
        activity_pct: the lead signal now (%), or None where the card gives neither.
        signal: the lead signal's label (`SM active`, `util (fallback)`).
        held: whether a process holds memory on it.
        history: earlier readings of the same signal, oldest first: (time, value or None).
        at: when `activity_pct` was read (a heartbeat's time on the reader's clock); None: now.
    """

    host: str
    uuid: str
    index: int
    name: str
    owner: str
    holder: str
    job: str | None
    activity_pct: float | None
    signal: str
    held: bool
    history: Sequence[tuple[float, float | None]] = ()
    at: float | None = None


@dataclass(frozen=True)
class IdleHeld:
    """A card flagged idle-held: who holds it, since when (epoch s), for how long and the idle GPU-hours so far."""

    host: str
    uuid: str
    index: int
    name: str
    owner: str
    holder: str
    job: str | None
    signal: str
    activity_pct: float
    threshold_pct: float
    since: float
    for_s: float
    idle_gpu_hours: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def trailing_below_since(
    history: Sequence[tuple[float, float | None]], now: float, threshold_pct: float, max_gap_s: float
) -> float:
    """The start of the run of readings below `threshold_pct` that ends at `now`: the oldest point of the trailing
    run whose points are each within `max_gap_s` of the next (a missing value or one at or above ends the run);
    `now` when the history has none."""
    since = now
    for t, value in reversed(history):
        if t > now:
            continue
        if value is None or value >= threshold_pct or since - t > max_gap_s:
            break
        since = t
    return since


class IdleHeldTracker:
    """Follows each held card's idle episode across `update` calls and flags those idle for `after_s` or more.

    Args:
        threshold_pct: the lead signal below this counts as idle (%).
        after_s: idle this long while held flags the card (s).
        max_gap_s: readings further apart than this are not one watch (see the module's docstring).

    Raises:
        ValueError: a threshold outside (0, 100], or a duration that is not > 0, named with its value.
    """

    def __init__(
        self,
        threshold_pct: float = DEFAULT_IDLE_PCT,
        after_s: float = DEFAULT_IDLE_AFTER_S,
        max_gap_s: float = DEFAULT_MAX_GAP_S,
    ) -> None:
        if not 0 < threshold_pct <= 100:
            raise ValueError(f"idle threshold_pct={threshold_pct!r}: give a percentage in (0, 100], e.g. 5")
        for name, value in (("after_s", after_s), ("max_gap_s", max_gap_s)):
            if not value > 0:
                raise ValueError(f"idle {name}={value!r}: give a number of seconds > 0")
        self.threshold_pct, self.after_s, self.max_gap_s = float(threshold_pct), float(after_s), float(max_gap_s)
        self._episodes: dict[tuple[str, str, str], tuple[float, float]] = {}
        """(host, uuid, holder) -> (since, last reading's time)."""

    def update(self, now: float, cards: Iterable[CardSeen]) -> list[IdleHeld]:
        """Read one round of cards taken at `now`; returns the cards idle-held now, longest first. A card not in
        `cards` (its job ended, the host went away) ends its episode."""
        episodes: dict[tuple[str, str, str], tuple[float, float]] = {}
        flagged: list[IdleHeld] = []
        for card in cards:
            value = card.activity_pct
            if not card.held or value is None or value >= self.threshold_pct:
                continue
            key = (card.host, card.uuid, card.holder)
            known = self._episodes.get(key)
            if known is not None and now - known[1] <= self.max_gap_s:
                since = known[0]  # watched: its own readings date the episode
            else:
                read_at = now if card.at is None else min(card.at, now)
                since = trailing_below_since(card.history, read_at, self.threshold_pct, self.max_gap_s)
            episodes[key] = (since, now)
            idle_s = now - since
            if idle_s >= self.after_s:
                flagged.append(
                    IdleHeld(
                        host=card.host,
                        uuid=card.uuid,
                        index=card.index,
                        name=card.name,
                        owner=card.owner,
                        holder=card.holder,
                        job=card.job,
                        signal=card.signal,
                        activity_pct=float(value),
                        threshold_pct=self.threshold_pct,
                        since=since,
                        for_s=idle_s,
                        idle_gpu_hours=idle_s / 3600.0,
                    )
                )
        self._episodes = episodes
        flagged.sort(key=lambda card: (-card.for_s, card.host, card.index))
        return flagged
