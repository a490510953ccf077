"""The idle-held tracker: a held card below the activity threshold for the stated time is flagged, dated back
through the history it is given, and cleared by one busy reading or by the card being let go."""

from __future__ import annotations

import pytest

from lightning_accel.telemetry.idle_held import (
    DEFAULT_IDLE_AFTER_S,
    DEFAULT_IDLE_PCT,
    CardSeen,
    IdleHeldTracker,
    trailing_below_since,
)


def card(
    activity: float | None, held: bool = True, holder: str = "job r1", history=(), at: float | None = None
) -> CardSeen:
    return CardSeen(
        host="h",
        uuid="GPU-1",
        index=0,
        name="H100",
        owner="ada",
        holder=holder,
        job="r1",
        activity_pct=activity,
        signal="SM active",
        held=held,
        history=tuple(history),
        at=at,
    )


def test_the_defaults_are_5_percent_for_5_minutes() -> None:
    tracker = IdleHeldTracker()
    assert (DEFAULT_IDLE_PCT, DEFAULT_IDLE_AFTER_S) == (5.0, 300.0)
    assert (tracker.threshold_pct, tracker.after_s) == (5.0, 300.0)


def test_a_held_card_is_flagged_once_idle_past_the_threshold_with_its_owner_and_gpu_hours() -> None:
    tracker = IdleHeldTracker(threshold_pct=5, after_s=10, max_gap_s=5)
    flagged = [tracker.update(t, [card(1.0)]) for t in (100.0, 104.0, 108.0, 109.9)]
    assert all(f == [] for f in flagged)  # 9.9 s idle: not yet
    (idle,) = tracker.update(112.0, [card(2.0)])
    assert (idle.owner, idle.holder, idle.host, idle.index) == ("ada", "job r1", "h", 0)
    assert idle.since == 100.0 and idle.for_s == pytest.approx(12.0)
    assert idle.idle_gpu_hours == pytest.approx(12.0 / 3600)
    assert idle.as_dict()["activity_pct"] == 2.0 and idle.as_dict()["threshold_pct"] == 5.0


def test_one_busy_reading_or_letting_go_ends_the_episode() -> None:
    tracker = IdleHeldTracker(threshold_pct=5, after_s=10, max_gap_s=5)
    for t in (0.0, 4.0, 8.0, 12.0):
        flagged = tracker.update(t, [card(0.0)])
    assert len(flagged) == 1
    assert tracker.update(14.0, [card(50.0)]) == []  # the card works again
    assert tracker.update(16.0, [card(0.0)]) == []  # a new episode starts at 16
    assert tracker.update(20.0, [card(0.0)]) == [] and tracker.update(24.0, [card(0.0)]) == []
    assert tracker.update(26.0, [card(0.0)])[0].since == 16.0
    assert tracker.update(28.0, [card(0.0, held=False)]) == []  # let go: not held, not flagged
    assert tracker.update(30.0, [card(0.0)]) == []  # held again: from 30
    assert tracker.update(32.0, []) == [] and tracker.update(34.0, [card(0.0)]) == []  # gone in between: from 34


def test_no_reading_of_the_lead_signal_is_not_taken_for_idle() -> None:
    tracker = IdleHeldTracker(threshold_pct=5, after_s=1, max_gap_s=5)
    assert [tracker.update(t, [card(None)]) for t in (0.0, 2.0, 4.0)] == [[], [], []]


def test_another_holder_on_the_same_card_starts_its_own_episode() -> None:
    tracker = IdleHeldTracker(threshold_pct=5, after_s=10, max_gap_s=5)
    for t in (0.0, 4.0, 8.0):
        tracker.update(t, [card(0.0)])
    assert tracker.update(12.0, [card(0.0, holder="job r2")]) == []


def test_a_late_start_dates_the_episode_back_through_the_history() -> None:
    history = [(0.0, 80.0), (10.0, 3.0), (20.0, 1.0), (30.0, 0.0), (40.0, 2.0)]
    assert trailing_below_since(history, 40.0, 5.0, 15.0) == 10.0
    assert trailing_below_since(history, 40.0, 5.0, 5.0) == 40.0  # points 10 s apart: no watch
    assert trailing_below_since([(30.0, None), (40.0, 1.0)], 40.0, 5.0, 15.0) == 40.0
    assert trailing_below_since([], 40.0, 5.0, 15.0) == 40.0
    (idle,) = IdleHeldTracker(5, 25, 15).update(40.0, [card(2.0, history=history)])  # --once: one reading
    assert idle.since == 10.0 and idle.for_s == 30.0


def test_within_the_watch_its_own_readings_date_the_episode_and_after_a_gap_the_history_does() -> None:
    tracker = IdleHeldTracker(threshold_pct=5, after_s=10, max_gap_s=30)
    tracker.update(0.0, [card(0.0)])
    mixed = [(0.0, 40.0), (20.0, 0.0)]  # a 10 s mean of busy and idle seconds, then idle
    assert tracker.update(20.0, [card(0.0, history=mixed)])[0].since == 0.0
    late = IdleHeldTracker(threshold_pct=5, after_s=10, max_gap_s=30)
    assert late.update(20.0, [card(0.0, history=mixed)]) == []  # no watch: from the idle point, 20
    assert late.update(70.0, [card(0.0, history=[(50.0, 0.0), (60.0, 1.0), (70.0, 0.0)])])[0].since == 50.0


def test_readings_further_apart_than_the_gap_restart_the_watch() -> None:
    tracker = IdleHeldTracker(threshold_pct=5, after_s=10, max_gap_s=5)
    tracker.update(0.0, [card(0.0)])
    assert tracker.update(20.0, [card(0.0)]) == []  # 20 s unwatched: from 20


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"threshold_pct": 0}, "threshold_pct=0"),
        ({"threshold_pct": 101}, "threshold_pct=101"),
        ({"after_s": 0}, "after_s=0"),
        ({"max_gap_s": -1}, "max_gap_s=-1"),
    ],
)
def test_bad_settings_are_named(kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        IdleHeldTracker(**kwargs)


def test_an_episode_starts_when_its_first_idle_reading_was_taken_not_when_it_was_read() -> None:
    tracker = IdleHeldTracker(threshold_pct=5, after_s=10, max_gap_s=10)
    assert tracker.update(13.0, [card(0.0, at=11.5)]) == []  # a heartbeat written at 11.5, read at 13
    assert tracker.update(21.5, [card(0.0, at=21.0)])[0].since == 11.5
    assert IdleHeldTracker(5, 10, 5).update(5.0, [card(0.0, at=9.0)]) == []  # a reader behind the writer: now
