"""Host memory of the DataLoader workers against the cgroup's memory limit, estimated before anything is launched."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["WORKER_BYTES", "LoaderMemory", "estimate_loader_memory", "measure_worker_bytes", "worker_footprint"]

WORKER_BYTES = 256 * 2**20
"""A worker's own footprint assumed when it cannot be measured (`measure_worker_bytes` returned None)."""

_measured: dict[int, int | None] = {}
"""`measure_worker_bytes`'s result in this process (keyed by pid: a forked child measures its own)."""


class _OwnMemory:
    """A map-style dataset whose items are the memory unique to the process that reads them (its USS, after a garbage
    collection): read in a DataLoader worker, the worker's own footprint."""

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index: int) -> int:
        import psutil

        gc.collect()  # writes to every tracked object's header: the pages of the parent's heap a worker copies
        return int(psutil.Process().memory_full_info().uss)


def measure_worker_bytes(timeout_s: float = 60.0) -> int | None:
    """A DataLoader worker's own footprint, measured once per process: one worker started from this process as the
    user's loaders start theirs (torch's default start method), reading its unique set size (USS: the pages only it
    holds, which its memory cgroup is charged for) after three items, each read after a full garbage collection.
    None when it cannot be measured (no USS on this platform, or no worker could start); the caller falls back to
    `WORKER_BYTES`.

    The most a forked worker comes to hold, not what it holds at first: a full collection writes to the header of
    every object the parent's heap tracks, so the worker copies those pages. A worker that never runs one holds far
    less (9 MiB against 112 MiB measured for the GPT example's workers, `tests/benchmarks/bench_worker_footprint.py`);
    the check keeps the bound. Measured from the process as it is now: a parent whose Python heap grows later (a
    dataset of Python objects) has workers that may copy more of it.
    """
    pid = os.getpid()
    if pid not in _measured:
        try:
            from torch.utils.data import DataLoader

            dataset: Any = _OwnMemory()  # map-style: all a DataLoader asks of a dataset
            loader = DataLoader(dataset, batch_size=1, num_workers=1, timeout=timeout_s)
            _measured[pid] = max(int(batch.max()) for batch in loader)
        except Exception:  # noqa: BLE001 - a measurement that fails leaves the assumption, never a failed run
            _measured[pid] = None
    return _measured[pid]


def worker_footprint() -> tuple[int, str]:
    """(a worker's own footprint in bytes, "measured" or "assumed"): `measure_worker_bytes`, else `WORKER_BYTES`."""
    measured = measure_worker_bytes()
    return (WORKER_BYTES, "assumed") if measured is None else (measured, "measured")


def _size(value: float) -> str:
    return f"{value / 2**30:.2f} GiB" if abs(value) >= 2**30 else f"{value / 2**20:.0f} MiB"


@dataclass(frozen=True, kw_only=True, slots=True)
class LoaderMemory:
    """What the DataLoader workers of a run hold on the host, against the memory limit."""

    limit_bytes: int | None
    """The cgroup's memory limit (`memory.max`, `memory.limit_in_bytes`); None: no limit."""
    source: str
    """The file that set `limit_bytes`."""
    ranks: int
    """Training processes on this node."""
    num_workers: int
    prefetch_factor: int
    batch_bytes: int
    """Bytes of one batch as the workers hand it over."""
    worker_bytes: int
    """Each worker's own footprint."""
    worker_bytes_note: str = ""
    """Where `worker_bytes` came from, shown beside it: "measured" (`measure_worker_bytes`), "assumed"
    (`WORKER_BYTES`), or "" for the caller's own figure."""
    pin_memory: bool
    """Pinned copies of the prefetched batches (the pin-memory thread), one set per rank."""
    rank_bytes: int
    """What each rank holds itself."""

    def workers_bytes(self, num_workers: int | None = None) -> int:
        """The workers' memory on this node: ranks x workers x (prefetch x batch + footprint), plus pinned batches."""
        workers = self.num_workers if num_workers is None else num_workers
        queued = workers * self.prefetch_factor * self.batch_bytes
        pinned = queued if self.pin_memory else 0
        return self.ranks * (workers * self.worker_bytes + queued + pinned)

    @property
    def available_bytes(self) -> int | None:
        """The limit less what the ranks hold; None without a limit."""
        return None if self.limit_bytes is None else self.limit_bytes - self.ranks * self.rank_bytes

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.workers_bytes() <= self.available_bytes

    @property
    def most_workers(self) -> int | None:
        """The most workers per rank that fit (0 when none do); None without a limit."""
        if self.available_bytes is None:
            return None
        workers = 0
        while workers < 1024 and self.workers_bytes(workers + 1) <= self.available_bytes:
            workers += 1
        return workers

    def describe(self) -> str:
        need = self.workers_bytes()
        shown = (
            f"{self.ranks} rank(s) x {self.num_workers} worker(s) x ({self.prefetch_factor} prefetched x "
            f"{_size(self.batch_bytes)} batches{' + pinned copies' if self.pin_memory else ''} + "
            f"{_size(self.worker_bytes)} each{', ' + self.worker_bytes_note if self.worker_bytes_note else ''}) = "
            f"{_size(need)}"
        )
        if self.limit_bytes is None:
            return f"{shown}; no cgroup memory limit"
        return (
            f"{shown}, beside the ranks' {self.ranks} x {_size(self.rank_bytes)}, against the cgroup's memory limit "
            f"{_size(self.limit_bytes)} ({self.source})"
        )


def estimate_loader_memory(
    *,
    limit_bytes: int | None,
    source: str = "",
    ranks: int = 1,
    num_workers: int = 0,
    prefetch_factor: int = 2,
    batch_bytes: int,
    worker_bytes: int | None = None,
    worker_bytes_note: str = "",
    pin_memory: bool = False,
    rank_bytes: int = 0,
) -> LoaderMemory:
    """The workers' host memory against `limit_bytes` (see `LoaderMemory`); `worker_bytes` None: `WORKER_BYTES`,
    noted "assumed".

    Raises:
        ValueError: for a negative count or size, or `ranks < 1`.
    """
    if worker_bytes is None:
        worker_bytes, worker_bytes_note = WORKER_BYTES, "assumed"
    if ranks < 1 or min(num_workers, prefetch_factor, batch_bytes, worker_bytes, rank_bytes) < 0:
        raise ValueError(
            f"{ranks=} must be >= 1 and {num_workers=}, {prefetch_factor=}, {batch_bytes=}, {worker_bytes=}, "
            f"{rank_bytes=} >= 0"
        )
    return LoaderMemory(
        limit_bytes=limit_bytes,
        source=source,
        ranks=ranks,
        num_workers=num_workers,
        prefetch_factor=prefetch_factor if num_workers > 0 else 0,
        batch_bytes=batch_bytes,
        worker_bytes=worker_bytes,
        worker_bytes_note=worker_bytes_note,
        pin_memory=pin_memory,
        rank_bytes=rank_bytes,
    )
