"""Host memory of the DataLoader workers against the cgroup's memory limit, estimated before anything is launched."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WORKER_BYTES", "LoaderMemory", "estimate_loader_memory"]

WORKER_BYTES = 256 * 2**20
"""A worker's own footprint assumed when none is measured (pages of the parent it writes to, copy on write, and its
Python and torch state): an assumption, not a measurement; pass `worker_bytes` when you have one."""


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
            f"{_size(self.worker_bytes)} each) = {_size(need)}"
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
    worker_bytes: int = WORKER_BYTES,
    pin_memory: bool = False,
    rank_bytes: int = 0,
) -> LoaderMemory:
    """The workers' host memory against `limit_bytes` (see `LoaderMemory`).

    Raises:
        ValueError: for a negative count or size, or `ranks < 1`.
    """
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
        pin_memory=pin_memory,
        rank_bytes=rank_bytes,
    )
