"""/dev/shm, InfiniBand ports, NCCL variables, torch's build and NVML facts (through the scripted fake NVML)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _fake_nvml import NVML_ERROR_LIBRARY_NOT_FOUND, FakeGPU, FakeNVML, install

from lightning_accel.system import (
    GpuLink,
    IbPort,
    TorchBuild,
    VisibleDevice,
    read_infiniband,
    read_nccl_env,
    read_nvml,
    read_packages,
    read_shm,
    read_torch_build,
)


def statvfs_of(size_mib: int, free_mib: int | None = None):
    """A stand-in for os.statvfs reporting a file system of `size_mib` MiB."""
    free = size_mib if free_mib is None else free_mib
    return lambda path: SimpleNamespace(f_frsize=4096, f_bsize=4096, f_blocks=size_mib * 256, f_bavail=free * 256)


def test_shm(tmp_path: Path) -> None:
    (tmp_path / "dev" / "shm").mkdir(parents=True)
    shm = read_shm(tmp_path, statvfs_of(64, 60))
    assert shm is not None and (shm.size_bytes, shm.free_bytes) == (64 * 2**20, 60 * 2**20)
    assert shm.path == str(tmp_path / "dev" / "shm")
    assert read_shm(tmp_path / "nowhere") is None
    assert read_shm(tmp_path).size_bytes > 0  # the real statvfs of the folder


def test_infiniband_ports(tmp_path: Path) -> None:
    for device, port, state, layer in [
        ("mlx5_0", 1, "4: ACTIVE", "InfiniBand"),
        ("mlx5_1", 1, "1: DOWN", "Ethernet"),
        ("mlx5_1", 2, "4: ACTIVE", "Ethernet"),
    ]:
        base = tmp_path / "sys/class/infiniband" / device / "ports" / str(port)
        base.mkdir(parents=True)
        (base / "state").write_text(state + "\n")
        (base / "link_layer").write_text(layer + "\n")
        (base / "rate").write_text("200 Gb/sec (4X HDR)\n")
    ports = read_infiniband(tmp_path)
    assert ports[0] == IbPort(
        device="mlx5_0", port=1, state="ACTIVE", link_layer="InfiniBand", rate="200 Gb/sec (4X HDR)"
    )
    assert [(p.device, p.port, p.active, p.link_layer) for p in ports[1:]] == [
        ("mlx5_1", 1, False, "Ethernet"),
        ("mlx5_1", 2, True, "Ethernet"),
    ]
    assert read_infiniband(tmp_path / "none") == ()


def test_nccl_env() -> None:
    env = {"NCCL_IB_HCA": "mlx5_0", "PATH": "/bin", "NCCL_DEBUG": "INFO", "TORCH_NCCL_X": "1"}
    assert read_nccl_env(env) == {"NCCL_DEBUG": "INFO", "NCCL_IB_HCA": "mlx5_0"}


def test_torch_build_without_cuda_context(monkeypatch: pytest.MonkeyPatch) -> None:
    build = read_torch_build()
    assert build.version == torch.__version__ and build.cuda == torch.version.cuda
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 26, 2))
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
    build = read_torch_build()
    assert (build.cuda, build.nccl, build.cudnn_text) == ("12.8", (2, 26, 2), "9.1.0")
    assert TorchBuild(cudnn=8902).cudnn_text == "8.9.2" and TorchBuild().cudnn_text == "none"


def test_packages_against_our_requirements() -> None:
    packages = {p.name: p for p in read_packages()}
    assert packages["torch"].installed == importlib.metadata.version("torch")
    lightning = packages["lightning"].required.split(",")
    assert any(s.startswith(">=") for s in lightning) and any(s.startswith("<") for s in lightning)  # a range
    assert "pytest" not in packages  # extras left out
    assert read_packages("no-such-distribution-here") == ()


def test_nvml_facts(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [
        FakeGPU("GPU-a", nvlinks=18),
        FakeGPU("GPU-b", nvlinks=18),
        FakeGPU("GPU-c", name="Tesla V100-SXM2-16GB", compute_capability=(7, 0), memory_total_mib=16_384),
    ]
    install(monkeypatch, FakeNVML(gpus, cuda_driver_version=12040, topology_level=40))
    facts = read_nvml({"CUDA_VISIBLE_DEVICES": "2,0"})
    assert facts.available and facts.driver_version == "550.54.15" and facts.cuda_driver_version == (12, 4)
    assert [(g.index, g.capability, g.nvlinks) for g in facts.gpus] == [
        (0, (9, 0), 18),
        (1, (9, 0), 18),
        (2, (7, 0), None),
    ]
    assert facts.gpus[2].memory_total_bytes == 16_384 * 2**20
    assert facts.visible == (VisibleDevice(uuid="GPU-c", gpu=2), VisibleDevice(uuid="GPU-a", gpu=0))
    assert [g.name for g in facts.visible_gpus()] == ["Tesla V100-SXM2-16GB", "NVIDIA H100 80GB HBM3"]
    assert facts.topology == (
        GpuLink(a=0, b=1, kind="NV"),
        GpuLink(a=0, b=2, kind="NODE"),
        GpuLink(a=1, b=2, kind="NODE"),
    )


def test_nvml_mig_and_a_driver_that_does_not_say(monkeypatch: pytest.MonkeyPatch) -> None:
    mig = [FakeGPU("MIG-1", gpu_instance_id=1), FakeGPU("MIG-2", gpu_instance_id=2)]
    fake = install(
        monkeypatch, FakeNVML([FakeGPU("GPU-a", mig=mig, compute_capability=(8, 0))], cuda_driver_version=None)
    )
    facts = read_nvml({})
    assert facts.cuda_driver_version is None and facts.gpus[0].mig_enabled and facts.gpus[0].mig_devices == 2
    assert [(d.uuid, d.gpu, d.mig) for d in facts.visible] == [("MIG-1", 0, True), ("MIG-2", 0, True)]
    assert fake.inits == fake.shutdowns == 1


@pytest.mark.parametrize("problem", ["init", "lost"])
def test_nvml_trouble_is_a_fact_not_a_crash(monkeypatch: pytest.MonkeyPatch, problem: str) -> None:
    if problem == "init":
        install(monkeypatch, FakeNVML([], init_error=NVML_ERROR_LIBRARY_NOT_FOUND))
    else:
        install(monkeypatch, FakeNVML([FakeGPU("GPU-a")], fail_at=0.0))
    facts = read_nvml({})
    assert not facts.available and facts.gpus == ()
    assert ("NVML Shared Library Not Found" if problem == "init" else "GPU is lost") in facts.why


def test_reading_facts_creates_no_cuda_context() -> None:
    from lightning_accel.system import collect_facts

    collect_facts()
    assert not torch.cuda.is_initialized()  # fork-based launchers (ddp_spawn, DataLoader workers) still work


@pytest.mark.gpu
def test_real_nvml_on_a_gpu_machine() -> None:
    facts = read_nvml()
    assert facts.available, facts.why
    assert facts.driver_version and facts.cuda_driver_version is not None and facts.cuda_driver_version >= (11, 0)
    assert facts.gpus and all(gpu.capability is not None for gpu in facts.gpus) and facts.visible
    assert len(facts.topology) == len(facts.gpus) * (len(facts.gpus) - 1) // 2
    assert not torch.cuda.is_initialized()


def test_nvml_facts_list_a_gpu_this_process_may_not_open_as_inaccessible(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeNVML([FakeGPU("GPU-a"), FakeGPU("GPU-b"), FakeGPU("GPU-c")], denied={1}))
    facts = read_nvml({})
    assert facts.available, facts.why
    assert [(g.index, g.uuid, g.accessible) for g in facts.gpus] == [
        (0, "GPU-a", True),
        (1, "", False),
        (2, "GPU-c", True),
    ]
    assert "Insufficient Permissions" in facts.gpus[1].why and "NoPermission" in facts.gpus[1].why
    assert [d.uuid for d in facts.visible] == ["GPU-a", "GPU-c"]
    assert facts.topology == (GpuLink(a=0, b=2, kind="PHB"),)


def test_nvml_counts_nvlinks_up_to_nvmls_maximum(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeNVML([FakeGPU("GPU-a", nvlinks=24)]))  # NVML_NVLINK_MAX_LINKS is 36
    assert read_nvml({}).gpus[0].nvlinks == 24


def test_nccl_version_with_a_build_suffix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3, "+cuda12.9"))
    assert read_torch_build().nccl == (2, 27, 3)
