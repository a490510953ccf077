"""The thread plan applied to accel-train: OMP_WAIT_POLICY before torch loads, the environment every rank and worker
inherits, and torch's pools in each rank (the plan itself is `lightning_accel.system.threads`).

libgomp reads `OMP_WAIT_POLICY` once, when `import torch` loads it; setting it later changes nothing in this
process. So `accel-train` enters through `lightning_accel.train_entry`, which calls `set_early_environment` and only
then hands off to the command; `python -m lightning_accel.train` does the same before it can load torch. The launched
ranks and the DataLoader workers inherit the environment. This module imports no torch at the top.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING

from lightning_accel.system.cpuset import format_cpu_list, parse_cpu_list
from lightning_accel.system.threads import PLANNED_ENV, WAIT_POLICY_ENV, ThreadPlan, read_thread_plan

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from lightning_accel.shape import RunShape

__all__ = [
    "PLANNED_ENV",
    "THREAD_MODES",
    "WAIT_POLICIES",
    "apply_thread_plan",
    "describe_plan",
    "set_early_environment",
    "thread_plan_for",
]

THREAD_MODES = ("auto", "torch")
CPU_SETS_ENV, CPUS_ENV = "ACCEL_CPU_SETS", "ACCEL_CPUS"
"""With `threads.pin=true`: each local rank's CPUs (`0-1;2-3`), and the CPUs the launching rank could use."""
WAIT_POLICIES = ("PASSIVE", "ACTIVE")

log = logging.getLogger("lightning_accel.train")


def _argv_value(argv: Sequence[str], key: str) -> str | None:
    for arg in reversed(argv):
        name, sep, value = arg.partition("=")
        if sep and name.lstrip("+~") == key:
            return value.strip("'\"")
    return None


def _planned(env: Mapping[str, str]) -> set[str]:
    return {key for key in env.get(PLANNED_ENV, "").split(",") if key}


def _mark(env: MutableMapping[str, str], keys: set[str]) -> None:
    if keys:
        env[PLANNED_ENV] = ",".join(sorted(keys))
    else:
        env.pop(PLANNED_ENV, None)


def set_early_environment(argv: Sequence[str], env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set `OMP_WAIT_POLICY` (PASSIVE, or `threads.wait_policy=` from the command line) before torch is imported,
    unless it is already set or the command line says `threads=torch`. Returns what was set.

    The rest of the plan needs the composed config and is applied in each rank by `apply_thread_plan`.
    """
    env = os.environ if env is None else env
    mode = _argv_value(argv, "threads") or _argv_value(argv, "threads.mode")
    if mode == "torch" or env.get(WAIT_POLICY_ENV, "").strip():
        return {}
    policy = (_argv_value(argv, "threads.wait_policy") or "PASSIVE").upper()
    if policy not in WAIT_POLICIES:
        return {}  # an unknown value: left to `thread_plan_for`, which names the setting
    env[WAIT_POLICY_ENV] = policy
    _mark(env, _planned(env) | {WAIT_POLICY_ENV})
    return {WAIT_POLICY_ENV: policy}


def _ranks(shape: RunShape) -> int:
    if not shape.distributed:
        return 1
    if shape.devices_per_node is not None:
        return shape.devices_per_node
    return max(1, shape.visible_cuda) if shape.on_cuda else 1  # Lightning's `devices=auto` on the CPU is 1


def thread_plan_for(cfg: DictConfig, shape: RunShape, env: Mapping[str, str] | None = None) -> ThreadPlan | None:
    """The thread plan of a composed run (`threads` group), or None for `threads=torch` (torch's and Lightning's own
    settings). Variables a parent rank set for the plan (`ACCEL_THREADS_SET`) count as the plan's, not the user's.

    The group's values were checked before (their types by `schema.ThreadsConfig` as the config composed, their
    ranges by `checks.check_config`).
    """
    section = cfg.get("threads") or {}
    if str(section.get("mode", "auto")) == "torch":
        return None
    policy = section.get("wait_policy")
    intra = section.get("intra_op")
    env = os.environ if env is None else env
    ours = _planned(env)
    users = {key: value for key, value in env.items() if key not in ours}
    data = cfg.get("data") or {}
    workers = data.get("num_workers", 0)
    inherited = env.get(CPUS_ENV) if CPUS_ENV in ours else None  # a launched rank's mask is its parent's slice
    plan = read_thread_plan(
        affinity=parse_cpu_list(inherited) if inherited else None,
        ranks=_ranks(shape),
        num_workers=workers if isinstance(workers, int) and workers > 0 else 0,
        env=users,
        worker_cpu=section.get("worker_cpu", 1.0),
        intra_op=intra,
        wait_policy=None if policy is None else str(policy).upper(),
        pin=section.get("pin", False),
    )
    if plan.unpinned:  # the setting by its config path
        plan = dataclasses.replace(plan, unpinned=plan.unpinned.replace("`pin=True`", "`threads.pin=true`"))
    return plan


def _pin(plan: ThreadPlan, env: MutableMapping[str, str]) -> set[int] | None:
    """Pin this rank (and the workers it will fork) to its CPU set (`LOCAL_RANK`, 0 for the launching process);
    returns the affinity before, or None when nothing was pinned.

    A launched rank inherits the launching rank's (pinned) affinity: the sets and the CPUs they were cut from travel
    in `ACCEL_CPU_SETS` and `ACCEL_CPUS`, so every rank pins to its own slice and plans from the whole budget. Sets
    that cannot be used (a stale or forged `ACCEL_CPU_SETS` inherited from a parent, CPUs the OS refuses) leave
    the rank unpinned, with a warning that says why: never an error."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    sets = plan.cpu_sets
    inherited = CPU_SETS_ENV in _planned(env) and bool(env.get(CPU_SETS_ENV))
    if inherited:
        sets = tuple(parse_cpu_list(part) for part in env[CPU_SETS_ENV].split(";"))
    raw_rank = os.environ.get("LOCAL_RANK", "0") or "0"
    local_rank = int(raw_rank) if raw_rank.isdigit() else 0
    if not sets or local_rank >= len(sets):
        return None
    try:
        before = set(os.sched_getaffinity(0))
        if inherited:
            whole = set(parse_cpu_list(env.get(CPUS_ENV, ""))) or before
            if not sets[local_rank] or not set(sets[local_rank]) <= whole:
                raise OSError(errno.EINVAL, f"rank {local_rank}'s set is not within the CPUs {format_cpu_list(whole)}")
        if CPU_SETS_ENV not in env:  # the launching rank: its ranks read these
            env[CPU_SETS_ENV] = ";".join(format_cpu_list(cpus) for cpus in sets)
            env[CPUS_ENV] = format_cpu_list(before)
            _mark(env, _planned(env) | {CPU_SETS_ENV, CPUS_ENV})
        os.sched_setaffinity(0, sets[local_rank])
    except OSError as err:
        from lightning.fabric.utilities.rank_zero import rank_zero_warn

        from lightning_accel.errors import LightningAccelWarning

        source = f"{CPU_SETS_ENV}={env[CPU_SETS_ENV]!r}" if inherited else "the planned CPU sets"
        note = (
            f"threads.pin: rank {local_rank} is not pinned: {source} cannot be used ({err.strerror or err}); it "
            f"runs on every CPU it may use. Unset {CPU_SETS_ENV} and {CPUS_ENV} if a parent process left them."
        )
        log.warning(note)
        rank_zero_warn(note, category=LightningAccelWarning)
        return None
    return before


