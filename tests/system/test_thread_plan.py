"""The thread plan over fake cgroup v1/v2 trees: a quota of 1.5 CPUs, a cpuset of one core, nested cgroups, ranks
and workers sharing the budget, and the user's OMP_NUM_THREADS and OMP_WAIT_POLICY kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_accel.system.threads import THREAD_COUNT_ENV, plan_threads, read_thread_plan

V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTS = (
    "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
    "33 31 0:30 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
)
EIGHT = range(8)


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_v2_quota_of_one_and_a_half_cpus_gives_one_thread(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {"proc/self/cgroup": "0::/\n", "proc/self/mountinfo": V2_MOUNT, "sys/fs/cgroup/cpu.max": "150000 100000\n"},
    )
    plan = read_thread_plan(root=root, env={}, affinity=EIGHT)
    assert plan.cpus == 1.5 and "cgroup quota 1.5 CPUs" in plan.budget_source
    assert (plan.intra_op, plan.inter_op) == (1, 1)
    assert plan.set == {**{key: "1" for key in THREAD_COUNT_ENV}, "OMP_WAIT_POLICY": "PASSIVE"}
    assert not plan.oversubscribed


def test_v1_cpuset_of_one_core_gives_one_thread_and_names_the_cpuset(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "4:cpuset:/job\n3:cpu,cpuacct:/job\n2:memory:/job\n",
            "proc/self/mountinfo": V1_MOUNTS,
            "sys/fs/cgroup/cpuset/cpuset.cpus": "0-7\n",
            "sys/fs/cgroup/cpuset/job/cpuset.cpus": "3\n",
            "sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_period_us": "100000\n",
        },
    )
    plan = read_thread_plan(root=root, env={}, affinity=EIGHT)
    assert plan.cpus == 1 and plan.intra_op == 1
    assert plan.budget_source.startswith("cpuset 3 (") and "job/cpuset.cpus" in plan.budget_source


def test_v2_nested_cgroups_take_the_tightest_quota_and_cpuset(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/team/job\n",
            "proc/self/mountinfo": V2_MOUNT,
            "sys/fs/cgroup/team/cpu.max": "300000 100000\n",  # the parent: 3 CPUs
            "sys/fs/cgroup/team/job/cpu.max": "max 100000\n",  # the job itself: no quota of its own
            "sys/fs/cgroup/team/cpuset.cpus.effective": "0-5\n",
            "sys/fs/cgroup/team/job/cpuset.cpus.effective": "0-3\n",
        },
    )
    plan = read_thread_plan(root=root, env={}, affinity=EIGHT)
    assert plan.cpus == 3 and "team/cpu.max" in plan.budget_source
    assert plan.intra_op == 3
    deeper = tree(tmp_path, {"sys/fs/cgroup/team/job/cpuset.cpus.effective": "2-3\n"})
    plan = read_thread_plan(root=deeper, env={}, affinity=EIGHT)
    assert plan.cpus == 2 and plan.budget_source.startswith("cpuset 2-3")


def test_the_users_omp_num_threads_and_wait_policy_win_and_the_plan_says_so() -> None:
    env = {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "active"}
    plan = plan_threads(cpus=2, env=env)
    assert plan.intra_op == 3 and plan.wait_policy == "ACTIVE"
    assert plan.kept == env
    assert "OMP_NUM_THREADS" not in plan.set and plan.set["MKL_NUM_THREADS"] == "3"
    assert "your OMP_NUM_THREADS=3 wins over the planned 2" in plan.describe()
    assert "kept yours: OMP_NUM_THREADS=3, OMP_WAIT_POLICY=active" in plan.describe()
    assert plan.oversubscribed  # 3 threads on 2 CPUs, and the log line says it
    assert "oversubscribed: 3 busy threads on 2 CPU(s)" in plan.describe()


@pytest.mark.parametrize(
    ("cpus", "ranks", "workers", "intra"),
    [(2, 1, 0, 2), (2, 2, 0, 1), (8, 2, 0, 4), (8, 2, 2, 2), (2, 1, 2, 1), (16, 4, 1, 3), (1, 4, 0, 1)],
)
def test_ranks_and_workers_share_one_budget(cpus: float, ranks: int, workers: int, intra: int) -> None:
    plan = plan_threads(cpus=cpus, ranks=ranks, num_workers=workers, env={})
    assert plan.intra_op == intra and plan.set["OMP_NUM_THREADS"] == str(intra)
    assert plan.oversubscribed == (ranks * (intra + workers) > cpus)


def test_an_io_bound_loader_leaves_its_cpu_to_the_threads() -> None:
    assert plan_threads(cpus=4, num_workers=2, env={}, worker_cpu=0.25).intra_op == 3


def test_apply_sets_what_is_missing_and_the_undo_removes_only_that() -> None:
    env = {"MKL_NUM_THREADS": "7"}
    plan = plan_threads(cpus=2, env={})
    undo = plan.apply(env)
    assert env["OMP_NUM_THREADS"] == "2" and env["OMP_WAIT_POLICY"] == "PASSIVE" and env["MKL_NUM_THREADS"] == "7"
    env["OPENBLAS_NUM_THREADS"] = "5"  # changed since: left alone
    undo()
    assert env == {"MKL_NUM_THREADS": "7", "OPENBLAS_NUM_THREADS": "5"}


@pytest.mark.parametrize("bad", [{"ranks": 0}, {"num_workers": -1}, {"cpus": 0}, {"worker_cpu": -0.5}])
def test_impossible_facts_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        plan_threads(**{"cpus": 2.0, **bad})  # type: ignore[arg-type]


def test_this_machine_plans_without_error() -> None:
    plan = read_thread_plan(env={})
    assert plan.intra_op >= 1 and plan.cpus > 0 and plan.budget_source


def test_the_planned_threads_for_a_worker_count_only_when_the_plan_set_them() -> None:
    from lightning_accel.system.threads import PLANNED_ENV, planned_intra_op

    assert planned_intra_op(1, env={}) is None  # no plan applied
    assert planned_intra_op(1, env={"OMP_NUM_THREADS": "4"}) is None  # the user's count: left alone
    env = {PLANNED_ENV: "OMP_NUM_THREADS,OMP_WAIT_POLICY", "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    assert planned_intra_op(0, env=env) == read_thread_plan(env={}).intra_op
    assert planned_intra_op(1, env=env) == read_thread_plan(num_workers=1, env={}).intra_op


def test_pinning_gives_each_rank_disjoint_cpus_node_by_node(tmp_path: Path) -> None:
    from lightning_accel.system.threads import pinned_cpu_sets

    assert pinned_cpu_sets(range(8), 2, numa_nodes=((0, 2, 4, 6), (1, 3, 5, 7))) == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert pinned_cpu_sets(range(6), 4) == ((0,), (1,), (2,), (3,))  # 4 and 5 stay unpinned
    assert pinned_cpu_sets((3,), 2) == ()  # one CPU for two ranks: no disjoint pinning
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/\n",
            "proc/self/mountinfo": V2_MOUNT,
            "sys/fs/cgroup/cpuset.cpus.effective": "0-3\n",
            "sys/devices/system/node/node0/cpulist": "0-1\n",
            "sys/devices/system/node/node1/cpulist": "2-3\n",
        },
    )
    plan = read_thread_plan(root=root, env={}, affinity=EIGHT, ranks=2, pin=True)
    assert plan.cpu_sets == ((0, 1), (2, 3)) and "pinned: rank 0 on 0-1, rank 1 on 2-3" in plan.describe()
    assert read_thread_plan(root=root, env={}, affinity=EIGHT, ranks=2).cpu_sets == ()
