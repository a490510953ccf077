"""resolve_precision: every branch through hand-built Hardware facts and a fake package check, no GPU needed."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _fake_nvml import NVML_ERROR_LIBRARY_NOT_FOUND, FakeGPU, FakeNVML, install
from lightning_utilities.core.rank_zero import rank_zero_only

from lightning_accel import precision as precision_module
from lightning_accel.callbacks.float8 import Float8Training
from lightning_accel.compose import precision_callbacks
from lightning_accel.errors import ConfigError, LightningAccelWarning
from lightning_accel.precision import Hardware, apply_float32_matmul_precision, resolve_precision
from lightning_accel.system import CpuInfo, read_cpu_info

BF16_CPU = CpuInfo(path="/proc/cpuinfo", found=True, architecture="x86_64", flags=frozenset({"avx2", "amx_bf16"}))
OLD_CPU = CpuInfo(path="/proc/cpuinfo", found=True, architecture="x86_64", flags=frozenset({"avx2", "avx512f"}))
H100 = Hardware(cpu=BF16_CPU, cuda_capability=(9, 0), cuda_name="NVIDIA H100 80GB HBM3")
A100 = Hardware(cpu=BF16_CPU, cuda_capability=(8, 0), cuda_name="NVIDIA A100-SXM4-40GB")
T4 = Hardware(cpu=OLD_CPU, cuda_capability=(7, 5), cuda_name="Tesla T4")
CPU_BF16 = Hardware(cpu=BF16_CPU)
CPU_OLD = Hardware(cpu=OLD_CPU)
MAC = Hardware(cpu=CpuInfo(path="/proc/cpuinfo", found=False), mps=True)


def installed(*names: str):
    return lambda name: name in names


@pytest.fixture
def recorded() -> Iterator[list[warnings.WarningMessage]]:
    """Every warning, with no de-duplication, so a test can count them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def _ours(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, LightningAccelWarning)]


@pytest.mark.parametrize(
    ("hardware", "accelerator", "value", "reason"),
    [
        (H100, "auto", "bf16-mixed", "NVIDIA H100 80GB HBM3 with compute capability 9.0 supports bf16"),
        (A100, "gpu", "bf16-mixed", "compute capability 8.0 supports bf16"),
        (T4, "cuda", "16-mixed", "Tesla T4 with compute capability 7.5 has no bf16"),
        (CPU_BF16, "auto", "bf16-mixed", "`amx_bf16`"),
        (H100, "cpu", "bf16-mixed", "`amx_bf16`"),  # a GPU machine running on its CPU follows the CPU rules
        (MAC, "auto", "16-mixed", "MPS"),
    ],
)
def test_amp_picks_per_hardware(recorded, hardware: Hardware, accelerator: str, value: str, reason: str) -> None:
    resolved = resolve_precision("amp", accelerator, hardware=hardware)
    assert (resolved.requested, resolved.value) == ("amp", value)
    assert reason in resolved.reason
    assert not resolved.float8_training and precision_callbacks(resolved) == []
    assert not _ours(recorded)
    assert resolved.describe().startswith(f"precision 'amp' -> '{value}' on {resolved.device}: ")


def test_amp_on_a_cpu_without_bf16_is_fp32_with_one_warning_saying_why(recorded) -> None:
    resolved = resolve_precision("amp", "cpu", hardware=CPU_OLD)
    assert resolved.value == "32-true" and resolved.device == "cpu"
    assert "no native bf16" in resolved.reason
    [message] = _ours(recorded)
    assert recorded[0].filename == __file__  # points at the caller of resolve_precision
    assert "`precision='amp'` resolved to '32-true'" in message
    assert "no `amx_bf16` or `avx512_bf16` in /proc/cpuinfo" in message and "emulated" in message
    assert "`precision='bf16-mixed'`" in message


def test_amp_on_a_cpu_whose_cpuinfo_is_missing_reads_the_fake_root(recorded, tmp_path: Path) -> None:
    resolved = resolve_precision("amp", "cpu", hardware=Hardware(cpu=read_cpu_info(tmp_path)))
    assert resolved.value == "32-true"
    [message] = _ours(recorded)
    assert str(tmp_path) in message and "could not be read" in message


