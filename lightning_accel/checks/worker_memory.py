"""DataLoader workers and the cgroup's memory: refused before launch when they cannot fit, and a worker SIGKILLed
during the run named with its cause."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from lightning_accel.errors import ConfigError

if TYPE_CHECKING:
    from lightning_accel.errors import WorkerKilledError
    from lightning_accel.system.loader_memory import LoaderMemory

__all__ = ["CGROUP_ROOT", "check_loader_memory", "oom_kills", "worker_killed_error"]


def _batch_bytes(data: Any) -> int | None:
    """Bytes of one training batch, where the config alone says: a language-model batch (`batch_size` x `block_size`
    int64 tokens, inputs and targets); None for data whose batches the config does not describe."""
    if not isinstance(data, (DictConfig, Mapping)):
        return None
    batch, block = data.get("batch_size"), data.get("block_size")
    if isinstance(batch, int) and isinstance(block, int) and batch > 0 and block > 0:
        return 2 * batch * block * 8
    return None


def check_loader_memory(
    cfg: DictConfig,
    ranks: int,
    *,
    root: str = "/",
    rank_bytes: int | None = None,
    worker_bytes: int | None = None,
) -> LoaderMemory | None:
    """Refuse, before launch, DataLoader workers that the cgroup's memory limit cannot hold: ranks x workers x
    (prefetched batches + each worker's footprint), plus pinned copies, beside what the ranks hold.

    A worker's footprint (`worker_bytes`; None: measured once, `system.loader_memory.worker_footprint`, and only
    when there is a limit to hold it against: one worker started for a second or two).

    Returns the estimate (`system.loader_memory.LoaderMemory`), or None when the config does not say a batch's size.

    Raises:
        ConfigError: naming `data.num_workers`, the figures and the most workers that fit.
    """
    from lightning_accel.system.cgroup import read_memory_limit
    from lightning_accel.system.loader_memory import estimate_loader_memory, worker_footprint

    data = cfg.get("data")
    batch_bytes = _batch_bytes(data)
    workers = data.get("num_workers", 0) if isinstance(data, (DictConfig, Mapping)) else 0
    if batch_bytes is None or not isinstance(workers, int) or workers <= 0:
        return None
    if rank_bytes is None:
        import psutil

        rank_bytes = psutil.Process().memory_info().rss
    limit = read_memory_limit(root)
    note = ""
    if worker_bytes is None and limit.limit_bytes is not None:
        worker_bytes, note = worker_footprint()
    prefetch = data.get("prefetch_factor") or 2
    estimate = estimate_loader_memory(
        limit_bytes=limit.limit_bytes,
        source=limit.source,
        ranks=ranks,
        num_workers=workers,
        prefetch_factor=prefetch if isinstance(prefetch, int) else 2,
        batch_bytes=batch_bytes,
        worker_bytes=worker_bytes,
        worker_bytes_note=note,
        pin_memory=bool(data.get("pin_memory", False)),
        rank_bytes=rank_bytes,
    )
    if not estimate.fits:
        most = estimate.most_workers
        fix = (
            f"use `data.num_workers={most}` (the most that fit)"
            if most
            else "use `data.num_workers=0` (no worker fits)"
        )
        raise ConfigError(
            f"`data.num_workers={workers}` would be OOM-killed: {estimate.describe()}; {fix}, a smaller "
            "`data.batch_size` or `data.prefetch_factor`, or raise the memory limit (`docker run --memory`)."
        )
    return estimate


CGROUP_ROOT = "/"
"""The root the cgroup's memory files are read under when a worker dies (tests point it at a fake tree)."""
_WORKER_KILLED = re.compile(
    r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (?:is killed by signal: Killed|exited unexpectedly)"
)


def oom_kills() -> int | None:
    """The memory cgroup's OOM-kill count now (`system.cgroup.read_oom_kills`), read when a run starts so a kill
    during the run can be told from older ones; None when unreadable."""
    from lightning_accel.system.cgroup import read_oom_kills

    found = read_oom_kills(CGROUP_ROOT)
    return None if found is None else found[0]


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB"


def worker_killed_error(
    err: BaseException, trainer: Any, *, oom_kills_before: int | None = None
) -> WorkerKilledError | None:
    """A `WorkerKilledError` for a DataLoader worker killed by SIGKILL (torch's "DataLoader worker (pid X) is killed
    by signal: Killed" or "... exited unexpectedly"), naming the cause the cgroup shows: its memory limit, with the
    figures, when its OOM-kill count grew during the run. Says which checkpoint stands. None for any other error.
    """
    from lightning_accel.errors import WorkerKilledError
    from lightning_accel.system.cgroup import read_memory_limit, read_oom_kills

    seen: BaseException | None = err
    match = None
    while seen is not None and match is None:
        match = _WORKER_KILLED.search(str(seen))
        seen = seen.__cause__ or seen.__context__
    if match is None:
        return None
    pids = match.group(1).strip()
    limit = read_memory_limit(CGROUP_ROOT)
    found = read_oom_kills(CGROUP_ROOT)
    kills, events = (None, "") if found is None else (found[0] - (oom_kills_before or 0), found[1])
    fix = (
        "use fewer `data.num_workers`, a smaller `data.batch_size` or `data.prefetch_factor`, or raise the memory "
        "limit (`docker run --memory`)"
    )
    if limit.limit_bytes is not None and kills is not None and kills > 0:
        cause = (
            f"killed by the cgroup's memory limit: {_gib(limit.limit_bytes)} ({limit.source}), {kills} OOM kill(s) "
            f"during the run in {events}"
        )
    elif limit.limit_bytes is not None and found is None:
        cause = (
            f"killed (SIGKILL); the cgroup's memory limit is {_gib(limit.limit_bytes)} ({limit.source}) and its OOM "
            "kills cannot be read: most likely that limit"
        )
    else:
        why = "no cgroup memory limit" if limit.limit_bytes is None else f"no OOM kill counted in {events}"
        cause = f"killed (SIGKILL), not by the cgroup's memory limit ({why}): by the kernel's OOM killer or a process"
        fix = "check `dmesg` for the OOM killer, and what else sends signals on this machine; " + fix
    last = str(getattr(getattr(trainer, "checkpoint_callback", None), "last_model_path", "") or "")
    kept = (
        f"the last checkpoint stands: {last} (resume with `ckpt_path=last`)"
        if last and Path(last).is_file()
        else "no checkpoint had been saved yet"
    )
    step = getattr(trainer, "global_step", "?")
    return WorkerKilledError(f"DataLoader worker (pid {pids}) was {cause}, at global step {step}; {kept}. Fix: {fix}.")
