"""read_cpu_topology over fake trees: the kernel's CPU-list format, nested cpusets, and NUMA nodes."""

from __future__ import annotations

from pathlib import Path

from lightning_accel.system.cpuset import format_cpu_list, parse_cpu_list, read_cpu_topology

V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw\n"


def test_cpu_lists_round_trip_and_bad_parts_are_skipped() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpu_list("") == () and parse_cpu_list("x,2") == (2,)
    assert format_cpu_list((11, 0, 1, 2, 3, 8, 10)) == "0-3,8,10-11"
    assert format_cpu_list(()) == ""


def test_affinity_within_a_nested_cpuset_and_its_numa_nodes(tmp_path: Path) -> None:
    files = {
        "proc/self/cgroup": "0::/a/b\n",
        "proc/self/mountinfo": V2_MOUNT,
        "sys/fs/cgroup/a/cpuset.cpus.effective": "0-7\n",
        "sys/fs/cgroup/a/b/cpuset.cpus.effective": "2-5\n",
        "sys/devices/system/node/node0/cpulist": "0-3\n",
        "sys/devices/system/node/node1/cpulist": "4-7\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    topology = read_cpu_topology(tmp_path, affinity=range(8))
    assert topology.cpus == (2, 3, 4, 5) and topology.cpuset == (2, 3, 4, 5)
    assert topology.cpuset_source.endswith("a/b/cpuset.cpus.effective")
    assert topology.numa_nodes == ((2, 3), (4, 5))
    assert read_cpu_topology(tmp_path, affinity=[3, 4, 6]).cpus == (3, 4)


def test_no_cgroup_and_no_nodes_is_the_affinity(tmp_path: Path) -> None:
    topology = read_cpu_topology(tmp_path, affinity=[0, 1])
    assert topology.cpus == (0, 1) and topology.cpuset is None and topology.numa_nodes == ()
