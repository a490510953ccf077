"""read_cpu_budget and read_memory_limit over fake /proc and /sys trees: cgroup v1, v2, hybrid, nested, containers."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_accel.system import CpuBudget, read_cpu_budget, read_memory_limit
from lightning_accel.system.cgroup import cgroup_dirs

V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTS = (
    "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
)
MEMINFO = "MemTotal:       65856512 kB\nMemFree:        1000 kB\n"


def tree(root: Path, files: dict[str, str]) -> Path:
    """Write `files` ({relative path: text}) under `root`."""
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_v2_container_sees_its_cgroup_at_the_mount(tmp_path: Path) -> None:
    # Docker/Kubernetes with a cgroup namespace: the process's path is `/`, the limits sit at the mount point.
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/\n",
            "proc/self/mountinfo": V2_MOUNT,
            "proc/meminfo": MEMINFO,
            "sys/fs/cgroup/cpu.max": "150000 100000\n",
            "sys/fs/cgroup/memory.max": "8589934592\n",
        },
    )
    budget = read_cpu_budget(root, env={}, affinity=range(64))
    assert budget == CpuBudget(
        affinity=64, quota=1.5, quota_source=str(root / "sys/fs/cgroup/cpu.max"), cgroup_version=2
    )
    assert budget.effective == 2  # ceil(1.5)
    memory = read_memory_limit(root)
    assert memory.limit_bytes == 8 * 2**30 and memory.host_total_bytes == 65856512 * 1024
    assert memory.source == str(root / "sys/fs/cgroup/memory.max")


def test_v2_nested_takes_the_tightest_level_on_the_way_up(tmp_path: Path) -> None:
    # systemd host: the job's own cgroup has no quota, its parent slice has 4 CPUs, the grandparent 8.
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/batch.slice/job-7.scope/task\n",
            "proc/self/mountinfo": V2_MOUNT,
            "sys/fs/cgroup/batch.slice/cpu.max": "800000 100000\n",
            "sys/fs/cgroup/batch.slice/job-7.scope/cpu.max": "400000 100000\n",
            "sys/fs/cgroup/batch.slice/job-7.scope/task/cpu.max": "max 100000\n",
            "sys/fs/cgroup/batch.slice/memory.max": "max\n",
            "sys/fs/cgroup/batch.slice/job-7.scope/memory.max": "4294967296\n",
            "sys/fs/cgroup/batch.slice/job-7.scope/task/memory.max": "17179869184\n",
        },
    )
    budget = read_cpu_budget(root, env={}, affinity=16)
    assert budget.quota == 4.0 and budget.effective == 4
    assert budget.quota_source.endswith("batch.slice/job-7.scope/cpu.max")
    assert read_memory_limit(root).limit_bytes == 4 * 2**30  # the child's 16 GiB cannot exceed its parent's 4


def test_v1_cfs_quota_and_unlimited_memory(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "4:memory:/\n3:cpu,cpuacct:/\n0::/\n",
            "proc/self/mountinfo": V1_MOUNTS,
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "250000\n",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "no limit"
        },
    )
    budget = read_cpu_budget(root, env={}, affinity=8)
    assert (budget.quota, budget.cgroup_version, budget.effective) == (2.5, 1, 3)  # v1 wins in a hybrid layout
    assert read_memory_limit(root).limit_bytes is None


def test_v1_nested_with_no_quota_below_a_limited_parent(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "5:memory:/kubepods/pod1/c1\n3:cpu,cpuacct:/kubepods/pod1/c1\n",
            "proc/self/mountinfo": V1_MOUNTS,
            "sys/fs/cgroup/cpu,cpuacct/kubepods/pod1/c1/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu,cpuacct/kubepods/pod1/c1/cpu.cfs_period_us": "100000\n",
            "sys/fs/cgroup/cpu,cpuacct/kubepods/pod1/cpu.cfs_quota_us": "50000\n",
            "sys/fs/cgroup/cpu,cpuacct/kubepods/pod1/cpu.cfs_period_us": "100000\n",
            "sys/fs/cgroup/memory/kubepods/pod1/c1/memory.limit_in_bytes": "1073741824\n",
            "sys/fs/cgroup/memory/kubepods/memory.limit_in_bytes": "9223372036854771712\n",
        },
    )
    budget = read_cpu_budget(root, env={}, affinity=4)
    assert budget.quota == 0.5 and budget.effective == 1 and "kubepods/pod1/cpu.cfs" in budget.quota_source
    assert read_memory_limit(root).limit_bytes == 2**30


def test_host_path_under_a_bind_mounted_subtree(tmp_path: Path) -> None:
    # Without a cgroup namespace, /proc/self/cgroup shows the host path and the mount's root is that subtree.
    mountinfo = "40 31 0:38 /docker/abc /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw\n"
    root = tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/docker/abc\n",
            "proc/self/mountinfo": mountinfo,
            "sys/fs/cgroup/cpu.max": "300000 100000\n",
        },
    )
    assert cgroup_dirs("cpu", root) == (2, [root / "sys/fs/cgroup"])
    assert read_cpu_budget(root, env={}, affinity=32).quota == 3.0


def test_mount_point_with_an_escaped_space_and_no_mountinfo_fallback(tmp_path: Path) -> None:
    mountinfo = "30 23 0:26 / /sys/fs/my\\040cgroup rw - cgroup2 cgroup2 rw\n"
    root = tree(
        tmp_path,
        {"proc/self/cgroup": "0::/\n", "proc/self/mountinfo": mountinfo, "sys/fs/my cgroup/cpu.max": "100000 100000\n"},
    )
    assert read_cpu_budget(root, env={}, affinity=2).quota == 1.0
    bare = tree(tmp_path / "bare", {"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/cpu.max": "200000 100000\n"})
    assert read_cpu_budget(bare, env={}, affinity=2).quota == 2.0  # /sys/fs/cgroup assumed


@pytest.mark.parametrize(
    ("env", "affinity", "effective"),
    [({"PYTHON_CPU_COUNT": "3"}, 8, 3), ({"PYTHON_CPU_COUNT": "junk"}, 8, 6), ({}, 5, 5)],
)
def test_effective_is_the_smallest_limit(tmp_path: Path, env: dict[str, str], affinity: int, effective: int) -> None:
    root = tree(
        tmp_path,
        {"proc/self/cgroup": "0::/\n", "proc/self/mountinfo": V2_MOUNT, "sys/fs/cgroup/cpu.max": "600000 100000\n"},
    )
    assert read_cpu_budget(root, env=env, affinity=affinity).effective == effective


def test_nothing_to_read_is_not_an_error(tmp_path: Path) -> None:
    budget = read_cpu_budget(tmp_path, env={}, affinity={0, 1})
    assert budget == CpuBudget(affinity=2) and budget.effective == 2
    memory = read_memory_limit(tmp_path)
    assert memory.limit_bytes is None and memory.host_total_bytes is None


def test_this_machine_reads_without_error() -> None:
    budget = read_cpu_budget()
    assert 1 <= budget.effective <= budget.affinity
    read_memory_limit()
