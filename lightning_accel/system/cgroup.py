"""The CPU and memory a process may really use: its affinity, its own cgroup's quota (v1 or v2, nested) and limit."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuBudget", "MemoryLimit", "cgroup_dirs", "read_cpu_budget", "read_memory_limit", "read_oom_kills"]

_UNLIMITED_BYTES = 2**62  # v1 writes "no limit" as a page-rounded 2**63 - 1; anything this large is no limit
_ESCAPE = re.compile(r"\\([0-7]{3})")  # mountinfo writes a space in a path as \040


@dataclass(frozen=True, kw_only=True, slots=True)
class CpuBudget:
    """How many CPUs this process can keep busy, and which limit decides it."""

    affinity: int
    """CPUs in the process's affinity mask (`os.sched_getaffinity`; a cpuset cgroup shows up here)."""
    quota: float | None = None
    """The tightest CFS quota from the process's cgroup up to the root, in CPUs (1.5: 150 ms per 100 ms); None: none."""
    quota_source: str = ""
    """The file that set `quota`."""
    cgroup_version: int | None = None
    """1 or 2: the hierarchy the quota was read from; None when no cgroup cpu controller was found."""
    env_count: int | None = None
    """`PYTHON_CPU_COUNT`, when set to a number."""

    @property
    def effective(self) -> int:
        """min(affinity, ceil(quota), PYTHON_CPU_COUNT), at least 1."""
        limits = [self.affinity]
        if self.quota is not None:
            limits.append(math.ceil(self.quota))
        if self.env_count is not None:
            limits.append(self.env_count)
        return max(1, min(limits))


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryLimit:
    """The memory cgroup limit of this process and the host's memory."""

    limit_bytes: int | None = None
    """The tightest limit from the process's cgroup up to the root; None: no limit."""
    source: str = ""
    """The file that set `limit_bytes`."""
    host_total_bytes: int | None = None
    """`MemTotal` of `/proc/meminfo`."""


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def _own_cgroups(root: Path) -> dict[str, str]:
    """Controller -> cgroup path from `/proc/self/cgroup`; the v2 unified hierarchy is keyed by the empty string."""
    found: dict[str, str] = {}
    for line in (_read(root / "proc" / "self" / "cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            found[""] = path
        for controller in controllers.split(","):
            if controller:
                found[controller] = path
    return found


def _mounts(root: Path) -> dict[str, tuple[str, str]]:
    """Controller (or "" for cgroup2) -> (root of the hierarchy inside the mount, mount point) from mountinfo."""
    found: dict[str, tuple[str, str]] = {}
    for line in (_read(root / "proc" / "self" / "mountinfo") or "").splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        tail = line.split(" - ", 1)[1].split()
        if len(tail) < 3:
            continue
        fstype, options = tail[0], tail[2].split(",")
        mount_root, point = (_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), f) for f in fields[3:5])
        if fstype == "cgroup2":
            found.setdefault("", (mount_root, point))
        elif fstype == "cgroup":
            for option in options:
                found.setdefault(option, (mount_root, point))
    return found


