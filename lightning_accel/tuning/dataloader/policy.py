"""Which DataLoader settings to try and in what order, which to keep, and the memory guard: pure functions."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightning_accel.measure import Interval, interleaved, ratio
from lightning_accel.system.loader_memory import WORKER_BYTES, estimate_loader_memory
from lightning_accel.tuning.dataloader.decision import (
    WAIT_CEILING,
    TunerDecision,
    loader_bound,
    measured_speedup,
    runs_of,
)
from lightning_accel.tuning.dataloader.loader_settings import LoaderSettings
from lightning_accel.tuning.dataloader.timing import Trial

__all__ = [
    "BUDGET_NOTE",
    "LOADER_BOUND_SHARE",
    "Choice",
    "budget_note",
    "choose",
    "clearly_apart",
    "decide",
    "hardly_waits",
    "loading_busy_share",
    "medians",
    "memory_note",
    "no_data_wait",
    "pick",
    "search",
    "worker_counts",
]

LOADER_BOUND_SHARE = 0.1
"""Above this share of step time waiting for data, more workers than CPUs are tried (the loader may wait on I/O)."""
NOISE_FACTOR = 4.0
MIN_NOISE = 0.2
"""Two timings of different settings closer than `max(MIN_NOISE, NOISE_FACTOR x tolerance)` (relative) are within
the noise of a shared machine: their comparison is repeated before it decides anything."""
BUDGET_NOTE = "over the CPU budget"
"""How a setting skipped for keeping more CPUs busy loading than the rank's budget is noted in the table."""
_MIB = 2**20


