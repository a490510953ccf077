"""Timing one DataLoader setting on real training steps, and rebuilding a DataLoader with other settings; no Trainer."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_accel import _lightning
from lightning_accel.signals import pending_signal
from lightning_accel.tuning.dataloader.loader_settings import LoaderSettings

__all__ = [
    "Status",
    "Sync",
    "Trial",
    "TrialError",
    "batch_nbytes",
    "frozen_rng",
    "loader_settings",
    "rebuild_loader",
    "SeedKeepingDataLoader",
    "run_trial",
    "share_interval",
    "thread_busy_s",
    "trial_window",
]

Status = Literal["done", "cut", "skipped", "time"]
Sync = Callable[[Sequence[float]], list[float]]
"""Element-wise max of a short vector over all ranks (identity on one process): keeps ranks in lockstep."""


@dataclass(kw_only=True, slots=True)
class Trial:
    """One setting timed over real training steps; times are the slowest rank's."""

    settings: LoaderSettings
    status: Status = "done"
    """done; cut (slower than the best by more than the tolerance); skipped (memory guard); time (budget used up)."""
    steps: int = 0
    """Timed steps (after the warm-up)."""
    seconds: float = 0.0
    """Wall time of the timed steps: waiting for each batch plus the training step on it."""
    wait_s: float = 0.0
    """Of `seconds`, the time spent waiting for batches."""
    startup_s: float = 0.0
    """From `iter(loader)` to the first batch: what a non-persistent loader pays again every epoch."""
    samples_per_batch: int = 0
    step_s_median: float = 0.0
    """Median time of one training step (without the wait for its batch): a burst of another job's load lengthens
    a few steps, not the median."""
    flag: str = ""
    """Why the trial was measured under interference (another process took our CPUs, steal), "" when quiet."""
    note: str = ""
    wait_interval: tuple[float, float] | None = None
    """95% interval of `wait_share` (`share_interval` over the timed steps, in blocks of one round of workers; the
    widest of the ranks'); None: not measured (taken as `wait_share` itself)."""
    load_busy_s: float = 0.0
    """Without workers: the seconds the main thread spent running or runnable (waiting for a CPU) while it loaded
    the timed batches itself (`thread_busy_s`); over `wait_s`, the share of loading that keeps a CPU busy
    (`load_busy_share`). 0 with workers (they load elsewhere)."""

    @property
    def s_per_step(self) -> float:
        return self.seconds / self.steps if self.steps else float("inf")

    @property
    def samples_per_s(self) -> float:
        return self.steps * self.samples_per_batch / self.seconds if self.seconds > 0 else 0.0

    @property
    def wait_share(self) -> float:
        """Share of the step time spent waiting for data, 0..1."""
        return self.wait_s / self.seconds if self.seconds > 0 else 0.0

    @property
    def loader_share(self) -> float:
        """Share of the step time waiting for data, with each step taken at the median step time (0..1).

        What the search reads to decide whether more workers may pay: another job's load lengthens some training
        steps, which shrinks `wait_share` although the loader is as slow as before; the median step is not lengthened
        by a few slow ones."""
        compute = self.steps * self.step_s_median if self.step_s_median > 0 else self.seconds - self.wait_s
        return self.wait_s / (self.wait_s + compute) if self.wait_s + compute > 0 else 0.0

    @property
    def wait_low(self) -> float:
        """The low end of the data-wait share's interval (0..1)."""
        return min(self.wait_interval[0], self.wait_share) if self.wait_interval else self.wait_share

    @property
    def wait_high(self) -> float:
        """The high end of the data-wait share's interval, never below `loader_share` (the share with the median
        step, which a few steps lengthened by another job do not shrink) (0..1)."""
        high = max(self.wait_interval[1], self.wait_share) if self.wait_interval else self.wait_share
        return max(high, self.loader_share)

    @property
    def load_busy_share(self) -> float | None:
        """Without workers, the share of the loading time the loading kept a CPU busy (0..1): near 1 for a loader
        that computes (decodes, augments, indexes tensors), near 0 for one that waits on storage or the network;
        None with workers or without a wait to measure."""
        if self.settings.num_workers or self.wait_s <= 0 or self.steps == 0:
            return None
        return min(1.0, max(0.0, self.load_busy_s / self.wait_s))

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.settings.as_dict(),
            "status": self.status,
            "steps": self.steps,
            "seconds": self.seconds,
            "wait_s": self.wait_s,
            "startup_s": self.startup_s,
            "samples_per_s": self.samples_per_s,
            "wait_share": self.wait_share,
            "step_s_median": self.step_s_median,
            "flag": self.flag,
            "note": self.note,
            "wait_low": self.wait_low,
            "wait_high": self.wait_high,
            "load_busy_s": self.load_busy_s,
        }


