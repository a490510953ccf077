"""The thread plan: intra-op and inter-op threads per rank, the OpenMP wait policy and the environment every rank and
DataLoader worker inherits, decided from the CPU budget (cgroup quota, cpuset, affinity) before torch starts its pools.

Why: torch sizes its intra-op pool to every CPU it can see and libgomp spin-waits for a while at each barrier. On a
shared machine a spinning thread waits for a core a neighbour holds: a 256-1024-256 MLP's AdamW step on 2 cores
beside one busy process ran at 7-15 steps/s with torch's defaults, 68-90 with one thread and 100 with two passive
threads. `plan_threads` is a plain function of the facts; `read_thread_plan` reads them from the machine.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field, replace

from lightning_accel.system.cgroup import CpuBudget, read_cpu_budget
from lightning_accel.system.cpuset import CpuTopology, format_cpu_list, read_cpu_topology

__all__ = [
    "PLANNED_ENV",
    "THREAD_COUNT_ENV",
    "WAIT_POLICY_ENV",
    "ThreadPlan",
    "cpu_share",
    "pinned_cpu_sets",
    "plan_threads",
    "planned_intra_op",
    "read_thread_plan",
]

THREAD_COUNT_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")
"""The thread counts the plan sets: OpenMP (torch's intra-op pool), MKL, OpenBLAS and numexpr (numpy, pandas)."""
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
"""Read by libgomp when it is loaded (at `import torch`), so it must be in the environment before that."""
PLANNED_ENV = "ACCEL_THREADS_SET"
"""The variables the plan set, comma-separated: a launched rank (and the DataLoaderTuner) reads them as the plan's,
not the user's."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ThreadPlan:
    """How many threads each rank runs, how its OpenMP threads wait, and the variables every process inherits."""

    cpus: float
    """The CPU budget of this node's run: affinity within the cpuset, capped by the cgroup quota."""
    budget_source: str
    """What set `cpus`, for the log (`cgroup quota 1.5 CPUs (/sys/fs/cgroup/cpu.max)`)."""
    ranks: int
    """Training processes on this node that share the budget."""
    num_workers: int
    """DataLoader workers per rank (each runs torch with one thread; their CPU comes out of the same budget)."""
    worker_cpu: float = 1.0
    """CPUs one worker is counted for while it loads."""
    intra_op: int
    """`torch.set_num_threads` of each rank: the user's `OMP_NUM_THREADS` when set, else the plan's."""
    inter_op: int
    """`torch.set_num_interop_threads` of each rank."""
    wait_policy: str
    """`OMP_WAIT_POLICY` in force: the user's when set, else `PASSIVE` (threads sleep at a barrier, never spin)."""
    set: dict[str, str] = field(default_factory=dict)
    """Variables the plan sets (each rank and worker inherits them), minus those the user set."""
    kept: dict[str, str] = field(default_factory=dict)
    """Variables the plan would set that the user already set: theirs win."""
    reasons: tuple[str, ...] = ()
    """Why each number was chosen, for the log."""
    cpu_sets: tuple[tuple[int, ...], ...] = ()
    """With pinning: the CPUs of each local rank (its DataLoader workers inherit them), disjoint; empty: no pinning."""
    unpinned: str = ""
    """Why ranks that asked to be pinned (`pin=True`) are not: fewer CPUs than ranks; empty otherwise."""

    @property
    def demand(self) -> float:
        """CPUs the run keeps busy at once: ranks x (intra-op threads + workers x `worker_cpu`)."""
        return self.ranks * (self.intra_op + self.num_workers * self.worker_cpu)

    @property
    def oversubscribed(self) -> bool:
        """Whether the run asks for more CPUs than its budget."""
        return self.demand > self.cpus + 1e-9

    def apply(self, env: MutableMapping[str, str] | None = None) -> Callable[[], None]:
        """Write `set` into `env` (None: `os.environ`, inherited by the ranks Lightning launches and by the
        DataLoader workers); returns the undo, which removes what this call added (a value changed since is left)."""
        target = os.environ if env is None else env
        added = {key: value for key, value in self.set.items() if key not in target}
        target.update(added)

        def undo() -> None:
            for key, value in added.items():
                if target.get(key) == value:
                    del target[key]
            added.clear()

        return undo

    def describe(self) -> str:
        """One line for the log: the budget, the split and the environment, with the user's values marked."""
        head = (
            f"threads: {self.cpus:g} CPU(s) ({self.budget_source}) for {self.ranks} rank(s) x "
            f"({self.intra_op} intra-op thread(s) + {self.num_workers} worker(s)); inter-op {self.inter_op}; "
            f"OMP_WAIT_POLICY={self.wait_policy}"
        )
        parts = [head, "set " + (", ".join(f"{k}={v}" for k, v in self.set.items()) or "nothing")]
        if self.kept:
            parts.append("kept yours: " + ", ".join(f"{k}={v}" for k, v in self.kept.items()))
        if self.oversubscribed:
            parts.append(f"oversubscribed: {self.demand:g} busy threads on {self.cpus:g} CPU(s)")
        if self.cpu_sets:
            pinned = ", ".join(f"rank {i} on {format_cpu_list(c)}" for i, c in enumerate(self.cpu_sets))
            parts.append(f"pinned: {pinned}")
        if self.unpinned:
            parts.append(self.unpinned)
        return "; ".join(parts + list(self.reasons))


def cpu_share(budget: CpuBudget, topology: CpuTopology) -> tuple[float, str]:
    """The CPUs a node's run may keep busy, and what limits them: the affinity within the cpuset, the cgroup quota
    (fractional: 1.5 CPUs) and `PYTHON_CPU_COUNT`, whichever is smallest."""
    cpus = len(topology.cpus) or budget.affinity
    shown = format_cpu_list(topology.cpus)
    if topology.cpuset is not None and set(topology.cpus) == set(topology.cpuset):
        limits = [(float(cpus), f"cpuset {shown} ({topology.cpuset_source})")]
    else:
        limits = [(float(cpus), f"affinity {shown}")]
    if budget.quota is not None:
        limits.append((budget.quota, f"cgroup quota {budget.quota:g} CPUs ({budget.quota_source})"))
    if budget.env_count is not None:
        limits.append((float(budget.env_count), f"PYTHON_CPU_COUNT={budget.env_count}"))
    value, source = min(limits, key=lambda item: item[0])
    return max(value, 0.01), source


def pinned_cpu_sets(
    cpus: Sequence[int], ranks: int, numa_nodes: Sequence[Sequence[int]] = ()
) -> tuple[tuple[int, ...], ...]:
    """Disjoint CPU sets, one per local rank, within `cpus`: equal slices of the CPUs taken node by node, so a rank's
    slice stays on one NUMA node whenever the node holds a slice. Empty when there are fewer CPUs than ranks (no
    disjoint pinning exists); CPUs beyond `ranks` x slice stay unpinned.
    """
    allowed = set(cpus)
    ordered = [c for node in numa_nodes for c in sorted(node) if c in allowed]
    ordered += [c for c in sorted(allowed) if c not in set(ordered)]
    per = len(ordered) // ranks if ranks > 0 else 0
    if per < 1:
        return ()
    return tuple(tuple(ordered[i * per : (i + 1) * per]) for i in range(ranks))


def _user_count(env: Mapping[str, str], key: str) -> int | None:
    raw = env.get(key, "").strip().split(",")[0]  # OpenMP takes a list per nesting level; the first is the pool
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def plan_threads(
    *,
    cpus: float,
    ranks: int = 1,
    num_workers: int = 0,
    env: Mapping[str, str] | None = None,
    budget_source: str = "",
    worker_cpu: float = 1.0,
    intra_op: int | None = None,
    wait_policy: str | None = None,
    cpu_sets: tuple[tuple[int, ...], ...] = (),
) -> ThreadPlan:
    """The thread plan for `ranks` processes on a node with `cpus` CPUs, each feeding `num_workers` workers.

    The rule: the whole CPUs of the budget (a quota of 1.5 gives 1: a thread beyond the quota only runs by taking
    time from the others, and a throttled period stalls every thread of the barrier at once) less what the workers
    use (`worker_cpu` each), shared equally among the ranks, at least one thread each. Inter-op threads match.
    OpenMP threads wait passively: a spinning thread beside a neighbour's busy process holds the core the thread
    it waits for needs (8x slower steps, README "Sharing a machine"); when the CPUs are the run's own, passive
    waiting costs a wake-up per parallel region, within noise on the runs measured. What the user set wins.

    Args:
        cpus: the CPU budget (`cpu_share`).
        ranks: training processes on this node.
        num_workers: DataLoader workers per rank.
        env: the environment the run starts with; None: `os.environ`.
        budget_source: what set `cpus`, for the log.
        worker_cpu: CPUs one worker keeps busy while it loads (1.0: a CPU-bound loader; an I/O-bound one less).
        intra_op: intra-op threads per rank chosen by the caller (a config's), instead of the rule's.
        wait_policy: `PASSIVE` or `ACTIVE` chosen by the caller, instead of PASSIVE.
        cpu_sets: each local rank's CPUs when ranks are pinned (`pinned_cpu_sets`); empty: no pinning.

    Raises:
        ValueError: for `ranks < 1`, `num_workers < 0`, `cpus <= 0`, `worker_cpu < 0` or `intra_op < 1`.
    """
    if ranks < 1 or num_workers < 0 or cpus <= 0 or worker_cpu < 0 or (intra_op is not None and intra_op < 1):
        raise ValueError(
            f"{ranks=} and {intra_op=} must be >= 1, {num_workers=} and {worker_cpu=} >= 0 and {cpus=} > 0"
        )
    env = os.environ if env is None else env
    whole = max(1, math.floor(cpus + 1e-9))
    for_threads = whole - ranks * num_workers * worker_cpu
    planned = max(1, math.floor(for_threads / ranks + 1e-9))
    reasons = [f"{whole} whole CPU(s) - {ranks} x {num_workers} worker(s) x {worker_cpu:g} CPU, over {ranks} rank(s)"]
    if intra_op is not None:
        planned = intra_op
        reasons = [f"intra_op={intra_op} chosen by the config"]
    user_omp = _user_count(env, "OMP_NUM_THREADS")
    intra = user_omp if user_omp is not None else planned
    if user_omp is not None and user_omp != planned:
        reasons.append(f"your OMP_NUM_THREADS={env['OMP_NUM_THREADS']} wins over the planned {planned}")
    wanted = {key: str(intra) for key in THREAD_COUNT_ENV}
    wanted[WAIT_POLICY_ENV] = (wait_policy or "PASSIVE").upper()
    kept = {key: env[key] for key in wanted if env.get(key, "").strip()}
    to_set = {key: value for key, value in wanted.items() if key not in kept}
    return ThreadPlan(
        cpus=cpus,
        budget_source=budget_source or f"{cpus:g} CPU(s)",
        ranks=ranks,
        num_workers=num_workers,
        worker_cpu=worker_cpu,
        intra_op=intra,
        inter_op=intra,
        wait_policy=kept.get(WAIT_POLICY_ENV, wanted[WAIT_POLICY_ENV]).upper(),
        set=to_set,
        kept=kept,
        reasons=tuple(reasons),
        cpu_sets=cpu_sets,
    )


def read_thread_plan(
    *,
    ranks: int = 1,
    num_workers: int = 0,
    root: str | os.PathLike[str] = "/",
    env: Mapping[str, str] | None = None,
    affinity: Collection[int] | None = None,
    worker_cpu: float = 1.0,
    intra_op: int | None = None,
    wait_policy: str | None = None,
    pin: bool = False,
) -> ThreadPlan:
    """`plan_threads` over this machine's facts (or a fake tree under `root`): `read_cpu_budget` and
    `read_cpu_topology` give the budget.

    Example::

        read_thread_plan(ranks=2, num_workers=1).describe()
        # threads: 1.5 CPU(s) (cgroup quota 1.5 CPUs (/sys/fs/cgroup/cpu.max)) for 2 rank(s) x (1 intra-op ...
    """
    env = os.environ if env is None else env
    budget = read_cpu_budget(root, env, affinity)
    topology = read_cpu_topology(root, affinity)
    cpus, source = cpu_share(budget, topology)
    cpu_sets = pinned_cpu_sets(topology.cpus, ranks, topology.numa_nodes) if pin else ()
    plan = plan_threads(
        cpus=cpus,
        ranks=ranks,
        num_workers=num_workers,
        env=env,
        budget_source=source,
        worker_cpu=worker_cpu,
        intra_op=intra_op,
        wait_policy=wait_policy,
        cpu_sets=cpu_sets,
    )
    if pin and not cpu_sets:
        shown = format_cpu_list(topology.cpus)
        why = (
            f"not pinned: `pin=True` gives each rank CPUs of its own, and the {len(topology.cpus)} CPU(s) here "
            f"({shown}) cannot be split between {ranks} ranks; every rank runs on all of them"
        )
        plan = replace(plan, unpinned=why)
    return plan


def planned_intra_op(
    num_workers: int, ranks: int = 1, env: Mapping[str, str] | None = None, root: str | os.PathLike[str] = "/"
) -> int | None:
    """The intra-op threads the plan gives each rank when it feeds `num_workers` workers, or None when the plan does
    not set this process's threads (no plan applied, or the user's `OMP_NUM_THREADS`): the DataLoaderTuner's trials
    and its decision then leave torch's count alone. Workers and intra-op threads share one budget.
    """
    env = os.environ if env is None else env
    planned = {key for key in env.get(PLANNED_ENV, "").split(",") if key}
    if "OMP_NUM_THREADS" not in planned:
        return None
    users = {key: value for key, value in env.items() if key not in planned}
    return read_thread_plan(ranks=ranks, num_workers=num_workers, root=root, env=users).intra_op
