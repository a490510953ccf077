"""Which CPUs this process may run on: its affinity, its cgroup's cpuset (v1 or v2, nested) and the NUMA nodes."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from lightning_accel.system.cgroup import cgroup_dirs

__all__ = ["MAX_CPUS", "CpuTopology", "format_cpu_list", "parse_cpu_list", "read_cpu_topology"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CpuTopology:
    """The CPUs this process may use, and how they group into NUMA nodes."""

    cpus: tuple[int, ...]
    """The CPU numbers: the affinity mask within the cgroup's cpuset, sorted."""
    cpuset: tuple[int, ...] | None = None
    """The cgroup's cpuset (the tightest level from this process's cgroup up); None when none was found."""
    cpuset_source: str = ""
    """The file that set `cpuset`."""
    numa_nodes: tuple[tuple[int, ...], ...] = ()
    """Each NUMA node's CPUs among `cpus` (nodes without one left out); empty when /sys shows no nodes."""


MAX_CPUS = 1 << 16
"""CPU numbers at or above this are no CPU of a real machine (Linux builds for at most 8192): a list naming one is
garbage (a forged `ACCEL_CPU_SETS`, a corrupt cpuset file), and its part is skipped instead of spelled out."""


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """`0-3,8,10-11` (the kernel's list format) -> (0, 1, 2, 3, 8, 10, 11); "" -> (); a malformed part (not numbers,
    a range that runs backwards, a CPU number of `MAX_CPUS` or more) is skipped."""
    found: set[int] = set()
    for part in text.replace("\n", ",").split(","):
        part = part.strip()
        if not part:
            continue
        low, sep, high = part.partition("-")
        try:
            start, end = int(low), int(high) if sep else int(low)
        except ValueError:
            continue
        if 0 <= start <= end < MAX_CPUS:
            found.update(range(start, end + 1))
    return tuple(sorted(found))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 3, 8) -> `0-3,8`: the kernel's list format, as `taskset -c` takes it."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    start = previous = None
    for cpu in [*ordered, None]:
        if cpu is not None and previous is not None and cpu == previous + 1:
            previous = cpu
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = cpu
    return ",".join(parts)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def _cpuset(root: str | os.PathLike[str]) -> tuple[tuple[int, ...] | None, str]:
    """The intersection of every level's cpuset from this process's cgroup up to the mount (an empty file means the
    parent's), and the innermost file that narrowed it."""
    found = cgroup_dirs("cpuset", root)
    if found is None:
        return None, ""
    version, dirs = found
    names = ("cpuset.cpus.effective", "cpuset.cpus") if version == 2 else ("cpuset.effective_cpus", "cpuset.cpus")
    allowed: set[int] | None = None
    source = ""
    for directory in dirs:  # innermost first
        for name in names:
            cpus = parse_cpu_list(_read(directory / name) or "")
            if not cpus:
                continue
            if allowed is None or not allowed <= set(cpus):
                source = source or str(directory / name)
            allowed = set(cpus) if allowed is None else allowed & set(cpus)
    return (None if allowed is None else tuple(sorted(allowed))), source


def _affinity(affinity: Collection[int] | None) -> set[int] | None:
    if affinity is not None:
        return set(affinity)
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        return None


def read_cpu_topology(root: str | os.PathLike[str] = "/", affinity: Collection[int] | None = None) -> CpuTopology:
    """The CPUs this process may use: its affinity within its cgroup's cpuset, and their NUMA nodes.

    A real process's affinity already lies within its cpuset; reading the cpuset as well names the limit (and lets
    tests hand in fake trees). Missing files give what can be known, never an error.

    Args:
        root: the file-system root to read `/proc`, the cgroup tree and `/sys/devices/system/node` under.
        affinity: the affinity set; None: `os.sched_getaffinity(0)`.

    Example::

        read_cpu_topology().cpus  # (2, 3) in a `docker run --cpuset-cpus=2,3` container
    """
    cpuset, source = _cpuset(root)
    mask = _affinity(affinity)
    if mask is None:
        mask = set(cpuset) if cpuset is not None else set(range(os.cpu_count() or 1))
    cpus = mask & set(cpuset) if cpuset is not None else mask
    cpus = cpus or mask  # a cpuset that excludes the whole mask is a misreading: keep the mask
    nodes: list[tuple[int, ...]] = []
    node_root = Path(root, "sys", "devices", "system", "node")
    try:
        entries = sorted(
            (p for p in node_root.iterdir() if p.name.startswith("node") and p.name[4:].isdigit()),
            key=lambda p: int(p.name[4:]),
        )
    except OSError:
        entries = []
    for entry in entries:
        mine = tuple(c for c in parse_cpu_list(_read(entry / "cpulist") or "") if c in cpus)
        if mine:
            nodes.append(mine)
    return CpuTopology(cpus=tuple(sorted(cpus)), cpuset=cpuset, cpuset_source=source, numa_nodes=tuple(nodes))