class TrialError(RuntimeError):
    """A trial failed on this or another rank; every rank raises it at the same point."""


def loader_settings(loader: DataLoader) -> LoaderSettings:
    """The settings `loader` was built with."""
    workers = int(loader.num_workers)
    return LoaderSettings(
        num_workers=workers,
        prefetch_factor=loader.prefetch_factor if workers else None,
        pin_memory=bool(loader.pin_memory),
        persistent_workers=bool(loader.persistent_workers),
    )


class SeedKeepingDataLoader(DataLoader):
    """A DataLoader whose persistent workers leave the process's random stream as non-persistent ones would.

    A fresh iterator (every epoch without persistent workers) draws its workers' base seed from the loader's
    generator, or the global torch RNG; a persistent one is reused and draws nothing. This loader draws that number
    again on every reuse, so the shuffle and dropout of later epochs draw what they would with the loader's own
    settings. Built by `rebuild_loader` where it turns a loader's workers persistent; the same arguments as
    DataLoader, so Lightning re-creates it (to add a DistributedSampler) as it re-creates a DataLoader.
    """

    def __iter__(self) -> Any:
        if self._iterator is not None:  # set only for persistent workers, from their first epoch on
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)  # what a fresh iterator draws
        return super().__iter__()


def rebuild_loader(loader: DataLoader, settings: LoaderSettings, stall_timeout_s: float = 0.0) -> DataLoader:
    """A new DataLoader over the same dataset, sampler, batching and collation, with `settings`.

    The sampler (or batch sampler) object is shared, not copied, so a `DistributedSampler` keeps its rank's shard.
    Workers made persistent where `loader`'s were not come in a `SeedKeepingDataLoader`, which draws from the random
    streams as `loader` would.
    `stall_timeout_s`: with workers, the longest wait for one batch when the loader sets no `timeout` itself (a
    stalled worker raises instead of blocking this rank and, in its collectives, every other); 0: no limit.

    Raises:
        TypeError: for a DataLoader subclass or an `IterableDataset`, whose workers each replay the whole stream
            unless the dataset shards itself: neither is rebuilt.
    """
    if type(loader) not in (DataLoader, SeedKeepingDataLoader):
        raise TypeError(f"{type(loader).__name__} is a DataLoader subclass; only torch's DataLoader is rebuilt.")
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError("an IterableDataset changes meaning with num_workers (each worker replays it); not rebuilt.")
    workers = settings.num_workers
    common: dict[str, Any] = {
        "num_workers": workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": settings.pin_memory,
        "timeout": (loader.timeout or stall_timeout_s) if workers else 0,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context if workers else None,
        "generator": loader.generator,
        "prefetch_factor": (settings.prefetch_factor or 2) if workers else None,
        "persistent_workers": settings.persistent_workers and workers > 0,
        "pin_memory_device": loader.pin_memory_device,
    }
    if hasattr(loader, "in_order"):
        common["in_order"] = loader.in_order
    # a SeedKeepingDataLoader stands for a loader whose workers were not persistent: rebuilt, it keeps drawing as it
    was_persistent = type(loader) is DataLoader and loader.persistent_workers and loader.num_workers > 0
    kind = SeedKeepingDataLoader if common["persistent_workers"] and not was_persistent else DataLoader
    if loader.batch_size is not None:  # DataLoader made the BatchSampler from batch_size, sampler and drop_last
        return kind(
            loader.dataset, batch_size=loader.batch_size, sampler=loader.sampler, drop_last=loader.drop_last, **common
        )
    if loader.batch_sampler is not None:
        return kind(loader.dataset, batch_sampler=loader.batch_sampler, **common)
    return kind(loader.dataset, batch_size=None, sampler=loader.sampler, **common)