def apply_thread_plan(plan: ThreadPlan, env: MutableMapping[str, str] | None = None) -> Callable[[], None]:
    """Apply `plan` to this rank: its variables into `env` (None: `os.environ`, inherited by the ranks Lightning
    launches and the DataLoader workers), torch's intra-op and inter-op threads in this process; log one line.
    Returns the undo (the variables it added and the intra-op count it changed; torch cannot reset inter-op).
    """
    import torch

    target = os.environ if env is None else env
    policy_here = target.get(WAIT_POLICY_ENV, "").strip().upper() or None  # there when torch loaded: in force here
    before_marked = target.get(PLANNED_ENV)
    undo_env = plan.apply(target)
    _mark(target, _planned(target) | set(plan.set))
    pinned_env = {key: target.get(key) for key in (CPU_SETS_ENV, CPUS_ENV)}
    if plan.unpinned:
        from lightning.fabric.utilities.rank_zero import rank_zero_warn

        from lightning_accel.errors import LightningAccelWarning

        rank_zero_warn(plan.unpinned, category=LightningAccelWarning)
    before_cpus = _pin(plan, target)
    before_intra = torch.get_num_threads()
    torch.set_num_threads(plan.intra_op)
    interop = "inter-op " + str(plan.inter_op)
    try:
        torch.set_num_interop_threads(plan.inter_op)
    except RuntimeError:  # already set, or inter-op work already ran in this process: torch keeps its count
        interop = f"inter-op {torch.get_num_interop_threads()} (torch's pool had started)"
    if policy_here is None:
        wait = "torch's default (spinning) here: torch loaded before the plan (start with `accel-train`)"
    else:
        wait = f"OMP_WAIT_POLICY={policy_here}"
    log.info("%s | this rank: %d intra-op thread(s), %s, %s", plan.describe(), torch.get_num_threads(), interop, wait)

    def undo() -> None:
        undo_env()
        if before_marked is None:
            target.pop(PLANNED_ENV, None)
        else:
            target[PLANNED_ENV] = before_marked
        torch.set_num_threads(before_intra)
        if before_cpus is not None:
            os.sched_setaffinity(0, before_cpus)
        for key, value in pinned_env.items():
            if value is None:
                target.pop(key, None)
            else:
                target[key] = value

    return undo


def describe_plan(plan: ThreadPlan | None) -> str:
    """One line for `accel-train check=true` and the notes: the plan, or what `threads=torch` leaves."""
    if plan is None:
        return "threads=torch: torch's own thread pools and Lightning's OMP_NUM_THREADS under DDP"
    return plan.describe()
