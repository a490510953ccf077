"""Each check on facts built by hand, then end to end: fake /proc, /sys and NVML through collect_facts to verdicts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _fake_nvml import FakeGPU, FakeNVML, install

from lightning_accel.system import (
    CHECKS,
    CheckRequest,
    CpuBudget,
    CpuInfo,
    IbPort,
    NvmlFacts,
    PackageVersion,
    ShmInfo,
    SystemFacts,
    TorchBuild,
    collect_facts,
    facts_to_dict,
    run_checks,
    suggested_num_workers,
)
from lightning_accel.system.cgroup import MemoryLimit
from lightning_accel.system.gpu import GpuInfo, GpuLink, VisibleDevice

MIB, GIB = 2**20, 2**30


def gpus(*capabilities: tuple[int, int], mig: bool = False, nvlink: bool = False) -> NvmlFacts:
    """NVML facts of GPUs with these compute capabilities, all visible, on a driver for CUDA 12.4."""
    infos = tuple(
        GpuInfo(index=i, name=f"GPU{i}", uuid=f"GPU-{i}", capability=c, nvlinks=18 if nvlink else None)
        for i, c in enumerate(capabilities)
    )
    visible = tuple(VisibleDevice(uuid=f"{'MIG' if mig else 'GPU'}-{i}", gpu=i, mig=mig) for i in range(len(infos)))
    links = tuple(
        GpuLink(a=a, b=b, kind="NV" if nvlink else "PHB") for a in range(len(infos)) for b in range(a + 1, len(infos))
    )
    return NvmlFacts(
        available=True,
        driver_version="550.54.15",
        cuda_driver_version=(12, 4),
        gpus=infos,
        visible=visible,
        topology=links,
    )


NO_NVML = NvmlFacts(available=False, why="NVML is not available (NVMLError_LibraryNotFound)")
CUDA = TorchBuild(version="2.7.0", cuda="12.4", nccl=(2, 21, 5))


def check(name: str, request: CheckRequest | None = None, **facts: object):
    return run_checks(SystemFacts(**facts), request, [name])[0]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("driver", "runtime", "status", "words"),
    [
        ((12, 4), "12.4", "PASS", "supports CUDA 12.4"),
        ((12, 8), "12.1", "PASS", "runtime is CUDA 12.1"),
        ((12, 2), "12.8", "WARN", "minor-version compatibility"),
        ((11, 8), "12.1", "FAIL", "CUDA driver version is insufficient"),
    ],
)
def test_driver_against_cuda_runtime(driver: tuple[int, int], runtime: str, status: str, words: str) -> None:
    nvml = NvmlFacts(available=True, driver_version="520.61", cuda_driver_version=driver, gpus=gpus((9, 0)).gpus)
    result = check("driver_cuda", nvml=nvml, torch=TorchBuild(version="2.7.0", cuda=runtime))
    assert result.status == status and words in result.detail
    if status == "FAIL":
        assert f"CUDA >= {runtime}" in result.fix and "CUDA <= 11.8" in result.fix
    assert bool(result.fix) == (status in ("WARN", "FAIL"))


def test_driver_check_skips_without_a_gpu_or_a_cuda_build() -> None:
    assert check("driver_cuda", nvml=NO_NVML, torch=CUDA).status == "SKIP"
    assert check("driver_cuda", nvml=NO_NVML, torch=TorchBuild(version="2.7.0+cpu")).status == "SKIP"
    assert check("driver_cuda", CheckRequest(gpus=0), nvml=gpus((9, 0)), torch=CUDA).status == "SKIP"
    cpu_torch_on_gpu = check("driver_cuda", nvml=gpus((9, 0)), torch=TorchBuild(version="2.7.0+cpu"))
    assert cpu_torch_on_gpu.status == "WARN" and "CPU-only" in cpu_torch_on_gpu.detail


@pytest.mark.parametrize(
    ("nvml", "wanted", "torch_build", "status"),
    [
        (NO_NVML, None, CUDA, "SKIP"),
        (NO_NVML, 2, CUDA, "FAIL"),
        (gpus((9, 0), (9, 0)), None, CUDA, "PASS"),
        (gpus((9, 0), (9, 0)), 2, CUDA, "PASS"),
        (gpus((9, 0)), 4, CUDA, "FAIL"),
        (gpus((9, 0)), 0, CUDA, "SKIP"),
        (gpus((9, 0)), 1, TorchBuild(version="2.7.0+cpu"), "FAIL"),
    ],
)
def test_gpus_visible_against_requested(
    nvml: NvmlFacts, wanted: int | None, torch_build: TorchBuild, status: str
) -> None:
    result = check("gpus", CheckRequest(gpus=wanted), nvml=nvml, torch=torch_build)
    assert result.status == status
    if wanted == 4:
        assert "4 GPU(s) requested" in result.detail and "devices=1" in result.fix


def test_bf16() -> None:
    assert check("bf16", nvml=gpus((8, 0), (9, 0))).status == "PASS"
    v100 = check("bf16", nvml=gpus((9, 0), (7, 0)))
    assert v100.status == "WARN" and "GPU 1 GPU1 (7.0)" in v100.detail and "precision=amp" in v100.fix
    assert check("bf16", CheckRequest(gpus=1), nvml=gpus((9, 0), (7, 0))).status == "PASS"  # only GPU 0 is used
    amx = CpuInfo(path="/proc/cpuinfo", found=True, architecture="x86_64", flags=frozenset({"amx_bf16"}))
    assert check("bf16", nvml=NO_NVML, cpu=amx).status == "PASS"
    assert check("bf16", nvml=NO_NVML).status == "SKIP"


def test_nccl() -> None:
    assert check("nccl", nvml=gpus((9, 0)), torch=CUDA).status == "SKIP"  # one GPU
    passed = check("nccl", nvml=gpus((9, 0), (9, 0), nvlink=True), torch=CUDA, nccl_env={"NCCL_DEBUG": "WARN"})
    assert passed.status == "PASS" and "NCCL 2.21.5" in passed.detail and "NVLink between GPUs 0-1" in passed.detail
    no_nccl = check("nccl", nvml=gpus((9, 0), (9, 0)), torch=TorchBuild(version="2.7.0", cuda="12.4"))
    assert no_nccl.status == "FAIL" and "gloo" in no_nccl.fix
    mig = check("nccl", nvml=gpus((8, 0), (8, 0), mig=True), torch=CUDA)
    assert mig.status == "FAIL" and "MIG" in mig.detail
    p2p_off = check("nccl", nvml=gpus((9, 0), (9, 0), nvlink=True), torch=CUDA, nccl_env={"NCCL_P2P_DISABLE": "1"})
    assert p2p_off.status == "WARN" and p2p_off.fix == "unset NCCL_P2P_DISABLE"
    multi_node = check("nccl", CheckRequest(gpus=1, num_nodes=2), nvml=gpus((9, 0)), torch=CUDA)
    assert multi_node.status == "PASS"


ACTIVE = IbPort(device="mlx5_0", port=1, state="ACTIVE", link_layer="InfiniBand", rate="200 Gb/sec")
DOWN = IbPort(device="mlx5_0", port=1, state="DOWN", link_layer="InfiniBand")


@pytest.mark.parametrize(
    ("ports", "env", "nodes", "status", "words"),
    [
        ((), {}, 1, "SKIP", "no InfiniBand"),
        ((), {"NCCL_NET": "IB"}, 1, "FAIL", "NCCL_NET=IB"),
        ((), {"NCCL_IB_HCA": "mlx5"}, 1, "WARN", "falls back to TCP"),
        ((), {}, 2, "WARN", "2 nodes"),
        ((DOWN,), {}, 1, "WARN", "no ACTIVE port"),
        ((ACTIVE,), {"NCCL_IB_DISABLE": "1"}, 2, "WARN", "NCCL_IB_DISABLE=1"),
        ((ACTIVE,), {"NCCL_IB_HCA": "mlx5_3"}, 2, "WARN", "names no ACTIVE device"),
        ((ACTIVE,), {"NCCL_IB_HCA": "=mlx5_0:1"}, 2, "PASS", "mlx5_0:1 ACTIVE InfiniBand 200 Gb/sec"),
        ((ACTIVE,), {}, 2, "PASS", "ACTIVE"),
    ],
)
def test_infiniband(ports: tuple[IbPort, ...], env: dict[str, str], nodes: int, status: str, words: str) -> None:
    result = check("infiniband", CheckRequest(num_nodes=nodes), nvml=gpus((9, 0)), infiniband=ports, nccl_env=env)
    assert result.status == status and words in result.detail


def test_infiniband_is_skipped_on_a_cpu_run() -> None:
    result = check("infiniband", CheckRequest(gpus=0), infiniband=(DOWN,), nccl_env={"NCCL_NET": "IB"})
    assert result.status == "SKIP" and "1 InfiniBand/RoCE port(s)" in result.detail


def test_cpus_against_the_cgroup_quota() -> None:
    assert suggested_num_workers(2, 1) == 1 and suggested_num_workers(16, 2) == 7 and suggested_num_workers(1, 4) == 1
    throttled = check("cpus", CheckRequest(gpus=0), cpus=CpuBudget(affinity=64, quota=4.0, quota_source="cpu.max"))
    assert throttled.status == "WARN" and "effective 4 CPU(s): affinity 64, cgroup quota 4 CPUs" in throttled.detail
    assert "num_workers=3" in throttled.fix and "OMP_NUM_THREADS=4" in throttled.fix
    per_gpu = check("cpus", CheckRequest(gpus=4), cpus=CpuBudget(affinity=64, quota=16.0))
    assert "4 process(es) -> num_workers <= 3 each" in per_gpu.detail
    assert check("cpus", cpus=CpuBudget(affinity=8)).status == "PASS"
    too_many = check("cpus", CheckRequest(num_workers=8), cpus=CpuBudget(affinity=8))
    assert too_many.status == "WARN" and too_many.fix == "use num_workers=7"
    env = check("cpus", cpus=CpuBudget(affinity=8, env_count=2))
    assert env.status == "PASS" and "effective 2" in env.detail and "PYTHON_CPU_COUNT=2" in env.detail


def test_threads_against_the_budget_the_neighbours_and_the_wait_policy() -> None:
    from lightning_accel.system import CpuTopology

    two = {"cpus": CpuBudget(affinity=2), "topology": CpuTopology(cpus=(0, 1))}
    default = check("threads", CheckRequest(gpus=0, processes=2), **two)  # torch's default: every CPU per process
    assert default.status == "WARN" and default.detail.startswith("oversubscribed, with spinning OpenMP threads")
    assert "2 process(es) x (2 intra-op thread(s) + 0 worker(s)) = 4 busy on 2 CPU(s)" in default.detail
    assert "OMP_WAIT_POLICY=unset" in default.detail and "OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE" in default.fix
    shared = check("threads", CheckRequest(gpus=0), others_cpus=1.1, others_window_s=0.5, **two)
    assert shared.status == "WARN" and "shared with other processes" in shared.detail
    assert "others used 1.10 CPU(s) of ours over 0.5 s" in shared.detail
    passive = {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "passive"}
    planned = check("threads", CheckRequest(gpus=0), others_cpus=1.1, others_window_s=0.5, thread_env=passive, **two)
    assert planned.status == "PASS" and "OMP_WAIT_POLICY=PASSIVE" in planned.detail
    quota = check("threads", CheckRequest(gpus=0, intra_op_threads=2), cpus=CpuBudget(affinity=8, quota=1.5))
    assert quota.status == "WARN" and "on 1.5 CPU(s) (cgroup quota 1.5 CPUs" in quota.detail
    one = check("threads", CheckRequest(gpus=0, intra_op_threads=1), cpus=CpuBudget(affinity=1))
    assert one.status == "PASS" and "others' CPU use not measured" in one.detail


def test_memory_limit() -> None:
    assert check("memory", memory=MemoryLimit(host_total_bytes=64 * GIB)).status == "PASS"
    tight = check("memory", CheckRequest(gpus=0, num_workers=3), memory=MemoryLimit(limit_bytes=4 * GIB, source="m"))
    assert tight.status == "WARN" and "1 process(es) x (1 + 3 workers) x 2.0 GiB = 8.0 GiB" in tight.detail
    assert check("memory", CheckRequest(num_workers=1), memory=MemoryLimit(limit_bytes=8 * GIB)).status == "PASS"


@pytest.mark.parametrize(
    ("size_mib", "workers", "processes", "status"),
    [
        (64, 2, 1, "FAIL"),
        (64, None, 1, "WARN"),
        (64, 0, 1, "PASS"),
        (512, 4, 2, "WARN"),
        (8192, 4, 2, "PASS"),
    ],
)
def test_shm(size_mib: int, workers: int | None, processes: int, status: str) -> None:
    shm = ShmInfo(path="/dev/shm", size_bytes=size_mib * MIB, free_bytes=size_mib * MIB)
    request = CheckRequest(gpus=0, processes=processes, num_workers=workers)
    result = check("shm", request, shm=shm, cpus=CpuBudget(affinity=8))
    assert result.status == status
    if status in ("WARN", "FAIL"):
        assert "--shm-size" in result.fix
    if workers is None:
        assert "(assumed)" in result.detail
    assert check("shm", request).status == "SKIP"  # no /dev/shm at all


def test_packages() -> None:
    good = (
        PackageVersion(name="torch", required=">=2.4", installed="2.13.0+cpu"),
        PackageVersion(name="hydra-core", required="<1.5,>=1.3.2", installed="1.3.8"),
    )
    assert check("packages", packages=good).status == "PASS"
    bad = (
        *good,
        PackageVersion(name="lightning", required=">=2.4", installed="2.1.0"),
        PackageVersion(name="rich", required=">=13", installed=None),
    )
    result = check("packages", packages=bad)
    assert result.status == "FAIL" and "lightning 2.1.0 (needs >=2.4)" in result.detail
    assert "rich missing (needs >=13)" in result.detail
    assert result.fix == "pip install -U 'lightning>=2.4' 'rich>=13'"
    assert check("packages").status == "SKIP"
    odd = (PackageVersion(name="rich", required=">=13", installed="not a version"),)
    assert check("packages", packages=odd).status == "FAIL"


def test_run_checks_names() -> None:
    assert [c.name for c in run_checks(SystemFacts())] == list(CHECKS)
    with pytest.raises(ValueError, match=r"Unknown check\(s\) \['gpu'\]"):
        run_checks(SystemFacts(), names=["gpu"])


def test_end_to_end_from_fake_trees_and_fake_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = {
        "proc/self/cgroup": "0::/\n",
        "proc/self/mountinfo": "1 0 0:1 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
        "sys/fs/cgroup/cpu.max": "200000 100000\n",
        "sys/fs/cgroup/memory.max": "17179869184\n",
        "sys/class/infiniband/mlx5_0/ports/1/state": "1: DOWN\n",
        "proc/cpuinfo": "processor\t: 0\nflags\t\t: fpu avx512f\n\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "dev/shm").mkdir(parents=True)
    install(monkeypatch, FakeNVML([FakeGPU("GPU-a"), FakeGPU("GPU-b")], cuda_driver_version=11080))
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    statvfs = lambda path: SimpleNamespace(f_frsize=4096, f_bsize=4096, f_blocks=16384, f_bavail=16384)  # noqa: E731
    facts = collect_facts(tmp_path, {"NCCL_DEBUG": "INFO"}, affinity=range(32), statvfs=statvfs)
    verdicts = {c.name: c.status for c in run_checks(facts, CheckRequest(num_workers=4))}
    assert verdicts == {
        "packages": "PASS",
        "driver_cuda": "FAIL",
        "gpus": "PASS",
        "bf16": "PASS",
        "nccl": "PASS",
        "infiniband": "WARN",
        "cpus": "WARN",
        "threads": "WARN",  # 2 processes x (32 threads, torch's default + 4 workers) on a quota of 2 CPUs
        "memory": "WARN",
        "shm": "FAIL",
    }
    plain = facts_to_dict(facts)
    assert plain["cpus"]["effective"] == 2 and plain["shm"]["size_bytes"] == 64 * MIB
    assert plain["nvml"]["cuda_driver_version"] == [11, 8] and "flags" not in plain["cpu"]


def test_gpus_check_fails_only_for_gpus_the_run_asked_for() -> None:
    infos = (
        GpuInfo(index=0, name="GPU0", uuid="GPU-0", capability=(9, 0)),
        GpuInfo(index=1, name="", uuid="", why="NVMLError_NoPermission: Insufficient Permissions"),
    )
    nvml = NvmlFacts(
        available=True,
        driver_version="550.54.15",
        cuda_driver_version=(12, 4),
        gpus=infos,
        visible=(VisibleDevice(uuid="GPU-0", gpu=0),),
    )
    one = check("gpus", CheckRequest(gpus=1), nvml=nvml, torch=CUDA)
    assert one.status == "PASS" and "NVML GPU 1 not accessible" in one.detail
    assert "Insufficient Permissions" in one.detail
    two = check("gpus", CheckRequest(gpus=2), nvml=nvml, torch=CUDA)
    assert two.status == "FAIL" and "2 GPU(s) requested" in two.detail
    assert "NVML GPU 1 not accessible" in two.detail
    assert check("bf16", CheckRequest(gpus=1), nvml=nvml, torch=CUDA).status == "PASS"
