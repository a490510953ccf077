"""accel-doctor: tables and --json over fake trees and a fake NVML, exit codes 0/1/2, and a run on this machine."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _fake_nvml import FakeGPU, FakeNVML, install

from lightning_accel import doctor
from lightning_accel.system import CHECKS


def fake_machine(root: Path, monkeypatch: pytest.MonkeyPatch, *, cpu_max: str, shm_mib: int, cuda_driver: int) -> Path:
    """A container (cgroup v2 quota `cpu_max`), `shm_mib` MiB of /dev/shm, two H100s on a `cuda_driver` driver."""
    files = {
        "proc/self/cgroup": "0::/\n",
        "proc/self/mountinfo": "1 0 0:1 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
        "sys/fs/cgroup/cpu.max": cpu_max,
        "proc/meminfo": "MemTotal: 1048576000 kB\n",
        "proc/cpuinfo": "processor\t: 0\nmodel name\t: Fake Xeon\nflags\t\t: fpu amx_bf16\n\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    shm = root / "dev" / "shm"
    shm.mkdir(parents=True)
    real = os.statvfs
    fake = SimpleNamespace(f_frsize=4096, f_bsize=4096, f_blocks=shm_mib * 256, f_bavail=shm_mib * 256)
    monkeypatch.setattr(os, "statvfs", lambda path: fake if str(path) == str(shm) else real(path))
    install(
        monkeypatch,
        FakeNVML([FakeGPU("GPU-a", nvlinks=18), FakeGPU("GPU-b", nvlinks=18)], cuda_driver_version=cuda_driver),
    )
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    return root


def test_healthy_gpu_node_exits_0_with_a_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    root = fake_machine(tmp_path, monkeypatch, cpu_max="max 100000\n", shm_mib=16384, cuda_driver=12040)
    code = doctor.main(["--root", str(root), "--num-workers", "4"], env={"CUDA_VISIBLE_DEVICES": "0,1"})
    out = capsys.readouterr().out
    assert code == 0, out
    for words in ("accel-doctor: checks", "driver_cuda", "NVIDIA H100 80GB HBM3", "0-1 NV", "16.0 GiB", "-> exit 0"):
        assert words in out
    assert "FAIL" not in out.replace("0 FAIL", "")


def test_failures_exit_1_and_json_lists_checks_and_facts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    root = fake_machine(tmp_path, monkeypatch, cpu_max="150000 100000\n", shm_mib=64, cuda_driver=11080)
    code = doctor.main(["--root", str(root), "--json", "--num-workers", "2", "--devices", "2"], env={})
    document = json.loads(capsys.readouterr().out)
    assert code == 1
    assert set(document) == {"schema_version", "ok", "counts", "request", "checks", "facts"}
    assert document["schema_version"] == doctor.JSON_SCHEMA_VERSION and document["ok"] is False
    assert document["request"] == {"devices": 2, "num_workers": 2, "num_nodes": 1}
    checks = {c["name"]: c for c in document["checks"]}
    assert list(checks) == list(CHECKS) and all(set(c) == {"name", "status", "detail", "fix"} for c in checks.values())
    assert checks["driver_cuda"]["status"] == "FAIL" and "insufficient" in checks["driver_cuda"]["detail"]
    assert checks["shm"]["status"] == "FAIL" and checks["cpus"]["status"] == "WARN"
    assert document["counts"]["FAIL"] == 2 and sum(document["counts"].values()) == len(CHECKS)
    facts = document["facts"]
    assert facts["cpus"]["effective"] == 2 and facts["cpus"]["quota"] == 1.5
    assert facts["shm"]["size_bytes"] == 64 * 2**20 and facts["nvml"]["cuda_driver_version"] == [11, 8]
    assert [g["capability"] for g in facts["nvml"]["gpus"]] == [[9, 0], [9, 0]]


def test_only_the_named_checks_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    root = fake_machine(tmp_path, monkeypatch, cpu_max="max 100000\n", shm_mib=64, cuda_driver=11080)
    code = doctor.main(["--root", str(root), "--json", "--check", "cpus", "--check", "bf16"], env={})
    assert code == 0
    assert [c["name"] for c in json.loads(capsys.readouterr().out)["checks"]] == ["cpus", "bf16"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--devices", "-1"],
        ["--num-workers", "many"],
        ["--check", "gpu"],
        ["--bogus"],
        ["--num-nodes", "0"],
        ["--root", "/nonexistent"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        doctor.main(argv)
    assert exit_info.value.code == 2 and "accel-doctor: error" in capsys.readouterr().err


def test_a_root_that_is_no_directory_is_named(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("ACCEL_DOCTOR_ROOT", "/nonexistent")
    with pytest.raises(SystemExit) as exit_info:
        doctor.main([])
    assert exit_info.value.code == 2 and "`ACCEL_DOCTOR_ROOT=/nonexistent`" in capsys.readouterr().err


def test_this_machine(capsys) -> None:
    code = doctor.main(["--json"])
    document = json.loads(capsys.readouterr().out)
    checks = {c["name"]: c["status"] for c in document["checks"]}
    assert code == 0 and document["ok"], document["checks"]
    assert document["facts"]["cpus"]["effective"] >= 1
    if not document["facts"]["nvml"]["available"]:  # a machine without GPUs: the GPU checks skip, they do not fail
        assert checks["gpus"] == checks["nccl"] == checks["driver_cuda"] == "SKIP"


def test_python_dash_m_on_this_machine(run_cli, tmp_path: Path) -> None:
    proc = run_cli([], tmp_path, timeout=120, module="lightning_accel.doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "effective" in proc.stdout and "/dev/shm" in proc.stdout and "-> exit 0" in proc.stdout


def test_garbage_in_proc_and_sys_is_read_as_unknown_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A MemTotal without a number raised IndexError; a cpuset of `0-99999999999` spelled out 10^11 CPUs (minutes, then
    MemoryError)."""
    root = fake_machine(tmp_path, monkeypatch, cpu_max="max 100000\n", shm_mib=16384, cuda_driver=12040)
    (root / "proc" / "meminfo").write_text("MemTotal:\nMemTotal: lots kB\n")
    (root / "sys" / "fs" / "cgroup" / "cpuset.cpus.effective").write_text("0-99999999999\n")
    node = root / "sys" / "devices" / "system" / "node" / "node0"
    node.mkdir(parents=True)
    (node / "cpulist").write_bytes(b"\x00\xff 5-2,-7,0-1")
    code = doctor.main(["--root", str(root), "--json"], env={})
    facts = json.loads(capsys.readouterr().out)["facts"]
    assert code in (0, 1)
    assert facts["memory"]["host_total_bytes"] is None
    assert facts["topology"]["cpuset"] is None and facts["topology"]["numa_nodes"] in ([], [[0, 1]], [[0]], [[1]])


def test_a_fact_that_cannot_be_read_is_named_and_the_others_still_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from lightning_accel.system import facts as facts_module

    root = fake_machine(tmp_path, monkeypatch, cpu_max="max 100000\n", shm_mib=16384, cuda_driver=12040)

    def garbage(root: object) -> None:
        raise ValueError("invalid literal for int() with base 10: 'garbage'")

    monkeypatch.setattr(facts_module, "read_memory_limit", garbage)
    code = doctor.main(["--root", str(root), "--json"], env={"CUDA_VISIBLE_DEVICES": "0,1"})
    document = json.loads(capsys.readouterr().out)
    assert code == 0
    assert document["facts"]["unreadable"] == [
        f"the memory limit (proc/meminfo, the cgroup's memory files) under {root}: ValueError: invalid literal for "
        "int() with base 10: 'garbage'"
    ]
    assert document["facts"]["nvml"]["gpus"]  # the other facts were read
    assert doctor.main(["--root", str(root)], env={}) == 0
    assert "unreadable" in capsys.readouterr().out  # a row of the facts table
