"""Verdicts on a machine's facts: pure functions from `SystemFacts` to PASS / WARN / FAIL / SKIP with a one-line fix."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_accel.errors import ConfigError
from lightning_accel.system.facts import SystemFacts

__all__ = [
    "CHECKS",
    "MEMORY_PER_PROCESS",
    "SHM_PER_WORKER",
    "STATUSES",
    "Check",
    "CheckRequest",
    "Status",
    "check_bf16",
    "check_cpus",
    "check_driver_cuda",
    "check_gpus",
    "check_infiniband",
    "check_memory",
    "check_nccl",
    "check_packages",
    "check_shm",
    "check_threads",
    "run_checks",
    "suggested_num_workers",
]

Status = Literal["PASS", "WARN", "FAIL", "SKIP"]
STATUSES: tuple[Status, ...] = ("PASS", "WARN", "FAIL", "SKIP")
SHM_PER_WORKER = 128 * 2**20
"""/dev/shm each DataLoader worker is counted to need: `prefetch_factor=2` batches of up to 64 MiB in flight."""
MEMORY_PER_PROCESS = 2 * 2**30
"""Host memory each training process and each DataLoader worker is counted to need (a rule of thumb)."""
_GIB, _MIB = 2**30, 2**20
_BF16_CAPABILITY = (8, 0)


@dataclass(frozen=True, slots=True)
class Check:
    """One verdict."""

    name: str
    status: Status
    detail: str
    """The numbers the verdict rests on."""
    fix: str = ""
    """One line saying what to do; empty for PASS and SKIP."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckRequest:
    """What the run will ask of this node; None fields are judged against what the machine offers."""

    gpus: int | None = None
    """GPUs the run uses on this node; None: every visible GPU; 0: a CPU run (GPU checks SKIP)."""
    processes: int | None = None
    """Training processes on this node; None: one per GPU, or 1."""
    num_workers: int | None = None
    """DataLoader workers per process; None: unknown (judged as `suggested_num_workers`, and never FAIL)."""
    num_nodes: int = 1
    intra_op_threads: int | None = None
    """torch's intra-op threads per process; None: `OMP_NUM_THREADS`, else every CPU of the affinity (torch's own)."""


