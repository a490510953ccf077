"""Timing one DataLoader setting on real training steps, and rebuilding a DataLoader with other settings; no Trainer."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_accel import _lightning
from lightning_accel.signals import pending_signal
from lightning_accel.tuning.dataloader.settings import LoaderSettings

__all__ = [
    "Status",
    "Sync",
    "Trial",
    "TrialError",
    "batch_nbytes",
    "frozen_rng",
    "loader_settings",
    "rebuild_loader",
    "run_trial",
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


def rebuild_loader(loader: DataLoader, settings: LoaderSettings, stall_timeout_s: float = 0.0) -> DataLoader:
    """A new DataLoader over the same dataset, sampler, batching and collation, with `settings`.

    The sampler (or batch sampler) object is shared, not copied, so a `DistributedSampler` keeps its rank's shard.
    `stall_timeout_s`: with workers, the longest wait for one batch when the loader sets no `timeout` itself (a
    stalled worker raises instead of blocking this rank and, in its collectives, every other); 0: no limit.

    Raises:
        TypeError: for a DataLoader subclass or an `IterableDataset`, whose workers each replay the whole stream
            unless the dataset shards itself: neither is rebuilt.
    """
    if type(loader) is not DataLoader:
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
    if loader.batch_size is not None:  # DataLoader made the BatchSampler from batch_size, sampler and drop_last
        return DataLoader(
            loader.dataset, batch_size=loader.batch_size, sampler=loader.sampler, drop_last=loader.drop_last, **common
        )
    if loader.batch_sampler is not None:
        return DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, **common)
    return DataLoader(loader.dataset, batch_size=None, sampler=loader.sampler, **common)


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
) -> Trial:
    """Time `steps` training steps on batches of a loader built with `settings`, after `warmup` untimed ones.

    Every rank calls this with the same arguments. Ranks compare notes (`sync`) at the start and every quarter of the
    timed steps (at least as many steps as workers: workers deliver in rounds), so all of them stop at the same step:
    when the time per step already exceeds `cut_s_per_step` (status "cut"), when `deadline` (a `clock()` value) has
    passed on any rank ("time"), or when a rank failed.

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
                    t0 = clock()
                    batch = next(iterator)
                    t1 = clock()
                    step(batch, warmup + index)
                    t2 = clock()
                    timed, wait, done = timed + t2 - t0, wait + t1 - t0, done + 1
                    computes.append(t2 - t1)
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
    seconds, wait_s, startup_s, fewest, step_s, failed, signalled = sync(
        [timed, wait, trial.startup_s, -done, median, float(error is not None), float(pending_signal())]
    )
    _stop_if_signalled(signalled)  # every rank together: a stop signal on any of them ends the trials
    if failed:
        raise TrialError(
            f"DataLoader trial {settings} failed: {error!r}"
            if error
            else f"DataLoader trial {settings} failed on another rank"
        ) from error
    trial.steps, trial.seconds, trial.wait_s, trial.startup_s = int(-fewest), seconds, wait_s, startup_s
    trial.step_s_median = step_s
    if trial.steps == 0 and trial.status == "done":
        trial.status, trial.note = "time", "no batch was timed"
    return trial
