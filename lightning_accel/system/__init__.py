"""Facts about the machine, read from files under a root path so tests can hand in fake trees; no Lightning imports.

`collect_facts()` reads them all into one `SystemFacts`; `run_checks(facts)` turns them into PASS / WARN / FAIL / SKIP
verdicts with a fix each (what `accel-doctor` prints and the `Preflight` callback enforces).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_accel.system.cgroup import CpuBudget, MemoryLimit, read_cpu_budget, read_memory_limit
    from lightning_accel.system.cpu import BF16_FLAGS, CpuInfo, native_bf16_flag, read_cpu_info
    from lightning_accel.system.cpuset import CpuTopology, format_cpu_list, parse_cpu_list, read_cpu_topology
    from lightning_accel.system.doctor_checks import (
        CHECKS,
        Check,
        CheckRequest,
        Status,
        run_checks,
        suggested_num_workers,
    )
    from lightning_accel.system.facts import SystemFacts, collect_facts, facts_to_dict
    from lightning_accel.system.gpu import GpuInfo, GpuLink, NvmlFacts, VisibleDevice, read_nvml
    from lightning_accel.system.host import IbPort, ShmInfo, read_infiniband, read_nccl_env, read_shm
    from lightning_accel.system.software import (
        PackageVersion,
        TorchBuild,
        compile_problem,
        read_packages,
        read_torch_build,
    )
    from lightning_accel.system.threads import ThreadPlan, cpu_share, plan_threads, read_thread_plan

__all__ = [
    "BF16_FLAGS",
    "CHECKS",
    "Check",
    "CheckRequest",
    "CpuBudget",
    "CpuInfo",
    "CpuTopology",
    "GpuInfo",
    "GpuLink",
    "IbPort",
    "MemoryLimit",
    "NvmlFacts",
    "PackageVersion",
    "ShmInfo",
    "Status",
    "SystemFacts",
    "ThreadPlan",
    "TorchBuild",
    "VisibleDevice",
    "collect_facts",
    "compile_problem",
    "cpu_share",
    "facts_to_dict",
    "format_cpu_list",
    "native_bf16_flag",
    "parse_cpu_list",
    "plan_threads",
    "read_cpu_budget",
    "read_cpu_info",
    "read_cpu_topology",
    "read_infiniband",
    "read_memory_limit",
    "read_nccl_env",
    "read_nvml",
    "read_packages",
    "read_shm",
    "read_thread_plan",
    "read_torch_build",
    "run_checks",
    "suggested_num_workers",
]

_HOMES = {
    **dict.fromkeys(
        (
            "CpuBudget",
            "MemoryLimit",
            "read_cpu_budget",
            "read_memory_limit",
        ),
        "lightning_accel.system.cgroup",
    ),
    **dict.fromkeys(
        (
            "BF16_FLAGS",
            "CpuInfo",
            "native_bf16_flag",
            "read_cpu_info",
        ),
        "lightning_accel.system.cpu",
    ),
    **dict.fromkeys(
        (
            "CpuTopology",
            "format_cpu_list",
            "parse_cpu_list",
            "read_cpu_topology",
        ),
        "lightning_accel.system.cpuset",
    ),
    **dict.fromkeys(
        (
            "CHECKS",
            "Check",
            "CheckRequest",
            "Status",
            "run_checks",
            "suggested_num_workers",
        ),
        "lightning_accel.system.doctor_checks",
    ),
    **dict.fromkeys(
        (
            "SystemFacts",
            "collect_facts",
            "facts_to_dict",
        ),
        "lightning_accel.system.facts",
    ),
    **dict.fromkeys(
        (
            "GpuInfo",
            "GpuLink",
            "NvmlFacts",
            "VisibleDevice",
            "read_nvml",
        ),
        "lightning_accel.system.gpu",
    ),
    **dict.fromkeys(
        (
            "IbPort",
            "ShmInfo",
            "read_infiniband",
            "read_nccl_env",
            "read_shm",
        ),
        "lightning_accel.system.host",
    ),
    **dict.fromkeys(
        (
            "PackageVersion",
            "TorchBuild",
            "compile_problem",
            "read_packages",
            "read_torch_build",
        ),
        "lightning_accel.system.software",
    ),
    **dict.fromkeys(
        (
            "ThreadPlan",
            "cpu_share",
            "plan_threads",
            "read_thread_plan",
        ),
        "lightning_accel.system.threads",
    ),
}
"""Each public name and the module it lives in: imported from there when first used, so importing one module of
the package (`lightning_accel.system.cpuset` before torch loads) does not load the others."""


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
