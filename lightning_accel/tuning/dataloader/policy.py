"""Which DataLoader settings to try and in what order, which to keep, and the memory guard: pure functions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from lightning_accel.tuning.dataloader.timing import LoaderSettings, Trial

__all__ = ["LOADER_BOUND_SHARE", "choose", "memory_note", "no_data_wait", "search", "worker_counts"]

LOADER_BOUND_SHARE = 0.1
"""Above this share of step time waiting for data, more workers than CPUs are tried (the loader may wait on I/O)."""
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
    """Whether `trial` is a finished one without workers whose wait for data is within `tolerance` of its step time.

    Workers can at most take the loading off the step: the best any setting can reach is `samples_per_s / (1 -
    wait_share)`, within `tolerance` of this trial's own rate when `wait_share <= tolerance`. Then no worker can pay,
    and a faster measurement with workers is noise (or another job's load on this trial).
    """
    return trial.settings.num_workers == 0 and trial.status == "done" and trial.steps > 0 and (
        trial.wait_share <= tolerance)  # fmt: skip


def choose(trials: Sequence[Trial], tolerance: float) -> Trial | None:
    """The cheapest finished trial (fewest workers, then least prefetch, then no pinning) within `tolerance` of the
    fastest, or the one without workers when it hardly waits for data (`no_data_wait`); None when no trial
    finished."""
    finished = [t for t in trials if t.status == "done" and t.steps > 0]
    if not finished:
        return None
    if tolerance > 0:
        zero = next((t for t in finished if no_data_wait(t, tolerance)), None)
        if zero is not None:
            return zero
    best = max(t.samples_per_s for t in finished)
    return min((t for t in finished if t.samples_per_s >= best * (1.0 - tolerance)), key=lambda t: t.settings.cost)


def memory_note(settings: LoaderSettings, batch_bytes: int, shm_free: int | None, memory_free: int | None) -> str:
    """Why `settings` cannot run here, or "": `num_workers x prefetch_factor` batches in flight must fit both
    /dev/shm (workers hand batches over through it) and the memory this rank may still use."""
    need = settings.num_workers * (settings.prefetch_factor or 0) * batch_bytes
    if shm_free is not None and need > shm_free:
        return f"{need / _MIB:.0f} MiB in flight > {shm_free / _MIB:.0f} MiB /dev/shm free"
    if memory_free is not None and need > memory_free:
        return f"{need / _MIB:.0f} MiB in flight > {memory_free / _MIB:.0f} MiB memory free"
    return ""


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
) -> list[Trial]:
    """Try settings in a deterministic order that depends only on the trials' (rank-synchronised) results.

    1. Worker counts within the CPU budget (`worker_counts`), and the loader's own settings, with the first prefetch
       factor and no pinning; when the first, without workers, hardly waits for data (`no_data_wait`), only the
       loader's own settings after it, for the speedup figure.
    2. While the fastest setting still waits for data more than `LOADER_BOUND_SHARE` of the time, twice as many
       workers as the last count tried above the budget, up to `max_workers`, while each doubling is faster than
       the fastest before it by more than `tolerance` (on a loader that waits on I/O each doubling pays; on a
       CPU-bound one they bring nothing, and under a CPU quota they cost).
    3. The other prefetch factors, then pinned memory (`pin_memory`, CUDA only), on the fastest count.

    `measure(settings, cut_s_per_step)` times one setting, cutting it short once slower than `cut_s_per_step`;
    `guard(settings)` returns why a setting cannot run ("" when it can). Stops at the first trial that ran out of
    time. Returns every trial, skipped ones included.
    """
    trials: list[Trial] = []
    seen: set[LoaderSettings] = set()

    def bar() -> float | None:
        finished = [t.s_per_step for t in trials if t.status == "done" and t.steps > 0]
        return min(finished) / (1.0 - tolerance) if finished else None

    def attempt(settings: LoaderSettings) -> Trial | None:
        if settings in seen:
            return next(t for t in trials if t.settings == settings)
        seen.add(settings)
        note = guard(settings)
        trial = Trial(settings=settings, status="skipped", note=note) if note else measure(settings, bar())
        trials.append(trial)
        return None if trial.status == "time" else trial

    def base(workers: int) -> LoaderSettings:
        return LoaderSettings(num_workers=workers, prefetch_factor=prefetch_factors[0] if workers else None,
                              persistent_workers=workers > 0)  # fmt: skip

    counts = [base(w) for w in worker_counts(budget)]
    cut_at: int | None = None
    for settings in counts[:1] + ([original] if original is not None else []) + counts[1:]:
        if cut_at is not None and 0 < settings.num_workers < cut_at and settings != original:
            continue  # fewer workers than a count already too slow
        trial = attempt(settings)
        if trial is None:
            return trials
        if no_data_wait(trial, tolerance):  # no worker can pay; the loader's own settings timed for the speedup
            if original is not None and original != settings:
                attempt(original)
            return trials
        if trial.status == "cut" and settings != original:
            cut_at = settings.num_workers
    top, workers = choose(trials, 0.0), budget
    while top is not None and top.settings.num_workers > 0 and top.wait_share > LOADER_BOUND_SHARE:
        more = min(2 * workers, max_workers)
        if more <= workers:
            break
        trial = attempt(base(more))
        if trial is None:
            return trials
        if trial.status != "done":
            break  # cut short: slower than the fastest by more than the tolerance
        paid = trial.samples_per_s > top.samples_per_s * (1.0 + tolerance)
        workers, top = more, max(top, trial, key=lambda t: t.samples_per_s)
        if not paid:
            break  # within the noise of the fastest: the next doubling would not pay either
    fastest = choose(trials, 0.0)
    if fastest is None or fastest.settings.num_workers == 0:
        return trials
    for factor in prefetch_factors[1:]:
        if attempt(replace(fastest.settings, prefetch_factor=factor, pin_memory=False)) is None:
            return trials
    if pin_memory:
        fastest = choose(trials, 0.0) or fastest
        attempt(replace(fastest.settings, pin_memory=True))
    return trials