def test_warnings_are_rank_zero_only(recorded, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    assert resolve_precision("amp", "cpu", hardware=CPU_OLD).value == "32-true"
    assert resolve_precision("16-mixed", "cpu", hardware=CPU_OLD).value == "bf16-mixed"
    assert not _ours(recorded)


@pytest.mark.parametrize("requested", ["16-mixed", "16", 16])
def test_fp16_on_cpu_becomes_bf16_with_a_warning_naming_old_and_new(recorded, requested) -> None:
    resolved = resolve_precision(requested, "cpu", hardware=CPU_BF16)
    assert resolved.value == "bf16-mixed"
    [message] = _ours(recorded)
    assert recorded[0].filename == __file__
    assert f"`precision='{requested}'`" in message and "using 'bf16-mixed' instead" in message
    assert "slow" not in message


def test_fp16_on_a_cpu_without_bf16_says_bf16_is_slow(recorded) -> None:
    resolve_precision("16-mixed", "cpu", hardware=CPU_OLD)
    [message] = _ours(recorded)
    assert "bf16 is slow" in message


@pytest.mark.parametrize("requested", ["bf16-mixed", "bf16-true", "bf16"])
def test_bf16_on_a_gpu_without_bf16_names_setting_value_and_fix(requested: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_precision(requested, "auto", hardware=T4)
    message = str(err.value)
    assert f"`precision='{requested}'`" in message
    assert "Tesla T4 with compute capability 7.5" in message
    assert "`precision='16-mixed'`" in message and "`precision='amp'`" in message


@pytest.mark.parametrize(
    ("requested", "hardware", "accelerator", "value"),
    [
        ("bf16-mixed", A100, "auto", "bf16-mixed"),
        ("bf16-true", CPU_OLD, "cpu", "bf16-true"),  # bf16 on a CPU without it: slow, but it runs
        ("16-mixed", T4, "auto", "16-mixed"),
        ("32", CPU_OLD, "cpu", "32-true"),
        ("64-true", CPU_OLD, "cpu", "64-true"),
        ("transformer-engine", H100, "auto", "transformer-engine"),
        ("16-true", MAC, "mps", "16-true"),
    ],
)
def test_concrete_values_pass_through(recorded, requested: str, hardware: Hardware, accelerator: str, value: str):
    resolved = resolve_precision(requested, accelerator, hardware=hardware)
    assert resolved.value == value and resolved.reason == "set explicitly"
    assert not _ours(recorded)


def test_fp8_prefers_transformer_engine() -> None:
    resolved = resolve_precision("fp8", hardware=H100, package_available=installed("transformer_engine", "torchao"))
    assert resolved.value == "transformer-engine" and not resolved.float8_training
    assert "Transformer Engine" in resolved.reason


def test_fp8_through_torchao_adds_the_float8_callback() -> None:
    ada = Hardware(cpu=BF16_CPU, cuda_capability=(8, 9), cuda_name="NVIDIA L4")
    resolved = resolve_precision("fp8", hardware=ada, package_available=installed("torchao"))
    assert resolved.value == "bf16-mixed"
    assert resolved.float8_training
    [callback] = precision_callbacks(resolved)  # the resolution names the callback; the app's composition builds it
    assert isinstance(callback, Float8Training)
    assert "torchao" in resolved.reason and "NVIDIA L4" in resolved.reason


def test_fp8_without_either_package_names_both_and_how_to_install() -> None:
    with pytest.raises(ConfigError) as err:
        resolve_precision("fp8", hardware=H100, package_available=installed())
    message = str(err.value)
    assert "`precision='fp8'`" in message
    assert "`pip install transformer-engine[pytorch]`" in message and "`pip install torchao`" in message


@pytest.mark.parametrize(
    ("hardware", "accelerator", "found"),
    [
        (A100, "auto", "NVIDIA A100-SXM4-40GB with compute capability 8.0"),
        (CPU_BF16, "auto", "no CUDA device (the run uses `cpu`)"),
        (H100, "cpu", "no CUDA device (the run uses `cpu`)"),
        (MAC, "auto", "no CUDA device (the run uses `mps`)"),
    ],
)
def test_fp8_needs_compute_capability_8_9(hardware: Hardware, accelerator: str, found: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_precision("fp8", accelerator, hardware=hardware, package_available=installed("torchao"))
    message = str(err.value)
    assert "`precision='fp8'` needs a CUDA GPU with compute capability 8.9 or newer" in message
    assert f"found {found}." in message and "`precision='amp'`" in message


def test_fp8_on_cpu_also_says_that_no_fp8_package_is_installed() -> None:
    with pytest.raises(ConfigError, match="neither is installed"):
        resolve_precision("fp8", "cpu", hardware=CPU_BF16, package_available=installed())


def test_amp_on_tpu_asks_for_a_concrete_precision() -> None:
    with pytest.raises(ConfigError, match=r"not `tpu`; use `precision='bf16-true'`"):
        resolve_precision("amp", "tpu", hardware=CPU_BF16)


def test_cuda_accelerator_without_a_cuda_device() -> None:
    with pytest.raises(ConfigError, match=r"`accelerator='cuda'` asks for a CUDA GPU but none is visible"):
        resolve_precision("32-true", "cuda", hardware=CPU_BF16)


def test_unknown_value_lists_the_options() -> None:
    with pytest.raises(ConfigError) as err:
        resolve_precision("fp4", "cpu", hardware=CPU_BF16, setting="precision")
    assert "`precision='fp4'` is not a precision" in str(err.value) and "`amp`" in str(err.value)


def test_matmul_precision_is_applied_and_none_leaves_it_alone() -> None:
    before = torch.get_float32_matmul_precision()
    try:
        assert apply_float32_matmul_precision(None) is None
        assert torch.get_float32_matmul_precision() == before
        assert apply_float32_matmul_precision("medium") == before
        assert torch.get_float32_matmul_precision() == "medium"
        assert apply_float32_matmul_precision("highest") == "medium"
        with pytest.raises(ConfigError, match=r"`float32_matmul_precision='tf32'` is not supported.*`high`"):
            apply_float32_matmul_precision("tf32")
    finally:
        torch.set_float32_matmul_precision(before)


def test_probe_without_cuda_reads_the_cpu_root(tmp_path: Path) -> None:
    hardware = Hardware.probe(root=str(tmp_path), cuda=False)
    assert hardware.cuda_capability is None and hardware.describe_cuda() == "no CUDA device"
    assert hardware.cpu.path == str(tmp_path / "proc" / "cpuinfo") and not hardware.cpu.found


def test_probe_reads_capability_through_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install(
        monkeypatch, FakeNVML([FakeGPU("GPU-a", name="NVIDIA H200", compute_capability=(9, 0))], binding="12")
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert precision_module._probe_cuda() == ((9, 0), "NVIDIA H200")
    assert fake.inits == fake.shutdowns == 1


def test_probe_falls_back_to_torch_when_nvml_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeNVML([], init_error=NVML_ERROR_LIBRARY_NOT_FOUND))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Tesla V100")
    assert precision_module._probe_cuda() == ((7, 0), "Tesla V100")


def test_probe_with_a_mig_uuid_reads_nvml_and_never_initialises_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    mig = FakeGPU("MIG-1234abcd-0000", gpu_instance_id=7, mig_profile="1g.10gb")
    fake = install(monkeypatch, FakeNVML([FakeGPU("GPU-a", compute_capability=(9, 0), mig=[mig])]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1234abcd-0000")

    def initialises_cuda(*args: object) -> None:
        raise AssertionError("CUDA initialised: a fork-based launch would fail after this")

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "_get_pynvml_handler", initialises_cuda)  # torch's NVML path: -1 for MIG UUIDs
    monkeypatch.setattr(torch.cuda, "get_device_capability", initialises_cuda)
    monkeypatch.setattr(torch.cuda, "get_device_name", initialises_cuda)
    assert precision_module._probe_cuda() == ((9, 0), "NVIDIA H100 80GB HBM3 MIG 1g.10gb")
    assert fake.inits == fake.shutdowns == 1  # NVML shut down again


def test_probe_without_cuda_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert precision_module._probe_cuda() == (None, "")


def test_default_package_check() -> None:
    assert precision_module._package_available("json")
    assert not precision_module._package_available("lightning_accel_no_such_package")
    assert not precision_module._package_available("lightning_accel_no_such_package.sub")


@pytest.mark.slow
def test_cli_fp8_without_a_capable_gpu_exits_2_before_anything_is_built(run_cli, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli(["precision=fp8", "trainer.accelerator=cpu", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "accel-train: error: `trainer.precision='fp8'` needs a CUDA GPU with compute capability 8.9" in result.stderr
    assert "`precision='amp'`" in result.stderr and "Traceback" not in result.stderr
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "csv").exists()


@pytest.mark.slow
def test_cli_logs_the_resolved_precision_and_its_reason(run_cli, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["precision=amp", "trainer.accelerator=cpu", "fit=false", "test=false", f"hydra.run.dir={run_dir}"]
    result = run_cli(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = "bf16-mixed" if read_cpu_info().has_native_bf16 else "32-true"
    log = result.stdout + result.stderr + (run_dir / "train.log").read_text()
    assert f"precision 'amp' -> '{expected}' on cpu: " in log
    assert "float32_matmul_precision=high" in log