def suggested_num_workers(effective_cpus: int, processes: int) -> int:
    """Lightning's rule (`suggested_max_num_workers`) over the CPUs the cgroup really grants: CPUs per process - 1."""
    return max(1, effective_cpus // max(1, processes) - 1)


def _gpus(facts: SystemFacts, request: CheckRequest) -> int:
    return len(facts.nvml.visible) if request.gpus is None else request.gpus


def _processes(facts: SystemFacts, request: CheckRequest) -> int:
    return request.processes if request.processes is not None else max(1, _gpus(facts, request))


def _size(value: float) -> str:
    return f"{value / _GIB:.1f} GiB" if value >= _GIB else f"{value / _MIB:.1f} MiB"


def check_packages(facts: SystemFacts, request: CheckRequest) -> Check:
    """Installed versions of torch, lightning, hydra-core, ... against lightning_accel's requirements."""
    if not facts.packages:
        return Check("packages", "SKIP", "lightning_accel has no package metadata (not installed with pip)")
    from packaging.specifiers import SpecifierSet

    def satisfied(required: str, installed: str | None) -> bool:
        try:
            return installed is not None and SpecifierSet(required).contains(installed, prereleases=True)
        except ValueError:  # packaging's InvalidSpecifier / InvalidVersion: a version it cannot compare
            return False

    shown = ", ".join(f"{p.name} {p.installed or 'missing'}" for p in facts.packages)
    bad = [p for p in facts.packages if not satisfied(p.required, p.installed)]
    if bad:
        wanted = " ".join(f"'{p.name}{p.required}'" for p in bad)
        found = ", ".join(f"{p.name} {p.installed or 'missing'} (needs {p.required or 'any'})" for p in bad)
        return Check("packages", "FAIL", found, f"pip install -U {wanted}")
    return Check("packages", "PASS", shown)


def check_driver_cuda(facts: SystemFacts, request: CheckRequest) -> Check:
    """The driver's CUDA version against the CUDA runtime torch was built with."""
    nvml, torch = facts.nvml, facts.torch
    if request.gpus == 0:
        return Check("driver_cuda", "SKIP", "the run uses no GPU")
    if torch.cuda is None:
        if nvml.available and nvml.gpus:
            return Check(
                "driver_cuda",
                "WARN",
                f"torch {torch.version} is a {'ROCm' if torch.hip else 'CPU-only'} build; "
                f"{len(nvml.gpus)} NVIDIA GPU(s) will not be used",
                "install a CUDA build: pip install torch --index-url https://download.pytorch.org/whl/cu126",
            )
        build = "ROCm" if torch.hip else "CPU-only"
        return Check("driver_cuda", "SKIP", f"torch {torch.version} is a {build} build; no CUDA runtime to check")
    if not nvml.available:
        return Check("driver_cuda", "SKIP", f"no NVIDIA driver to check: {nvml.why}")
    if nvml.cuda_driver_version is None:
        return Check("driver_cuda", "SKIP", f"driver {nvml.driver_version} does not report its CUDA version")
    driver = nvml.cuda_driver_version
    runtime = tuple(int(part) for part in torch.cuda.split(".")[:2])
    shown = f"driver {nvml.driver_version} supports CUDA {driver[0]}.{driver[1]}; torch runtime is CUDA {torch.cuda}"
    if runtime[0] > driver[0]:
        return Check(
            "driver_cuda",
            "FAIL",
            f'{shown} ("CUDA driver version is insufficient")',
            f"upgrade the NVIDIA driver to one for CUDA >= {torch.cuda}, or install a torch built for "
            f"CUDA <= {driver[0]}.{driver[1]}",
        )
    if runtime[0] == driver[0] and runtime[1:] > driver[1:]:
        return Check(
            "driver_cuda",
            "WARN",
            f"{shown}: runs on minor-version compatibility (PTX JIT may fail)",
            f"upgrade the driver to one for CUDA >= {torch.cuda}, or install a torch built for "
            f"CUDA {driver[0]}.{driver[1]}",
        )
    return Check("driver_cuda", "PASS", shown)


def check_gpus(facts: SystemFacts, request: CheckRequest) -> Check:
    """GPUs visible to this process against the GPUs requested."""
    nvml, wanted = facts.nvml, request.gpus
    if wanted == 0:
        return Check("gpus", "SKIP", "the run uses no GPU")
    if not nvml.available:
        if wanted is None:
            return Check("gpus", "SKIP", f"no NVIDIA GPU: {nvml.why}")
        return Check(
            "gpus",
            "FAIL",
            f"{wanted} GPU(s) requested, none usable: {nvml.why}",
            "install the NVIDIA driver (or expose the GPUs to the container with `--gpus all`)",
        )
    visible = len(nvml.visible)
    names = ", ".join(sorted({g.name for g in nvml.gpus if g.accessible}))
    shown = f"{visible} of {len(nvml.gpus)} GPU(s) visible ({names})"
    shown += "".join(
        f"; NVML GPU {g.index} not accessible to this process ({g.why})" for g in nvml.gpus if not g.accessible
    )
    if wanted is None:
        return Check("gpus", "PASS" if visible else "SKIP", shown)
    if facts.torch.cuda is None:
        return Check(
            "gpus",
            "FAIL",
            f"{wanted} GPU(s) requested but torch {facts.torch.version} has no CUDA",
            "install a CUDA build of torch (https://pytorch.org/get-started/locally/)",
        )
    if wanted > visible:
        return Check(
            "gpus",
            "FAIL",
            f"{wanted} GPU(s) requested per node, {shown}",
            f"request `devices={visible}` or fix CUDA_VISIBLE_DEVICES",
        )
    return Check("gpus", "PASS", f"{wanted} requested, {shown}")


def check_bf16(facts: SystemFacts, request: CheckRequest) -> Check:
    """bf16 on the GPUs the run uses (compute capability 8.0+), or native bf16 instructions on a CPU run."""
    gpus = facts.nvml.visible_gpus()[: _gpus(facts, request)] if facts.nvml.available else []
    if not gpus:
        if facts.cpu.has_native_bf16:
            return Check("bf16", "PASS", f"no GPU in use; {facts.cpu.describe_bf16()}")
        return Check("bf16", "SKIP", f"no GPU in use; {facts.cpu.describe_bf16()} (`precision=amp` picks 32-true)")
    lacking = [g for g in gpus if g.capability is not None and g.capability < _BF16_CAPABILITY]
    if lacking:
        names = ", ".join(f"GPU {g.index} {g.name} ({'.'.join(map(str, g.capability or ()))})" for g in lacking)
        return Check(
            "bf16",
            "WARN",
            f"{names}: no bf16 tensor cores (needs compute capability 8.0+)",
            "use `precision=amp` (picks 16-mixed there) instead of bf16-mixed/bf16-true",
        )
    caps = sorted({".".join(map(str, g.capability)) for g in gpus if g.capability is not None})
    return Check("bf16", "PASS", f"{len(gpus)} GPU(s) with compute capability {', '.join(caps) or 'unknown'}")


def check_nccl(facts: SystemFacts, request: CheckRequest) -> Check:
    """NCCL for multi-GPU runs: built into torch, not across MIG devices, not told to skip NVLink."""
    total = _gpus(facts, request) * max(1, request.num_nodes)
    if total < 2 or not facts.nvml.available:
        return Check("nccl", "SKIP", f"{total} GPU(s) in the run: NCCL is not used")
    env = ", ".join(f"{k}={v}" for k, v in facts.nccl_env.items()) or "no NCCL_* variables"
    if facts.torch.nccl is None:
        return Check(
            "nccl",
            "FAIL",
            f"{total} GPUs but torch {facts.torch.version} was built without NCCL",
            "install a CUDA build of torch, or use `process_group_backend='gloo'`",
        )
    used = facts.nvml.visible[: _gpus(facts, request)]
    if sum(device.mig for device in used) and len(used) > 1:
        return Check(
            "nccl",
            "FAIL",
            f"{len(used)} MIG devices requested: NCCL cannot communicate between MIG devices",
            "disable MIG for multi-GPU training (`nvidia-smi -i N -mig 0`) or use one MIG device",
        )
    version = ".".join(map(str, facts.torch.nccl))
    nvlinked = [f"{link.a}-{link.b}" for link in facts.nvml.topology if link.kind == "NV"]
    links = f"NVLink between GPUs {', '.join(nvlinked)}" if nvlinked else "no NVLink (PCIe)"
    if nvlinked and facts.nccl_env.get("NCCL_P2P_DISABLE", "0") not in ("0", ""):
        return Check(
            "nccl",
            "WARN",
            f"NCCL {version}; {links}; NCCL_P2P_DISABLE={facts.nccl_env['NCCL_P2P_DISABLE']}"
            " sends GPU-to-GPU traffic through host memory",
            "unset NCCL_P2P_DISABLE",
        )
    return Check("nccl", "PASS", f"NCCL {version}; {links}; {env}")


def check_infiniband(facts: SystemFacts, request: CheckRequest) -> Check:
    """InfiniBand/RoCE ports present but down or disabled for NCCL, or absent while NCCL is told to use them."""
    env, ports = facts.nccl_env, facts.infiniband
    hca, net = env.get("NCCL_IB_HCA", ""), env.get("NCCL_NET", "")
    if _gpus(facts, request) == 0:
        return Check("infiniband", "SKIP", f"no GPU in the run, so no NCCL; {len(ports)} InfiniBand/RoCE port(s)")
    if not ports:
        if net.upper() == "IB":
            return Check(
                "infiniband",
                "FAIL",
                "NCCL_NET=IB but there is no device under /sys/class/infiniband",
                "unset NCCL_NET (NCCL falls back to sockets) or expose /dev/infiniband and load the RDMA driver",
            )
        if hca:
            return Check(
                "infiniband",
                "WARN",
                f"NCCL_IB_HCA={hca} but no InfiniBand/RoCE device: NCCL falls back to TCP sockets",
                "unset NCCL_IB_HCA, or expose /dev/infiniband to the container",
            )
        if request.num_nodes > 1:
            return Check(
                "infiniband",
                "WARN",
                f"{request.num_nodes} nodes and no InfiniBand/RoCE device: NCCL crosses nodes over TCP sockets",
                "use nodes with InfiniBand/RoCE (or EFA) for multi-node training",
            )
        return Check("infiniband", "SKIP", "no InfiniBand/RoCE device (NCCL uses it only between nodes)")
    shown = ", ".join(f"{p.device}:{p.port} {p.state} {p.link_layer or '?'} {p.rate}".rstrip() for p in ports)
    active = [p for p in ports if p.active]
    if not active:
        return Check(
            "infiniband",
            "WARN",
            f"no ACTIVE port: {shown}",
            "bring a port up: check the cable and the subnet manager (`ibstat`)",
        )
    if env.get("NCCL_IB_DISABLE", "0") not in ("0", ""):
        return Check(
            "infiniband",
            "WARN",
            f"NCCL_IB_DISABLE={env['NCCL_IB_DISABLE']} while {shown}",
            "unset NCCL_IB_DISABLE so NCCL uses InfiniBand/RoCE between nodes",
        )
    named = {name.split(":")[0].lstrip("^=") for name in hca.split(",") if name}
    if named and not hca.startswith("^") and not named & {p.device for p in active}:
        return Check(
            "infiniband",
            "WARN",
            f"NCCL_IB_HCA={hca} names no ACTIVE device; {shown}",
            f"set NCCL_IB_HCA={','.join(sorted({p.device for p in active}))}",
        )
    return Check("infiniband", "PASS", shown)


def check_cpus(facts: SystemFacts, request: CheckRequest) -> Check:
    """The CPUs the cgroup grants against the affinity set and the DataLoader workers they can feed."""
    cpus, procs = facts.cpus, _processes(facts, request)
    workers = suggested_num_workers(cpus.effective, procs)
    quota = "none" if cpus.quota is None else f"{cpus.quota:g} CPUs ({cpus.quota_source})"
    env = f", PYTHON_CPU_COUNT={cpus.env_count}" if cpus.env_count is not None else ""
    shown = (
        f"effective {cpus.effective} CPU(s): affinity {cpus.affinity}, cgroup quota {quota}{env}; "
        f"{procs} process(es) -> num_workers <= {workers} each"
    )
    if cpus.quota is not None and cpus.quota < cpus.affinity:
        return Check(
            "cpus",
            "WARN",
            f"cgroup CPU quota below the affinity set: {shown}",
            f"use num_workers={workers} and OMP_NUM_THREADS={max(1, cpus.effective // procs)}, or raise "
            "the container's CPU limit (`docker run --cpus`)",
        )
    if request.num_workers is not None and request.num_workers > workers:
        return Check(
            "cpus", "WARN", f"num_workers={request.num_workers} oversubscribes: {shown}", f"use num_workers={workers}"
        )
    return Check("cpus", "PASS", shown)


def check_memory(facts: SystemFacts, request: CheckRequest) -> Check:
    """The cgroup memory limit against the processes and workers the run starts."""
    memory, procs = facts.memory, _processes(facts, request)
    workers = (
        request.num_workers if request.num_workers is not None else suggested_num_workers(facts.cpus.effective, procs)
    )
    host = f"host {_size(memory.host_total_bytes)}" if memory.host_total_bytes else "host memory unknown"
    if memory.limit_bytes is None:
        return Check("memory", "PASS", f"no cgroup memory limit; {host}")
    need = procs * (1 + workers) * MEMORY_PER_PROCESS
    shown = (
        f"cgroup limit {_size(memory.limit_bytes)} ({memory.source}); {host}; {procs} process(es) x "
        f"(1 + {workers} workers) x {_size(MEMORY_PER_PROCESS)} = {_size(need)}"
    )
    if memory.limit_bytes < need:
        return Check(
            "memory",
            "WARN",
            shown,
            "raise the container's memory limit (`docker run --memory`) or use fewer DataLoader workers",
        )
    return Check("memory", "PASS", shown)


def check_shm(facts: SystemFacts, request: CheckRequest) -> Check:
    """/dev/shm against the DataLoader workers that pass batches through it (Docker's default is 64 MiB)."""
    shm, procs = facts.shm, _processes(facts, request)
    if shm is None:
        return Check("shm", "SKIP", "no /dev/shm on this system")
    known = request.num_workers is not None
    workers = request.num_workers if known else suggested_num_workers(facts.cpus.effective, procs)
    shown = f"{shm.path} {_size(shm.size_bytes)} ({_size(shm.free_bytes)} free)"
    if not workers:
        return Check("shm", "PASS", f"{shown}; num_workers=0 does not use it")
    need = procs * workers * SHM_PER_WORKER
    shown += f"; {procs} process(es) x {workers} workers{'' if known else ' (assumed)'} need ~{_size(need)}"
    fix = "run the container with `--shm-size=8g` (or `--ipc=host`), or use num_workers=0"
    if shm.size_bytes < SHM_PER_WORKER:
        return Check("shm", "FAIL" if known else "WARN", f'{shown}: workers die with "bus error"', fix)
    if shm.size_bytes < need:
        return Check("shm", "WARN", shown, fix)
    return Check("shm", "PASS", shown)


def check_threads(facts: SystemFacts, request: CheckRequest) -> Check:
    """Threads x processes against the CPU budget, other processes' use of our CPUs, and the OpenMP wait policy: an
    OpenMP thread that spins for a core a neighbour holds made steps 8x slower (README "Sharing a machine")."""
    from lightning_accel.system.cpuset import CpuTopology
    from lightning_accel.system.threads import WAIT_POLICY_ENV, cpu_share, plan_threads

    topology = facts.topology or CpuTopology(cpus=tuple(range(facts.cpus.affinity)))
    share, source = cpu_share(facts.cpus, topology)
    procs, env = _processes(facts, request), facts.thread_env
    workers = request.num_workers or 0
    omp = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    threads = request.intra_op_threads or (int(omp) if omp.isdigit() and int(omp) > 0 else len(topology.cpus) or 1)
    policy = env.get(WAIT_POLICY_ENV, "").strip().upper()
    shown_policy = policy or "unset (libgomp spins at each barrier before it sleeps)"
    demand = procs * (threads + workers)
    others = (
        f"others used {facts.others_cpus:.2f} CPU(s) of ours over {facts.others_window_s:g} s"
        if facts.others_cpus is not None
        else "others' CPU use not measured"
    )
    detail = (
        f"{procs} process(es) x ({threads} intra-op thread(s) + {workers} worker(s)) = {demand:g} busy on "
        f"{share:g} CPU(s) ({source}); OMP_WAIT_POLICY={shown_policy}; {others}"
    )
    plan = plan_threads(cpus=share, ranks=procs, num_workers=workers, env={})
    fix = (
        "accel-train applies the thread plan by default (`threads=auto`); elsewhere start Python with "
        f"OMP_NUM_THREADS={plan.intra_op} OMP_WAIT_POLICY=PASSIVE"
    )
    shared = facts.others_cpus is not None and facts.others_cpus >= 0.5
    spinning = policy != "PASSIVE" and threads > 1
    if demand > share + 1e-9:
        kind = "oversubscribed, with spinning OpenMP threads" if spinning else "oversubscribed"
        return Check("threads", "WARN", f"{kind}: {detail}", fix)
    if shared and spinning:
        return Check("threads", "WARN", f"CPUs shared with other processes, OpenMP threads spinning: {detail}", fix)
    return Check("threads", "PASS", detail)


CHECKS: dict[str, Callable[[SystemFacts, CheckRequest], Check]] = {
    "packages": check_packages,
    "driver_cuda": check_driver_cuda,
    "gpus": check_gpus,
    "bf16": check_bf16,
    "nccl": check_nccl,
    "infiniband": check_infiniband,
    "cpus": check_cpus,
    "threads": check_threads,
    "memory": check_memory,
    "shm": check_shm,
}
"""Every check by name, in the order they are reported."""


def run_checks(
    facts: SystemFacts, request: CheckRequest | None = None, names: Sequence[str] | None = None
) -> list[Check]:
    """Run the checks called `names` (None: all of `CHECKS`) on `facts`.

    Raises:
        ValueError: for a name that is not in `CHECKS`.
    """
    unknown = [name for name in names or () if name not in CHECKS]
    if unknown:
        raise ConfigError(f"Unknown check(s) {unknown}; choose from {list(CHECKS)}.")
    request = request or CheckRequest()
    return [CHECKS[name](facts, request) for name in (CHECKS if names is None else names)]