def worker_counts(budget: int) -> list[int]:
    """Worker counts tried within the CPU budget, in the order they are tried.

    0 first: without workers the main process loads each batch itself, and the share of the step it waits for it
    bounds what any number of workers can save (on a small CPU quota none can beat it). Then the budget (it sets the
    bar that cuts slower trials short), then halving towards 1 (counts up to 4 one by one).
    """
    counts = [budget]
    while counts[-1] > 1:
        counts.append(counts[-1] - 1 if counts[-1] <= 4 else counts[-1] // 2)
    return [*dict.fromkeys([0, *counts])]


def no_data_wait(trial: Trial, tolerance: float) -> bool:
    """Whether `trial` is a finished one without workers, timed without interference, whose wait for data is within
    `tolerance` of its step time.

    Workers can at most take the loading off the step: the best any setting can reach is `samples_per_s / (1 -
    wait_share)`, within `tolerance` of this trial's own rate when `wait_share <= tolerance`. Then no worker can pay,
    and a faster measurement with workers is noise (or another job's load on this trial). The share is read with
    the median step time (`Trial.loader_share`), so a few steps slowed by another job do not hide the loading; a
    trial under interference (`Trial.flag`) never counts: another job's load can lengthen every step, and a small
    share read then would end the search, or override faster measured settings, on one inflated timing.
    """
    return (
        trial.settings.num_workers == 0
        and trial.status == "done"
        and trial.steps > 0
        and not trial.flag
        and (trial.loader_share <= tolerance)
    )


def hardly_waits(trial: Trial, tolerance: float) -> bool:
    """Whether `trial` (the loader's own settings) finished without interference waiting for data no more than
    `tolerance` of its step time, at the high end of its interval: no setting can then be more than 1 / (1 -
    tolerance) faster (`decision.LoaderBound`), so none is measurably faster, and the search ends."""
    return trial.status == "done" and trial.steps > 0 and not trial.flag and trial.wait_high <= tolerance


def loading_busy_share(trials: Sequence[Trial]) -> float:
    """The share of its loading time a worker keeps a CPU busy, read from the trials without workers (the main
    process loads there itself: `Trial.load_busy_share`, their median): about 1 for a loader that computes, near 0
    for one that waits on storage. 1 when no such trial measured it: every worker then counts as busy."""
    shares = [t.load_busy_share for t in trials if t.status == "done" and t.load_busy_share is not None]
    return statistics.median(shares) if shares else 1.0


def budget_note(settings: LoaderSettings, budget: int, busy_share: float) -> str:
    """Why `settings` would keep more workers busy than this rank's CPU budget holds, or "".

    Up to `budget` workers always fit. Beyond it, `num_workers x busy_share` (`loading_busy_share`) is the CPUs the
    workers keep busy loading: a loader that waits on I/O may have many workers, one that computes no more than
    the budget (8 workers on 2 CPUs only take CPU time from each other and from the step)."""
    workers = settings.num_workers
    busy = workers * busy_share
    if workers <= budget or busy <= budget + 1e-9:
        return ""
    return (
        f"{BUDGET_NOTE}: {workers} workers x {100 * busy_share:.0f}% busy loading = {busy:.1f} CPUs > this "
        f"rank's {budget}"
    )


def medians(trials: Sequence[Trial]) -> list[Trial]:
    """One finished trial per setting, in first-run order: the median-throughput one of its repeats (the lower of
    the middle two for an even count), so a repeated setting is judged by its median, not its luckiest run."""
    runs: dict[LoaderSettings, list[Trial]] = {}
    for t in trials:
        if t.status == "done" and t.steps > 0:
            runs.setdefault(t.settings, []).append(t)
    return [sorted(r, key=lambda t: t.samples_per_s)[(len(r) - 1) // 2] for r in runs.values()]


def choose(trials: Sequence[Trial], tolerance: float) -> Trial | None:
    """The cheapest setting (fewest workers, then least prefetch, then no pinning) whose median throughput is within
    `tolerance` of the fastest median, or the one without workers when it hardly waits for data (`no_data_wait`: its
    median trial timed without interference); its median trial. None when no trial finished.

    (A rule that also kept a cheaper setting whenever the paired repeats' min-max interval reached back to the
    tolerance was tried and measured: under a constant load every trial is flagged, one slow round widens the interval
    of any pair, and it chose 2 workers where 8 were 4x faster in 3 of 7 runs. Medians decide.)"""
    finished = medians(trials)
    if not finished:
        return None
    if tolerance > 0:
        zero = next((t for t in finished if no_data_wait(t, tolerance)), None)
        if zero is not None:
            return zero
    best = max(t.samples_per_s for t in finished)
    return min((t for t in finished if t.samples_per_s >= best * (1.0 - tolerance)), key=lambda t: t.settings.cost)


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """What `pick` settles on: the setting's median run, whether it is the loader's own (kept), and why."""

    trial: Trial
    kept: bool
    reason: str


def _describe(settings: LoaderSettings) -> str:
    if not settings.num_workers:
        return "0 workers"
    return (
        f"{settings.num_workers} worker{'s' if settings.num_workers > 1 else ''}, prefetch {settings.prefetch_factor}"
        f"{', pinned' if settings.pin_memory else ''}"
    )


def pick(
    trials: Sequence[Trial], tolerance: float, *, original: LoaderSettings | None, budget: int | None = None
) -> Choice | None:
    """The setting the trials support, preferring the loader's own settings `original` whenever nothing is
    measurably faster; None when no trial finished.

    1. Every setting's median throughput is capped at what a setting can reach: the loader's own median times the
       bound their data wait sets (`decision.LoaderBound.high`: removing all of their wait), and, when the trial
       without workers hardly waits for data (`no_data_wait`), its rate over 1 - its share. A faster reading is
       noise or another job's load, so it cannot make one setting beat another.
    2. Settings within `tolerance` of the fastest capped median are as fast as it. The loader's own settings win
       among them (kept), unless they keep more workers busy than the CPU budget holds (`budget_note`); then the
       fewest workers, least prefetch, no pinning, among those that fit the budget.
    3. A setting other than the loader's own must be measurably faster than it: the interval of its runs over
       theirs, paired in the order run (`decision.measured_speedup`), above 1 at its low end. Otherwise the
       loader's own settings are kept, and the reason says so.

    So noise decides nothing: two settings both read above the bound tie, and the tie goes to the user's setting,
    else to the cheaper one, whatever order the noise put them in. Without `original` timed (or given), the choice
    is the cheapest setting within `tolerance` of the fastest (`choose`'s rule).
    """
    finished = medians(trials)
    if not finished:
        return None
    busy_share = loading_busy_share(trials)

    def fits(settings: LoaderSettings) -> bool:
        return budget is None or not budget_note(settings, budget, busy_share)

    own_runs = runs_of(trials, original) if original is not None else []
    own = next((t for t in finished if t.settings == original), None)
    if own is None and own_runs:  # cut short: its median estimate
        own = sorted(own_runs, key=lambda t: t.samples_per_s)[(len(own_runs) - 1) // 2]
    bound = loader_bound(trials, original) if original is not None else None
    limit = own.samples_per_s * bound.high if own is not None and bound is not None else math.inf
    zero = next((t for t in finished if no_data_wait(t, tolerance)), None) if tolerance > 0 else None
    if zero is not None:  # no worker can save more than its small wait
        limit = min(limit, zero.samples_per_s / (1.0 - min(zero.loader_share, WAIT_CEILING)))

    def rate(trial: Trial) -> float:
        return min(trial.samples_per_s, limit)

    pool = [*finished, *([own] if own is not None and own not in finished else [])]
    best = max(rate(t) for t in pool)
    ties = [t for t in pool if rate(t) >= best * (1.0 - tolerance)]
    capped = [t.note for t in trials if t.status == "skipped" and t.note.startswith(BUDGET_NOTE)]
    budget_text = f"; the CPU budget bound the search ({capped[0]})" if capped else ""
    bound_text = "" if bound is None else f"your loader's own settings spent {bound.describe()}"
    if own is not None and own in ties and fits(own.settings):
        fastest = max(finished, key=lambda t: t.samples_per_s)
        read = measured_speedup(trials, fastest.settings, own.settings)
        best_text = (
            ""
            if fastest.settings == own.settings or read is None
            else f"; the fastest reading, {_describe(fastest.settings)}, {read.format(unit='x')}"
        )
        return Choice(
            trial=own, kept=True, reason=f"no setting measurably faster ({bound_text}{best_text}){budget_text}"
        )
    candidates = [t for t in ties if fits(t.settings) and t is not own]
    if not candidates:  # only the loader's own, over the budget, is this fast: measured, so kept
        assert own is not None
        return Choice(
            trial=own,
            kept=True,
            reason=f"your settings are faster than any within the CPU budget ({_describe(own.settings)}: "
            f"{budget_note(own.settings, budget or 0, busy_share)}){budget_text}",
        )
    chosen = min(candidates, key=lambda t: t.settings.cost)
    if own is None or original is None:
        return Choice(trial=chosen, kept=False, reason=f"your settings were not timed{budget_text}")
    measured = measured_speedup(trials, chosen.settings, original)
    over = budget_note(own.settings, budget or 0, busy_share) if budget is not None else ""
    if measured is not None and measured.low <= 1.0 and not over:
        return Choice(
            trial=own,
            kept=True,
            reason=f"no setting measurably faster ({_describe(chosen.settings)} read {measured.format(unit='x')} your "
            f"settings, an interval that reaches 1; {bound_text}){budget_text}",
        )
    if over:
        budget_text += f"; your {_describe(own.settings)} would be {over}"
    return Choice(trial=chosen, kept=False, reason=budget_text.removeprefix("; "))


def decide(
    trials: Sequence[Trial],
    tolerance: float,
    *,
    fingerprint: str,
    facts: Mapping[str, Any],
    original: LoaderSettings,
    budget: int | None = None,
    user: LoaderSettings | None = None,
) -> TunerDecision | None:
    """The decision `trials` support (`pick`), with its speedup over the loader's own settings `original` (as timed)
    credited up to the bound their data wait sets; a kept decision applies `user` (the loader's settings exactly as
    built, `original` when not given). Not confident (applied, never cached) when any trial was measured under
    interference. None when no trial finished."""
    choice = pick(trials, tolerance, original=original, budget=budget)
    if choice is None:
        return None
    flags = [t.flag for t in trials if t.flag]
    note = f"measured under interference ({flags[0]})" if flags else ""
    return TunerDecision.from_trials(
        fingerprint,
        facts,
        choice.trial,
        trials,
        original,
        confident=not flags,
        note=note,
        kept=choice.kept,
        reason=choice.reason,
        settings=(user or original) if choice.kept else None,
    )


def memory_note(
    settings: LoaderSettings,
    batch_bytes: int,
    shm_free: int | None,
    memory_free: int | None,
    worker_bytes: int = WORKER_BYTES,
) -> str:
    """Why `settings` cannot run here, or "": `num_workers x prefetch_factor` batches in flight must fit /dev/shm
    (workers hand batches over through it), and those batches, their pinned copies and each worker's own footprint
    (`system.loader_memory`) the memory this rank may still use under the cgroup's limit."""
    in_flight = settings.num_workers * (settings.prefetch_factor or 0) * batch_bytes
    if shm_free is not None and in_flight > shm_free:
        return f"{in_flight / _MIB:.0f} MiB in flight > {shm_free / _MIB:.0f} MiB /dev/shm free"
    need = estimate_loader_memory(
        limit_bytes=None,
        num_workers=settings.num_workers,
        prefetch_factor=settings.prefetch_factor or 0,
        batch_bytes=batch_bytes,
        worker_bytes=worker_bytes,
        pin_memory=bool(settings.pin_memory),
    ).workers_bytes()
    if memory_free is not None and need > memory_free:
        return (
            f"{need / _MIB:.0f} MiB for {settings.num_workers} worker(s) (batches in flight and each worker's own "
            f"{worker_bytes / _MIB:.0f} MiB) > {memory_free / _MIB:.0f} MiB memory free"
        )
    return ""


def clearly_apart(a: Trial, b: Trial, tolerance: float) -> bool:
    """Whether one timing of each settles which is faster: both quiet (no interference flag) and their throughputs
    apart by more than `NOISE_FACTOR` x `tolerance` (at least `MIN_NOISE`). Otherwise the comparison is repeated."""
    if a.flag or b.flag or a.samples_per_s <= 0 or b.samples_per_s <= 0:
        return False
    return abs(b.samples_per_s / a.samples_per_s - 1.0) > max(MIN_NOISE, NOISE_FACTOR * tolerance)


def search(
    measure: Callable[[LoaderSettings, float | None], Trial],
    *,
    budget: int,
    max_workers: int,
    prefetch_factors: Sequence[int],
    pin_memory: bool,
    tolerance: float,
    guard: Callable[[LoaderSettings], str],
    original: LoaderSettings | None = None,
    repeats: int = 3,
) -> list[Trial]:
    """Try settings in a deterministic order that depends only on the trials' (rank-synchronised) results.

    1. Worker counts within the CPU budget (`worker_counts`), and the loader's own settings `original` (timed in
       full, never cut: they are the baseline every claim is set against), with the first prefetch factor and no
       pinning; when the first, without workers, hardly waits for data and was timed without interference
       (`no_data_wait`), only the loader's own settings after it, for the speedup figure; when the loader's own
       settings hardly wait (`hardly_waits`), nothing can be measurably faster and the search ends. A trial
       slower than the fastest by more than `tolerance` is cut short, and a cut count prunes the counts between it
       and 0. A count with more workers than the fastest so far that reads slower than it (cut or not) is compared
       with it again when the two are not `clearly_apart` (one was under interference, or within the noise): a
       burst of another job's load on one trial must neither prune the counts below it nor leave 0 workers as
       the fastest, which ends the search. It prunes only when the repeated comparison confirms it slower.
    2. Twice as many workers as the last count tried above the budget, up to `max_workers`, when the fastest setting
       has workers and still waits for data more than `LOADER_BOUND_SHARE` of the time (read with the median step,
       `Trial.loader_share`) or was timed under interference, and again for as long as each doubling may pay: the
       interval of its throughput over the fastest before it, from paired rounds, reaches above 1 + `tolerance`.
       On a loader that waits on I/O each doubling pays; on a CPU-bound one they bring nothing, under a CPU quota
       they cost. Workers beyond the budget are tried only while they would keep no more CPUs busy loading than
       the budget holds (`budget_note`, from the loading's busy share measured without workers): a count over it
       is skipped, noted in the table, and ends the doublings. Doublings are never cut short: one slow stretch
       of another job's load must not end the search.
    3. The other prefetch factors, then pinned memory (`pin_memory`, CUDA only), on the fastest count within the
       budget.
    4. When the cheapest setting within `tolerance` is not the fastest, and the two are not `clearly_apart`, that
       comparison is repeated too; and the one the decision rests on (`settle`): the loader's own settings against
       `pick`'s choice, or against the fastest other setting when `pick` keeps them.

    A comparison that is not `clearly_apart` (a trial under interference, or within the noise) is repeated
    interleaved, A B A B, `repeats` more rounds uncut (as long as time is left), and decided on medians (`ratio`);
    the repeats are trials of their own, noted "repeat", and `choose` takes each setting's median. So every rule
    that ends or prunes the search (a cut, 0 workers fastest, a doubling that does not pay, the choice) rests on
    repeated timings whenever a single one could have been inflated by another job.

    `measure(settings, cut_s_per_step)` times one setting, cutting it short once slower than `cut_s_per_step` (None:
    never); `guard(settings)` returns why a setting cannot run ("" when it can). Stops at the first trial that ran
    out of time. Returns every trial, skipped ones and repeats included.
    """
    trials: list[Trial] = []
    seen: set[LoaderSettings] = set()
    out_of_time = False

    def bar() -> float | None:
        finished = [t.s_per_step for t in medians(trials)]
        return min(finished) / (1.0 - tolerance) if finished else None

    def attempt(settings: LoaderSettings, cut: bool = True) -> Trial | None:
        nonlocal out_of_time
        if settings in seen:
            return next(t for t in trials if t.settings == settings)
        seen.add(settings)
        note = guard(settings)
        if not note and settings != original:  # the loader's own is timed whatever it asks: it is the baseline
            note = budget_note(settings, budget, loading_busy_share(trials))
        trial = (
            Trial(settings=settings, status="skipped", note=note) if note else measure(settings, bar() if cut else None)
        )
        trials.append(trial)
        out_of_time = trial.status == "time"
        return None if out_of_time else trial

    def compare(a: LoaderSettings, b: LoaderSettings) -> Interval | None:
        """`b`'s throughput over `a`'s, repeated interleaved unless one timing of each settles it (a setting whose
        only timing was cut has none that settles anything: its first round is left out of the pairs)."""
        nonlocal out_of_time
        first = {t.settings: t for t in medians(trials) if t.settings in (a, b)}
        rates: dict[LoaderSettings, list[float | None]] = {
            s: [first[s].samples_per_s if s in first else None] for s in (a, b)
        }
        if a not in first or b not in first or not clearly_apart(first[a], first[b], tolerance):
            for _, settings in interleaved([a, b], repeats):
                trial = measure(settings, None)
                trial.note = trial.note or "repeat"
                trials.append(trial)
                if trial.status == "time":
                    out_of_time = True
                    break
                if trial.status == "done" and trial.steps:
                    rates[settings].append(trial.samples_per_s)
        try:
            return ratio(rates[b], rates[a])
        except ValueError:
            return None

    def base(workers: int) -> LoaderSettings:
        return LoaderSettings(
            num_workers=workers,
            prefetch_factor=prefetch_factors[0] if workers else None,
            persistent_workers=workers > 0,
        )

    def fastest_within_budget() -> Trial | None:
        busy_share = loading_busy_share(trials)
        return choose([t for t in trials if not budget_note(t.settings, budget, busy_share)], 0.0)

    def settle() -> None:
        """Repeat, interleaved, the comparison the decision rests on: the loader's own settings against `pick`'s
        choice, or, when `pick` keeps them, against the fastest other setting within the budget (a single cold or
        loaded reading must not keep them either), unless the two are clearly apart or the
        loader's own settings hardly wait (nothing can beat them); a rival of kept settings that was compared with
        them interleaved already is not compared again."""
        choice = pick(trials, tolerance, original=original, budget=budget)
        own = next((t for t in medians(trials) if t.settings == original), None)
        if choice is None or own is None or hardly_waits(own, tolerance):
            return
        busy_share = loading_busy_share(trials)
        others = [
            t for t in medians(trials) if t.settings != original and not budget_note(t.settings, budget, busy_share)
        ]
        rival = choice.trial if not choice.kept else max(others, key=lambda t: t.samples_per_s, default=None)
        if rival is None or rival.settings == original or clearly_apart(own, rival, tolerance):
            return
        assert original is not None
        if choice.kept and min(len(runs_of(trials, original)), len(runs_of(trials, rival.settings))) > repeats:
            return  # the rival was compared interleaved already, and lost
        compare(original, rival.settings)

    def explore() -> None:
        counts = [base(w) for w in worker_counts(budget)]
        cut_at: int | None = None
        for settings in counts[:1] + ([original] if original is not None else []) + counts[1:]:
            if cut_at is not None and 0 < settings.num_workers < cut_at and settings != original:
                continue  # fewer workers than a count already too slow
            trial = attempt(settings, cut=settings != original)  # the loader's own: the baseline, timed in full
            if trial is None:
                return
            if no_data_wait(trial, tolerance):  # no worker can pay; the loader's own for the speedup
                if original is not None and original != settings:
                    attempt(original, cut=False)
                return
            if settings == original and hardly_waits(trial, tolerance):  # nothing can gain more than the tolerance
                return
            if trial.status not in ("done", "cut"):
                continue
            prunes, fastest = trial.status == "cut" and settings != original, choose(trials, 0.0)
            if (
                fastest is not None
                and fastest.settings.num_workers < settings.num_workers
                and fastest is not trial
                and (not clearly_apart(fastest, trial, tolerance))
            ):  # read slower than fewer workers, under load or within noise: timed again before it decides anything
                gain = compare(fastest.settings, settings)
                if out_of_time:
                    return
                prunes = prunes and gain is not None and gain.median < 1.0 - tolerance  # the cut confirmed
            if prunes:
                cut_at = settings.num_workers
        top, workers, may_pay = fastest_within_budget(), budget, False
        while (
            top is not None
            and top.settings.num_workers > 0
            and (may_pay or top.loader_share > LOADER_BOUND_SHARE or top.flag)
        ):
            more = min(2 * workers, max_workers)
            if more <= workers:
                break
            trial = attempt(base(more), cut=False)
            if trial is None:
                return
            if trial.status != "done":
                break  # skipped: it does not fit the memory or the CPU budget, and more workers would not either
            gain = compare(top.settings, trial.settings)
            if out_of_time:
                return
            # go on while the doubling may pay: its interval reaches above 1 + tolerance (a repeated comparison whose
            # interval straddles it is inconclusive, not a "no"); `choose` keeps the cheaper count unless it is
            # clearly slower
            may_pay = gain is not None and gain.high > 1.0 + tolerance
            workers, top = more, fastest_within_budget()
            if not may_pay:
                break  # slower, or clearly within the tolerance of the fastest: the next doubling would not pay either
        fastest = fastest_within_budget()
        if fastest is None or fastest.settings.num_workers == 0:
            return
        for factor in prefetch_factors[1:]:
            if attempt(replace(fastest.settings, prefetch_factor=factor, pin_memory=False)) is None:
                return
        if pin_memory:
            fastest = fastest_within_budget() or fastest
            if attempt(replace(fastest.settings, pin_memory=True)) is None:
                return
        cheap, fastest = choose(trials, tolerance), choose(trials, 0.0)
        if cheap is not None and fastest is not None and cheap.settings != fastest.settings:
            compare(cheap.settings, fastest.settings)  # its repeats count in `choose`'s medians

    explore()
    if original is not None and not out_of_time:  # the decision's claim, on repeated timings
        settle()
    return trials
