"""The fake NVML against the installed nvidia-ml-py: same functions, same parameters, same constants, same types."""

from __future__ import annotations

import ctypes
import inspect
import re
from pathlib import Path

import pynvml
import pytest
from _fake_nvml import FakeGPU, FakeNVML

import lightning_accel
from lightning_accel.system import gpu as system_gpu
from lightning_accel.telemetry import readings

PACKAGE = Path(lightning_accel.__file__).parent
FAKE_FUNCTIONS = sorted(n for n, v in vars(FakeNVML).items() if n.startswith("nvml") and callable(v))


def _called_by_the_package() -> set[str]:
    """Every `pynvml.nvmlX` the package's source calls."""
    found = {m for path in PACKAGE.rglob("*.py") for m in re.findall(r"pynvml\.(nvml\w+)", path.read_text())}
    return found - {"nvmlX"}  # `pynvml.nvmlX(...)` in comments


def _parameters(function: object) -> list[tuple[str, object]]:
    return [
        (p.name, p.default)
        for p in inspect.signature(function).parameters.values()  # type: ignore[arg-type]
        if p.name != "self"
    ]


def test_every_function_the_package_calls_is_in_nvidia_ml_py_and_in_the_fake() -> None:
    called = _called_by_the_package()
    assert called, "no pynvml calls found: the scan is broken"
    assert sorted(called - set(dir(pynvml))) == []
    assert sorted(called - set(FAKE_FUNCTIONS)) == []


@pytest.mark.parametrize("name", FAKE_FUNCTIONS)
def test_the_fake_has_only_real_functions_with_the_real_parameters(name: str) -> None:
    assert hasattr(pynvml, name), f"the fake has {name}, nvidia-ml-py does not"
    assert _parameters(getattr(FakeNVML, name)) == _parameters(getattr(pynvml, name))


def test_constants_match() -> None:
    fake = FakeNVML([])
    for name in [n for n in dir(fake) if n.startswith("NVML_")]:
        assert getattr(fake, name) == getattr(pynvml, name), name
    assert (readings._TEMPERATURE_GPU, readings._CLOCK_SM, readings._CLOCK_MEM) == (
        pynvml.NVML_TEMPERATURE_GPU,
        pynvml.NVML_CLOCK_SM,
        pynvml.NVML_CLOCK_MEM,
    )
    assert (readings._PCIE_TX, readings._PCIE_RX) == (pynvml.NVML_PCIE_UTIL_TX_BYTES, pynvml.NVML_PCIE_UTIL_RX_BYTES)
    reasons = (
        pynvml.nvmlClocksEventReasonSwPowerCap,
        pynvml.nvmlClocksEventReasonHwSlowdown,
        pynvml.nvmlClocksEventReasonSwThermalSlowdown,
        pynvml.nvmlClocksEventReasonHwThermalSlowdown,
        pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
    )
    assert (
        readings._SW_POWER_CAP,
        readings._HW_SLOWDOWN,
        readings._SW_THERMAL,
        readings._HW_THERMAL,
        readings._HW_POWER_BRAKE,
    ) == reasons
    assert readings._ARCH_HOPPER == pynvml.NVML_DEVICE_ARCH_HOPPER and readings._MEMORY_V2 == pynvml.nvmlMemory_v2
    assert readings._FUNCTION_NOT_FOUND == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    assert [metric_id for metric_id, _ in readings._GPM] == [
        pynvml.NVML_GPM_METRIC_SM_UTIL,
        pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
        pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
        pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
    ]
    assert system_gpu._MAX_NVLINKS == pynvml.NVML_NVLINK_MAX_LINKS
    assert (system_gpu._P2P_CAPS_INDEX_NVLINK, system_gpu._P2P_STATUS_OK) == (
        pynvml.NVML_P2P_CAPS_INDEX_NVLINK,
        pynvml.NVML_P2P_STATUS_OK,
    )


@pytest.mark.parametrize(
    "code",
    [
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_GPU_IS_LOST,
    ],
)
def test_errors_are_the_real_subclasses(code: int) -> None:
    fake = FakeNVML([FakeGPU("GPU-a", errors={"nvmlDeviceGetPowerUsage": code})])
    with pytest.raises(pynvml.nvmlExceptionClass(code)) as raised:
        fake.nvmlDeviceGetPowerUsage(fake.gpus[0])
    assert type(raised.value) is pynvml.nvmlExceptionClass(code) and raised.value.value == code


def test_missing_symbols_and_denied_devices_fail_as_the_real_module_does() -> None:
    fake = FakeNVML([FakeGPU("GPU-a"), FakeGPU("GPU-b")], missing={"nvmlDeviceGetTemperatureV"}, denied={1})
    assert fake.nvmlDeviceGetCount() == 2  # nvml.h: the count includes devices this process may not open
    with pytest.raises(pynvml.NVMLError_NoPermission):
        fake.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        fake.nvmlDeviceGetTemperatureV(fake.gpus[0], pynvml.NVML_TEMPERATURE_GPU)


@pytest.mark.parametrize(("binding", "text", "gpm_slots"), [("13", str, pynvml.NVML_GPM_METRIC_MAX), ("12", bytes, 98)])
def test_return_types_and_struct_sizes(binding: str, text: type, gpm_slots: int) -> None:
    fake = FakeNVML([FakeGPU("GPU-a", mig=[FakeGPU("MIG-a", gpu_instance_id=1)])], binding=binding)
    gpu = fake.nvmlDeviceGetHandleByIndex(0)
    assert type(fake.nvmlDeviceGetName(gpu)) is text and type(fake.nvmlDeviceGetUUID(gpu)) is text
    assert type(fake.nvmlSystemGetDriverVersion()) is text
    assert type(fake.nvmlDeviceGetMemoryInfo(gpu)) is pynvml.c_nvmlMemory_t
    assert type(fake.nvmlDeviceGetMemoryInfo(gpu, pynvml.nvmlMemory_v2)) is pynvml.c_nvmlMemory_v2_t
    assert type(fake.nvmlDeviceGetUtilizationRates(gpu)) is pynvml.c_nvmlUtilization_t
    assert type(fake.nvmlGpmQueryDeviceSupport(gpu)) is pynvml.c_nvmlGpmSupport_t
    assert type(fake.nvmlGpmSampleAlloc()) is pynvml.c_nvmlGpmSample_t
    assert type(fake.nvmlDeviceGetAttributes(fake.gpus[0].mig[0])) is pynvml.c_nvmlDeviceAttributes
    request = fake.c_nvmlGpmMetricsGet_t()
    assert len(request.metrics) == gpm_slots and [f[0] for f in request._fields_] == [
        f[0] for f in pynvml.c_nvmlGpmMetricsGet_t._fields_
    ]
    if binding == "13":
        assert ctypes.sizeof(request) == ctypes.sizeof(pynvml.c_nvmlGpmMetricsGet_t)
    assert isinstance(fake.nvmlDeviceGetCudaComputeCapability(gpu), tuple)
    assert isinstance(fake.nvmlDeviceGetMigMode(gpu), list)