def cgroup_dirs(controller: str, root: str | os.PathLike[str] = "/") -> tuple[int, list[Path]] | None:
    """The cgroup version and the directories of this process's cgroup for `controller`, innermost first.

    v1 is used when the controller has a v1 hierarchy, else v2. The process's path (`/proc/self/cgroup`) is taken
    relative to the root of the hierarchy at its mount (`/proc/self/mountinfo`), so both a container's namespaced
    view (path `/` at the mount) and a host path under a bind-mounted subtree resolve. The list walks up to the
    mount point, where nested limits end. Without mountinfo, `/sys/fs/cgroup[/<controller>]` is assumed.

    Args:
        controller: `cpu` or `memory`.
        root: the file-system root to read under.

    Returns:
        `(version, directories)`, or None when the process has no cgroup for `controller`.
    """
    base = Path(root)
    own, mounts = _own_cgroups(base), _mounts(base)
    if controller in own:
        version, path = 1, own[controller]
        mount_root, point = mounts.get(controller, ("/", f"/sys/fs/cgroup/{controller}"))
    elif "" in own:
        version, path = 2, own[""]
        mount_root, point = mounts.get("", ("/", "/sys/fs/cgroup"))
    else:
        return None
    top = base / point.lstrip("/")
    relative = path
    if mount_root != "/" and (path == mount_root or path.startswith(mount_root.rstrip("/") + "/")):
        relative = path[len(mount_root) :]
    elif mount_root != "/":
        relative = "/"  # the mount shows a subtree that does not hold our path: only its top is readable
    parts = [p for p in relative.split("/") if p and p not in (".", "..")]
    dirs = [top.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    return version, dirs


def _cpu_quota(version: int, directory: Path) -> float | None:
    if version == 2:
        text = _read(directory / "cpu.max")
        if not text:
            return None
        quota, _, period = text.partition(" ")
        if quota == "max":
            return None
        return _ratio(quota, period or "100000")
    return _ratio(_read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us"))


def _ratio(quota: str | None, period: str | None) -> float | None:
    try:
        q, p = int(quota or ""), int(period or "")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None  # v1 writes -1 for no quota


def _affinity_count(affinity: Collection[int] | int | None) -> int:
    if isinstance(affinity, int):
        return affinity
    if affinity is not None:
        return len(affinity)
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def read_cpu_budget(
    root: str | os.PathLike[str] = "/",
    env: Mapping[str, str] | None = None,
    affinity: Collection[int] | int | None = None,
) -> CpuBudget:
    """The CPUs this process can use: affinity, its cgroup's CPU quota (nested included) and `PYTHON_CPU_COUNT`.

    `os.cpu_count()` (and so DataLoader and thread-count heuristics) sees every CPU of the host; a container limited
    with `--cpus=2` still reports them all, and oversubscribed workers are throttled by the CFS quota.

    Args:
        root: the file-system root to read `/proc` and the cgroup tree under.
        env: the environment to read `PYTHON_CPU_COUNT` from; None: `os.environ`.
        affinity: the affinity set (or its size); None: `os.sched_getaffinity(0)`.

    Example::

        read_cpu_budget().effective  # 2 in a `docker run --cpus=1.5` container on a 64-core host
    """
    env = os.environ if env is None else env
    raw = env.get("PYTHON_CPU_COUNT", "").strip()
    env_count = int(raw) if raw.isdigit() and int(raw) > 0 else None
    found = cgroup_dirs("cpu", root)
    quota, source, version = None, "", None
    if found is not None:
        version, dirs = found
        for directory in dirs:
            value = _cpu_quota(version, directory)
            if value is not None and (quota is None or value < quota):
                quota = value
                source = str(directory / ("cpu.max" if version == 2 else "cpu.cfs_quota_us"))
    return CpuBudget(
        affinity=_affinity_count(affinity),
        quota=quota,
        quota_source=source,
        cgroup_version=version,
        env_count=env_count,
    )


def _bytes(text: str | None) -> int | None:
    if not text or text == "max" or not text.isdigit():
        return None
    value = int(text)
    return None if value >= _UNLIMITED_BYTES else value


def read_memory_limit(root: str | os.PathLike[str] = "/") -> MemoryLimit:
    """The memory limit of this process's cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`, nested included).

    Args:
        root: the file-system root to read `/proc` and the cgroup tree under.
    """
    host = None
    for line in (_read(Path(root, "proc", "meminfo")) or "").splitlines():
        fields = line.split()
        if fields[:1] == ["MemTotal:"]:
            host = int(fields[1]) * 1024 if len(fields) > 1 and fields[1].isdigit() else None  # garbage: unknown
            break
    found = cgroup_dirs("memory", root)
    limit, source = None, ""
    if found is not None:
        version, dirs = found
        name = "memory.max" if version == 2 else "memory.limit_in_bytes"
        for directory in dirs:
            value = _bytes(_read(directory / name))
            if value is not None and (limit is None or value < limit):
                limit, source = value, str(directory / name)
    return MemoryLimit(limit_bytes=limit, source=source, host_total_bytes=host)


def read_oom_kills(root: str | os.PathLike[str] = "/") -> tuple[int, str] | None:
    """How many processes the memory cgroup's limit has killed (`oom_kill` of v2 `memory.events` or v1
    `memory.oom_control`), summed from this process's cgroup up to the mount, and the innermost file that counted;
    None when no such file can be read.

    Args:
        root: the file-system root to read `/proc` and the cgroup tree under.
    """
    found = cgroup_dirs("memory", root)
    if found is None:
        return None
    version, dirs = found
    name = "memory.events" if version == 2 else "memory.oom_control"
    total, source = None, ""
    for directory in dirs:
        for line in (_read(directory / name) or "").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                total = (total or 0) + int(value)
                source = source or str(directory / name)
                break
        if version == 2 and total is not None:
            break  # v2's memory.events counts the subtree already: the innermost level holds every kill below it
    return None if total is None else (total, source)