def batch_nbytes(batch: Any) -> int:
    """Bytes of the tensors in a (nested) batch: what one batch in flight takes in shared memory."""
    if isinstance(batch, torch.Tensor):
        return batch.nelement() * batch.element_size()
    if isinstance(batch, Mapping):
        return sum(batch_nbytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(batch_nbytes(v) for v in batch)
    return sum(batch_nbytes(v) for v in vars(batch).values()) if dataclasses.is_dataclass(batch) else 0


def _generators(loaders: Iterable[DataLoader]) -> list[torch.Generator]:
    found: dict[int, torch.Generator] = {}
    for loader in loaders:
        for owner in (loader, loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
            gen = getattr(owner, "generator", None)
            if isinstance(gen, torch.Generator):
                found[id(gen)] = gen
    return list(found.values())


@contextlib.contextmanager
def frozen_rng(loaders: Iterable[DataLoader] = ()) -> Iterator[None]:
    """Restore the global RNGs (torch, CUDA, numpy, random) and the loaders' own generators on exit, even on error."""
    generators = _generators(loaders)
    states = _lightning.collect_rng_states(include_cuda=torch.cuda.is_available())
    saved = [g.get_state() for g in generators]
    try:
        yield
    finally:
        _lightning.set_rng_states(states)
        for gen, state in zip(generators, saved, strict=True):
            gen.set_state(state)


def _shutdown(iterator: Any) -> None:
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()


def _stop_if_signalled(signum: float) -> None:
    """`SignalExit` on every rank when any rank has a stop signal pending (the value came through `sync`)."""
    if signum:
        from lightning_accel.signals import SignalExit, clear_signal

        clear_signal()
        raise SignalExit(int(signum))


_SCHEDSTAT = "/proc/thread-self/schedstat"


def thread_busy_s() -> float:
    """Seconds the calling thread has run or waited runnable for a CPU: Linux's `/proc/thread-self/schedstat` (on-CPU
    plus run-queue time), else its CPU time (`time.thread_time`, which misses the run-queue wait).

    Over a stretch of loading, its change is how much of that stretch the loading kept (or wanted) a CPU, whatever
    else runs beside it: a read from disk or the network sleeps and counts nothing, a decode counts fully even while
    another job holds the CPU it waits for."""
    try:
        with open(_SCHEDSTAT, "rb") as stat:
            on_cpu, runnable = stat.read().split()[:2]
        return (int(on_cpu) + int(runnable)) / 1e9
    except (OSError, ValueError):
        return time.thread_time()


def share_interval(
    waits: Sequence[float], steps: Sequence[float], block: int = 1, resamples: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """95% interval of `sum(waits) / sum(steps)` (the share of step time spent waiting for data), by a percentile
    bootstrap over blocks of `block` consecutive steps (workers deliver in rounds: the waits of one round belong
    together); fixed seed, so the same steps give the same interval. With fewer than two blocks: the share itself.

    Args:
        waits: each timed step's wait for its batch (s).
        steps: each timed step's whole time, wait included (s).
        block: steps per block (the number of workers; 1 without).
    """
    size = max(1, block)
    blocks = [(sum(waits[i : i + size]), sum(steps[i : i + size])) for i in range(0, len(steps), size)]
    total = sum(t for _, t in blocks)
    share = sum(w for w, _ in blocks) / total if total > 0 else 0.0
    if len(blocks) < 2:
        return share, share
    rng = random.Random(seed)
    shares = []
    for _ in range(resamples):
        drawn = rng.choices(blocks, k=len(blocks))
        spent = sum(t for _, t in drawn)
        shares.append(sum(w for w, _ in drawn) / spent if spent > 0 else 0.0)
    shares.sort()
    low, high = shares[int(0.025 * (resamples - 1))], shares[math.ceil(0.975 * (resamples - 1))]
    return min(low, share), max(high, share)


def trial_window(workers: int, warmup_steps: int, steps_per_trial: int, batches: int) -> tuple[int, int]:
    """(warm-up, timed) steps of a trial with `workers` on a loader of `batches` batches.

    The warm-up is at least one step per worker (all have started and delivered once); the timed steps are at least
    two per worker and a multiple of the workers, so they span whole rounds of deliveries; both fit the loader.
    """
    rounds = max(1, workers)
    warmup = min(max(warmup_steps, workers), max(0, batches - 1))
    timed = math.ceil(max(steps_per_trial, 2 * workers) / rounds) * rounds
    return warmup, min(timed, max(1, batches - warmup))


def run_trial(
    make_loader: Callable[[LoaderSettings], Iterable[Any]],
    step: Callable[[Any, int], None],
    settings: LoaderSettings,
    *,
    warmup: int,
    steps: int,
    samples_per_batch: int,
    cut_s_per_step: float | None = None,
    deadline: float = float("inf"),
    sync: Sync = list,
    clock: Callable[[], float] = time.perf_counter,
    busy_clock: Callable[[], float] = thread_busy_s,
) -> Trial:
    """Time `steps` training steps on batches of a loader built with `settings`, after `warmup` untimed ones.

    Every rank calls this with the same arguments. Ranks compare notes (`sync`) at the start and every quarter of the
    timed steps (at least as many steps as workers: workers deliver in rounds), so all of them stop at the same step:
    when the time per step already exceeds `cut_s_per_step` (status "cut"), when `deadline` (a `clock()` value) has
    passed on any rank ("time"), or when a rank failed. Each step's wait and time are kept for the interval of the
    data-wait share (`share_interval`); without workers, the main thread's busy time while loading (`busy_clock`).

    Raises:
        TrialError: on every rank, when building, iterating or stepping failed on any rank.
    """
    trial = Trial(settings=settings, samples_per_batch=samples_per_batch)
    late, signalled = sync([float(clock() >= deadline), float(pending_signal())])
    _stop_if_signalled(signalled)
    if late:
        trial.status, trial.note = "time", "out of time"
        return trial
    error: BaseException | None = None
    iterator: Any = None
    timed = wait = 0.0
    done, exhausted, check = 0, False, max(1, steps // 4, settings.num_workers)
    computes: list[float] = []
    waits: list[float] = []
    busy = 0.0
    measure_busy = settings.num_workers == 0  # with workers the loading runs in their processes
    try:
        start = clock()
        try:
            iterator = iter(make_loader(settings))
            for index in range(warmup):
                batch = next(iterator)
                if index == 0:
                    trial.startup_s = clock() - start
                step(batch, index)
        except StopIteration:
            exhausted = True
        except Exception as err:  # reported to every rank below, raised after the last collective
            error = err
        for index in range(steps):
            if error is None and not exhausted:
                try:
                    b0 = busy_clock() if measure_busy else 0.0
                    t0 = clock()
                    batch = next(iterator)
                    t1 = clock()
                    busy += busy_clock() - b0 if measure_busy else 0.0
                    step(batch, warmup + index)
                    t2 = clock()
                    timed, wait, done = timed + t2 - t0, wait + t1 - t0, done + 1
                    computes.append(t2 - t1)
                    waits.append(t1 - t0)
                except StopIteration:
                    exhausted = True
                except Exception as err:
                    error = err
            if (index + 1) % check and index + 1 < steps:
                continue
            slowest, late, failed, ended, signalled = sync(
                [timed, float(clock() >= deadline), float(error is not None), float(exhausted), float(pending_signal())]
            )
            if failed or ended or signalled or index + 1 == steps:
                break
            if cut_s_per_step is not None and slowest > (index + 1) * cut_s_per_step:
                trial.status, trial.note = "cut", "cut"
                break
            if late:
                trial.status, trial.note = "time", "out of time"
                break
    finally:
        try:
            _shutdown(iterator)
        except Exception as err:  # reported to every rank by the collective below, like a failed step
            error = error or err
    median = sorted(computes)[len(computes) // 2] if computes else 0.0
    low, high = share_interval(waits, [w + c for w, c in zip(waits, computes, strict=True)], settings.num_workers)
    seconds, wait_s, startup_s, fewest, step_s, lowest, highest, busy_s, failed, signalled = sync(
        [
            timed,
            wait,
            trial.startup_s,
            -done,
            median,
            -low,
            high,
            busy,
            float(error is not None),
            float(pending_signal()),
        ]
    )
    _stop_if_signalled(signalled)  # every rank together: a stop signal on any of them ends the trials
    if failed:
        raise TrialError(
            f"DataLoader trial {settings} failed: {error!r}"
            if error
            else f"DataLoader trial {settings} failed on another rank"
        ) from error
    trial.steps, trial.seconds, trial.wait_s, trial.startup_s = int(-fewest), seconds, wait_s, startup_s
    trial.step_s_median, trial.load_busy_s = step_s, busy_s
    trial.wait_interval = (-lowest, highest) if trial.steps else None
    if trial.steps == 0 and trial.status == "done":
        trial.status, trial.note = "time", "no batch was timed"
    return trial
