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
from lightning_accel.telemetry import health, readings

PACKAGE = Path(lightning_accel.__file__).parent
FAKE_FUNCTIONS = sorted(n for n, v in vars(FakeNVML).items() if n.startswith("nvml") and callable(v))


def _called_by_the_package() -> set[str]:
    """Every `pynvml.nvmlX` the package's source calls, and every NVML function it names in quotes (telemetry/health.py
    calls them by name: `getattr(nvml.pynvml, "nvmlDeviceGetRemappedRows")`)."""
    pattern = r"pynvml\.(nvml\w+)|[\"'](nvml[A-Z]\w+)[\"']"
    found = {a or b for path in PACKAGE.rglob("*.py") for a, b in re.findall(pattern, path.read_text())}
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


def test_the_health_readers_numbers_are_nvmls() -> None:
    assert (health._SINGLE_BIT_EVENT, health._DOUBLE_BIT_EVENT, health._XID_EVENT) == (
        pynvml.nvmlEventTypeSingleBitEccError,
        pynvml.nvmlEventTypeDoubleBitEccError,
        pynvml.nvmlEventTypeXidCriticalError,
    )
    assert dict(health._ERROR_TYPES) == {
        "corrected": pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
        "uncorrected": pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    }
    assert dict(health._COUNTERS) == {"volatile": pynvml.NVML_VOLATILE_ECC, "aggregate": pynvml.NVML_AGGREGATE_ECC}
    assert dict(health._CAUSES) == {
        "single_bit": pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
        "double_bit": pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
    }
    assert (health._TIMEOUT, health._GPU_IS_LOST, health._FEATURE_ENABLED) == (
        pynvml.NVML_ERROR_TIMEOUT,
        pynvml.NVML_ERROR_GPU_IS_LOST,
        pynvml.NVML_FEATURE_ENABLED,
    )


def test_health_calls_return_the_real_types() -> None:
    """The fake's answers are the types the real functions build (read from nvidia-ml-py's source)."""
    xid, dbe = pynvml.nvmlEventTypeXidCriticalError, pynvml.nvmlEventTypeDoubleBitEccError
    volta = FakeGPU("GPU-b", architecture=pynvml.NVML_DEVICE_ARCH_VOLTA, retired_pages={"double_bit": 2})
    fake = FakeNVML([FakeGPU("GPU-a", xids=[(0.0, 79)], ecc_events=[(0.0, dbe)]), volta])
    gpu = fake.gpus[0]
    assert type(fake.nvmlDeviceGetSupportedEventTypes(gpu)) is int
    event_set = fake.nvmlEventSetCreate()
    assert type(event_set) is pynvml.c_nvmlEventSet_t and "c_nvmlEventSet_t()" in inspect.getsource(
        pynvml.nvmlEventSetCreate
    )
    assert fake.nvmlDeviceRegisterEvents(gpu, xid | dbe, event_set) is None
    data = fake.nvmlEventSetWait_v2(event_set, 0)
    assert type(data) is pynvml.c_nvmlEventData_t and "c_nvmlEventData_t()" in inspect.getsource(
        pynvml.nvmlEventSetWait_v2
    )
    assert (data.eventType, data.eventData) == (xid, 79) and type(data.device) is pynvml.c_nvmlDevice_t
    assert fake.nvmlEventSetWait(event_set, 0).eventType == dbe
    count = fake.nvmlDeviceGetTotalEccErrors(gpu, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC)
    assert type(count) is int and "c_count.value" in inspect.getsource(pynvml.nvmlDeviceGetTotalEccErrors)
    rows = fake.nvmlDeviceGetRemappedRows(gpu)
    assert type(rows) is tuple and len(rows) == 4 and all(type(v) is int for v in rows)
    pages = fake.nvmlDeviceGetRetiredPages(volta, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    assert len(pages) == 2 and all(type(p) is int for p in pages)
    assert "list(map(int" in inspect.getsource(pynvml.nvmlDeviceGetRetiredPages)
    assert fake.nvmlDeviceGetRetiredPagesPendingStatus(volta) == pynvml.NVML_FEATURE_DISABLED
    assert fake.nvmlEventSetFree(event_set) is None


def test_health_calls_fail_as_the_real_ones_do() -> None:
    xid = pynvml.nvmlEventTypeXidCriticalError
    ampere, volta = FakeGPU("GPU-a", event_types=xid), FakeGPU("GPU-b", architecture=pynvml.NVML_DEVICE_ARCH_VOLTA)
    fake = FakeNVML([ampere, volta], fail_at=10.0)
    event_set = fake.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_NotSupported):  # nvml.h: "some of the requested event types" unsupported
        fake.nvmlDeviceRegisterEvents(ampere, xid | pynvml.nvmlEventTypeDoubleBitEccError, event_set)
    fake.nvmlDeviceRegisterEvents(ampere, xid, event_set)
    with pytest.raises(pynvml.NVMLError_Timeout):  # nothing waiting: the non-blocking poll's answer
        fake.nvmlEventSetWait_v2(event_set, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetRemappedRows(volta)  # before Ampere
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetRetiredPages(ampere, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetTotalEccErrors(ampere, pynvml.NVML_MEMORY_ERROR_TYPE_COUNT, pynvml.NVML_VOLATILE_ECC)
    fake.clock.advance(10.0)  # type: ignore[attr-defined]
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlEventSetWait_v2(event_set, 0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetTotalEccErrors(ampere, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC)
    fake.nvmlEventSetFree(event_set)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # a freed set
        fake.nvmlEventSetWait_v2(event_set, 0)
