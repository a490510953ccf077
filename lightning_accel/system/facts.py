"""Every fact the checks judge, gathered in one frozen record that reads back as plain JSON."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from lightning_accel.system.cgroup import CpuBudget, MemoryLimit, read_cpu_budget, read_memory_limit
from lightning_accel.system.cpu import CpuInfo, read_cpu_info
from lightning_accel.system.cpuset import CpuTopology, read_cpu_topology
from lightning_accel.system.gpu import NvmlFacts, read_nvml
from lightning_accel.system.host import IbPort, ShmInfo, hostname, read_infiniband, read_nccl_env, read_shm
from lightning_accel.system.software import PackageVersion, TorchBuild, read_packages, read_torch_build
from lightning_accel.system.threads import THREAD_COUNT_ENV, WAIT_POLICY_ENV

__all__ = ["SystemFacts", "collect_facts", "facts_to_dict"]

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class SystemFacts:
    """The machine as one process sees it. Every field has a default, so tests build the case they need by hand."""

    host: str = ""
    """This node's host name."""
    cpu: CpuInfo = field(default_factory=lambda: CpuInfo(path="/proc/cpuinfo", found=False))
    cpus: CpuBudget = field(default_factory=lambda: CpuBudget(affinity=1))
    memory: MemoryLimit = field(default_factory=MemoryLimit)
    shm: ShmInfo | None = None
    """`/dev/shm`; None where there is none."""
    infiniband: tuple[IbPort, ...] = ()
    nccl_env: Mapping[str, str] = field(default_factory=dict)
    """The `NCCL_*` variables set in this process."""
    torch: TorchBuild = field(default_factory=TorchBuild)
    nvml: NvmlFacts = field(default_factory=lambda: NvmlFacts(available=False, why="not read"))
    packages: tuple[PackageVersion, ...] = ()
    """Our requirements and their installed versions; empty when lightning_accel has no metadata."""
    topology: CpuTopology | None = None
    """The CPUs this process may use (affinity within the cpuset) and their NUMA nodes; None: not read."""
    thread_env: Mapping[str, str] = field(default_factory=dict)
    """`OMP_NUM_THREADS`, `MKL_NUM_THREADS`, ... and `OMP_WAIT_POLICY` as set in this process."""
    others_cpus: float | None = None
    """Other processes' CPU use on this process's CPUs over `others_window_s`, in CPUs; None: not measured."""
    others_window_s: float = 0.0
    unreadable: tuple[str, ...] = ()
    """Facts that could not be read, each naming its files and the error (garbage in `/proc` or `/sys`): their values
    are unknown, and every other fact is read all the same."""


def collect_facts(
    root: str | os.PathLike[str] = "/",
    env: Mapping[str, str] | None = None,
    *,
    affinity: Collection[int] | int | None = None,
    statvfs: Callable[[str], Any] | None = None,
    nvml: bool = True,
    interference_s: float = 0.0,
) -> SystemFacts:
    """Read every fact of this machine; missing files and libraries give unknown values, never an error.

    Args:
        root: the file-system root `/proc`, `/sys` and `/dev/shm` are read under (tests pass fake trees).
        env: the environment (`PYTHON_CPU_COUNT`, `CUDA_VISIBLE_DEVICES`, `NCCL_*`); None: `os.environ`.
        affinity: the CPU affinity set or its size; None: `os.sched_getaffinity(0)`.
        statvfs: stand-in for `os.statvfs` on `/dev/shm`.
        nvml: read GPUs through NVML; False leaves `nvml` unavailable.
        interference_s: watch the other processes' CPU use on our CPUs for this long (`InterferenceProbe`); 0 skips.

    Example::

        facts = collect_facts()
        facts.cpus.effective, facts.shm.size_bytes
    """
    env = os.environ if env is None else env
    others = None
    if interference_s > 0:
        import time

        from lightning_accel.system.interference import InterferenceProbe

        with InterferenceProbe() as probe:
            time.sleep(interference_s)
        others = probe.result.other_cpus if probe.result is not None else None
    problems: list[str] = []

    def guarded(what: str, read: Callable[[], T], default: T) -> T:
        try:
            return read()
        except Exception as err:  # garbage the readers did not foresee: named, and the other facts are still read
            problems.append(f"{what} under {root}: {type(err).__name__}: {err}")
            return default

    topology_affinity = range(affinity) if isinstance(affinity, int) else affinity
    return SystemFacts(
        host=hostname(),
        cpu=guarded("the CPU model and flags (proc/cpuinfo)", lambda: read_cpu_info(root), SystemFacts().cpu),
        cpus=guarded(
            "the CPU budget (the cgroup's cpu files, proc/self/cgroup, proc/self/mountinfo)",
            lambda: read_cpu_budget(root, env, affinity),
            SystemFacts().cpus,
        ),
        memory=guarded(
            "the memory limit (proc/meminfo, the cgroup's memory files)", lambda: read_memory_limit(root), MemoryLimit()
        ),
        shm=guarded("/dev/shm (dev/shm)", lambda: read_shm(root, statvfs), None),
        infiniband=guarded("the InfiniBand ports (sys/class/infiniband)", lambda: read_infiniband(root), ()),
        nccl_env=read_nccl_env(env),
        torch=read_torch_build(),
        nvml=read_nvml(env) if nvml else NvmlFacts(available=False, why="NVML not read (`nvml=False`)"),
        packages=read_packages(),
        topology=guarded(
            "the CPU topology (the cgroup's cpuset, sys/devices/system/node)",
            lambda: read_cpu_topology(root, topology_affinity),
            None,
        ),
        thread_env={key: env[key] for key in (*THREAD_COUNT_ENV, WAIT_POLICY_ENV) if env.get(key, "").strip()},
        others_cpus=others,
        others_window_s=interference_s if others is not None else 0.0,
        unreadable=tuple(problems),
    )


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.name != "flags"}
        if isinstance(value, CpuBudget):
            out["effective"] = value.effective
        if isinstance(value, CpuInfo):
            out["bf16_flag"] = value.bf16_flag
        return out
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list | frozenset | set):
        return [_plain(v) for v in value]
    return value


def facts_to_dict(facts: SystemFacts) -> dict[str, Any]:
    """`facts` as JSON-ready dicts and lists (CPU flags left out; `cpus.effective` and `cpu.bf16_flag` added)."""
    return _plain(facts)
