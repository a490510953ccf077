"""A scripted stand-in for the `pynvml` module, as strict as the real one: GPUs (and MIG devices) whose readings are
functions of a fake clock.

Install it where the telemetry code looks the module up: `monkeypatch.setattr(lightning_accel.telemetry.nvml, "pynvml",
fake)` (or `install(monkeypatch, fake)`). Readings are numbers or functions of the clock's time, in NVML's own units
(mW, bytes, KB/s, mJ), so tests check the conversions too.

Where the real module is unkind, so is this one (tests/telemetry/test_fake_nvml_contract.py holds it to that):
- errors are nvidia-ml-py's own classes: `NVMLError(3)` is an `NVMLError_NotSupported`, and so on;
- `FakeGPU.errors` makes a named call raise a chosen NVML error on that device (`unsupported` is the shorthand for
  NOT_SUPPORTED); `FakeNVML.errors` does the same for calls that take no device; `fail_at` makes every device call
  raise GPU_IS_LOST from that time on;
- `missing` names functions the driver's libnvidia-ml lacks: the Python attribute exists (as in nvidia-ml-py) and
  calling it raises FUNCTION_NOT_FOUND;
- `denied` holds NVML indices whose `nvmlDeviceGetHandleByIndex` raises NO_PERMISSION (cgroup-restricted containers,
  SLURM jobs): `nvmlDeviceGetCount` still counts them, as nvml.h says;
- calls return the real binding's types: ctypes structs from nvidia-ml-py (`c_nvmlMemory_t`, `c_nvmlUtilization_t`,
  `c_nvmlGpmMetricsGet_t` with its NVML_GPM_METRIC_MAX slots), str names under `binding="13"` and bytes under "12";
- `nvmlDeviceGetPcieThroughput` blocks for `pcie_block_s` (the real call samples for about 20 ms);
- health: `xids=[(t, 79)]` and `ecc_events=[(t, nvmlEventTypeDoubleBitEccError)]` are events at fake-clock times,
  delivered through event sets as the real ones are (only to a set registered for that type before the event, once,
  in time order; `nvmlEventSetWait_v2` raises TIMEOUT when none waits, GPU_IS_LOST after `fail_at`); `ecc` holds
  the ECC counts by (`corrected`|`uncorrected`, `volatile`|`aggregate`); remapped rows answer from Ampere
  (`architecture` 7) on and retired pages before it, each NOT_SUPPORTED on the other side, as on real cards.

The driver's version and the CUDA version it supports, compute capabilities, NVLink links and the PCIe topology serve
lightning_accel.system (accel-doctor and Preflight).
"""

from __future__ import annotations

import ctypes
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml as _real

# nvidia-ml-py's own error classes and codes: `NVMLError(code)` builds the subclass for that code.
NVMLError = _real.NVMLError
nvmlExceptionClass = _real.nvmlExceptionClass
NVML_ERROR_INVALID_ARGUMENT = _real.NVML_ERROR_INVALID_ARGUMENT
NVML_ERROR_NOT_SUPPORTED = _real.NVML_ERROR_NOT_SUPPORTED
NVML_ERROR_NO_PERMISSION = _real.NVML_ERROR_NO_PERMISSION
NVML_ERROR_NOT_FOUND = _real.NVML_ERROR_NOT_FOUND
NVML_ERROR_LIBRARY_NOT_FOUND = _real.NVML_ERROR_LIBRARY_NOT_FOUND
NVML_ERROR_FUNCTION_NOT_FOUND = _real.NVML_ERROR_FUNCTION_NOT_FOUND
NVML_ERROR_GPU_IS_LOST = _real.NVML_ERROR_GPU_IS_LOST
NVML_GPM_METRICS_GET_VERSION = _real.NVML_GPM_METRICS_GET_VERSION
NVML_P2P_STATUS_NOT_SUPPORTED = _real.NVML_P2P_STATUS_NOT_SUPPORTED
NVML_NVLINK_MAX_LINKS = _real.NVML_NVLINK_MAX_LINKS
NVML_FEATURE_ENABLED = _real.NVML_FEATURE_ENABLED
NVML_P2P_CAPS_INDEX_NVLINK = _real.NVML_P2P_CAPS_INDEX_NVLINK
NVML_TEMPERATURE_GPU = _real.NVML_TEMPERATURE_GPU
NVML_CLOCK_SM = _real.NVML_CLOCK_SM
NVML_CLOCK_MEM = _real.NVML_CLOCK_MEM
NVML_PCIE_UTIL_TX_BYTES = _real.NVML_PCIE_UTIL_TX_BYTES
NVML_PCIE_UTIL_RX_BYTES = _real.NVML_PCIE_UTIL_RX_BYTES
NVML_ERROR_TIMEOUT = _real.NVML_ERROR_TIMEOUT
NVML_DEVICE_ARCH_AMPERE = _real.NVML_DEVICE_ARCH_AMPERE
nvmlEventTypeXidCriticalError = _real.nvmlEventTypeXidCriticalError
nvmlEventTypeSingleBitEccError = _real.nvmlEventTypeSingleBitEccError
nvmlEventTypeDoubleBitEccError = _real.nvmlEventTypeDoubleBitEccError
nvmlMemory_v2 = _real.nvmlMemory_v2
nvmlTemperature_v1 = _real.nvmlTemperature_v1
_GPM_SLOTS_12 = 98  # NVML_GPM_METRIC_MAX of the 12.x binding (13.x: 477)

Reading = float | Callable[[float], float]


class _GpmMetricsGet12(ctypes.Structure):
    """`c_nvmlGpmMetricsGet_t` as the 12.x binding lays it out (fewer metric slots)."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("numMetrics", ctypes.c_uint),
        ("sample1", _real.c_nvmlGpmSample_t),
        ("sample2", _real.c_nvmlGpmSample_t),
        ("metrics", _real.c_nvmlGpmMetric_t * _GPM_SLOTS_12),
    ]


class FakeClock:
    """Seconds, moved on by the test."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        self.t += seconds
        return self.t


@dataclass(eq=False)
class FakeGPU:
    """One GPU (or, with `parent`, one MIG device). Readings in NVML units; MiB given for memory for readability."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    utilization: Reading = 90.0
    memory_utilization: Reading = 40.0
    memory_used_mib: Reading = 20_000.0
    """What processes allocated; the v1 struct's `used` adds `memory_reserved_mib`, the v2 one does not."""
    memory_total_mib: float = 81_559.0
    memory_reserved_mib: float = 0.0
    """Memory the driver keeps for itself (`reserved` of `c_nvmlMemory_v2_t`)."""
    power_mw: Reading = 400_000.0
    power_limit_mw: Reading = 700_000.0
    temperature_c: Reading = 60.0
    sm_clock_mhz: Reading = 1_980.0
    max_sm_clock_mhz: float = 1_980.0
    memory_clock_mhz: Reading = 2_619.0
    max_memory_clock_mhz: float = 2_619.0
    throttle_mask: Reading = 0
    pcie_rx_kb_s: Reading = 1_000.0
    pcie_tx_kb_s: Reading = 500.0
    energy_mj: Reading = 0.0
    architecture: int = 9  # Hopper
    gpm: dict[int, Reading] = field(default_factory=lambda: {2: 80.0, 3: 30.0, 5: 50.0, 10: 60.0})
    unsupported: set[str] = field(default_factory=set)
    """NVML functions that raise NVMLError_NotSupported on this device."""
    errors: dict[str, int] = field(default_factory=dict)
    """NVML function -> the NVML error code it raises on this device (NO_PERMISSION, GPU_IS_LOST, ...)."""
    mig: list[FakeGPU] = field(default_factory=list)
    parent: FakeGPU | None = None
    gpu_instance_id: int = 0
    mig_profile: str = "1g.10gb"
    """A MIG device's profile, in its NVML name (`<parent name> MIG 1g.10gb`)."""
    multiprocessor_count: int = 132
    """SMs: the whole GPU's, or a MIG device's share (`nvmlDeviceGetAttributes`)."""
    compute_capability: tuple[int, int] = (9, 0)
    processes: list[int] = field(default_factory=list)
    """PIDs of the compute processes on it (`nvmlDeviceGetComputeRunningProcesses`)."""
    nvlinks: int = 0  # active NVLink links; 0: the GPU has none (NVML says NotSupported)
    xids: list[tuple[float, int]] = field(default_factory=list)
    """XID critical errors as (fake-clock time, XID code)."""
    ecc_events: list[tuple[float, int]] = field(default_factory=list)
    """ECC events as (fake-clock time, `nvmlEventTypeSingleBitEccError` or `nvmlEventTypeDoubleBitEccError`)."""
    event_types: int = nvmlEventTypeXidCriticalError | nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError
    """The event types the GPU supports (`nvmlDeviceGetSupportedEventTypes`)."""
    ecc: dict[tuple[str, str], Reading] = field(default_factory=dict)
    """ECC error counts by (`corrected`|`uncorrected`, `volatile`|`aggregate`); 0 where not given."""
    remapped_rows: tuple[Reading, Reading, int, int] = (0, 0, 0, 0)
    """(corrected, uncorrected, pending, failure) of `nvmlDeviceGetRemappedRows` (Ampere and newer)."""
    retired_pages: dict[str, int] = field(default_factory=dict)
    """Retired pages by cause, `single_bit` or `double_bit` (before Ampere); 0 where not given."""
    retired_pages_pending: bool = False


class FakeNVML:
    """The subset of `pynvml` that lightning_accel calls, over `gpus` in NVML (PCI) order.

    Args:
        gpus: the GPUs, in NVML order.
        clock: the time readings are functions of (a FakeClock by default).
        fail_at: from this time on every device call raises GPU_IS_LOST.
        init_error: `nvmlInit` raises this NVML error code.
        driver_version: `nvmlSystemGetDriverVersion`.
        cuda_driver_version: `nvmlSystemGetCudaDriverVersion`; None: NotSupported.
        topology_level: `nvmlDeviceGetTopologyCommonAncestor` of every pair (30: PHB).
        missing: functions the driver's NVML lacks (calling one raises FUNCTION_NOT_FOUND).
        denied: NVML indices whose handle raises NO_PERMISSION.
        errors: function -> NVML error code, for calls without a device (`nvmlSystemGetDriverVersion`, ...).
        binding: "13" (str names, 477 GPM slots) or "12" (bytes names, 98 GPM slots).
        pcie_block_s: seconds `nvmlDeviceGetPcieThroughput` blocks (wall time).
    """

    NVMLError = NVMLError
    nvmlExceptionClass = staticmethod(nvmlExceptionClass)

    def __init__(
        self,
        gpus: list[FakeGPU],
        clock: Callable[[], float] | None = None,
        fail_at: float | None = None,
        init_error: int | None = None,
        *,
        driver_version: str = "550.54.15",
        cuda_driver_version: int | None = 12040,
        topology_level: int = 30,
        missing: set[str] | None = None,
        denied: set[int] | None = None,
        errors: dict[str, int] | None = None,
        binding: str = "13",
        pcie_block_s: float = 0.0,
    ) -> None:
        assert binding in ("12", "13"), binding
        self.gpus = gpus
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.topology_level = topology_level
        self.clock = clock or FakeClock()
        self.fail_at = fail_at
        self.init_error = init_error
        self.missing = set(missing or ())
        self.denied = set(denied or ())
        self.errors = dict(errors or {})
        self.binding = binding
        self.pcie_block_s = pcie_block_s
        self.calls: Counter[str] = Counter()
        self.inits = 0
        self.shutdowns = 0
        self._samples: dict[int, tuple[float, FakeGPU]] = {}
        self._event_sets: dict[int, _EventSet] = {}
        self._c_handles: dict[int, Any] = {}  # id(FakeGPU) -> the c_nvmlDevice_t an event names it by
        for gpu in gpus:
            for mig in gpu.mig:
                mig.parent = gpu
        for name in dir(_real):  # NVMLError_NotSupported, NVML_ERROR_*, ... as the real module has them
            if name.startswith(("NVMLError_", "NVML_")) and not hasattr(type(self), name):
                setattr(self, name, getattr(_real, name))

    # library
    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def _call(self, function: str, device: FakeGPU | None = None) -> float:
        self.calls[function] += 1
        if function in self.missing:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        now = self.clock()
        if device is None and function in self.errors:
            raise NVMLError(self.errors[function])
        if device is not None:
            if self.fail_at is not None and now >= self.fail_at:
                raise NVMLError(NVML_ERROR_GPU_IS_LOST)
            if function in device.errors:
                raise NVMLError(device.errors[function])
            if function in device.unsupported:
                raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return now

    def _str(self, text: str) -> str | bytes:
        return text.encode() if self.binding == "12" else text

    @staticmethod
    def _at(reading: Reading, now: float) -> float:
        return reading(now) if callable(reading) else reading

    # system
    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        self._call("nvmlSystemGetDriverVersion")
        return self._str(self.driver_version)

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._call("nvmlSystemGetCudaDriverVersion")
        if self.cuda_driver_version is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return self.cuda_driver_version

    # devices
    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return len(self.gpus)  # nvml.h: includes the devices this process may not open

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGPU:
        self._call("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if index in self.denied:
            raise NVMLError(NVML_ERROR_NO_PERMISSION)
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, handle: FakeGPU) -> str | bytes:
        self._call("nvmlDeviceGetUUID", handle)
        return self._str(handle.uuid)

    def nvmlDeviceGetName(self, handle: FakeGPU) -> str | bytes:
        self._call("nvmlDeviceGetName", handle)
        if handle.parent is not None and " MIG " not in handle.name:  # e.g. "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
            return self._str(f"{handle.parent.name} MIG {handle.mig_profile}")
        return self._str(handle.name)

    def nvmlDeviceGetMigMode(self, device: FakeGPU) -> list[int]:
        self._call("nvmlDeviceGetMigMode", device)
        return [int(bool(device.mig))] * 2

    def nvmlDeviceGetMaxMigDeviceCount(self, device: FakeGPU) -> int:
        self._call("nvmlDeviceGetMaxMigDeviceCount", device)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: FakeGPU, index: int) -> FakeGPU:
        self._call("nvmlDeviceGetMigDeviceHandleByIndex", device)
        if index >= len(device.mig):
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return device.mig[index]

    def nvmlDeviceGetGpuInstanceId(self, device: FakeGPU) -> int:
        self._call("nvmlDeviceGetGpuInstanceId", device)
        return device.gpu_instance_id

    def nvmlDeviceGetAttributes(self, device: FakeGPU) -> Any:
        self._call("nvmlDeviceGetAttributes", device)
        if device.parent is None:  # nvml.h: "currently only supports MIG device handles"
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        attributes = _real.c_nvmlDeviceAttributes()
        attributes.multiprocessorCount = device.multiprocessor_count
        attributes.memorySizeMB = int(device.memory_total_mib)
        return attributes

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeGPU) -> list[Any]:
        self._call("nvmlDeviceGetComputeRunningProcesses", handle)
        found = []
        for pid in handle.processes:
            process = _real.c_nvmlProcessInfo_v3_t()
            process.pid = pid
            found.append(process)
        return found

    # readings
    def _whole_gpu_only(self, function: str, device: FakeGPU) -> float:
        now = self._call(function, device)
        if device.parent is not None:  # NVML gives power, temperature, clocks ... of the whole GPU only
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return now

    def nvmlDeviceGetUtilizationRates(self, handle: FakeGPU) -> Any:
        now = self._whole_gpu_only("nvmlDeviceGetUtilizationRates", handle)
        rates = _real.c_nvmlUtilization_t()
        rates.gpu, rates.memory = int(self._at(handle.utilization, now)), int(self._at(handle.memory_utilization, now))
        return rates

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGPU, version: int | None = None) -> Any:
        now = self._call("nvmlDeviceGetMemoryInfo_v2" if version else "nvmlDeviceGetMemoryInfo", handle)
        used, total = int(self._at(handle.memory_used_mib, now) * 2**20), int(handle.memory_total_mib * 2**20)
        reserved = int(handle.memory_reserved_mib * 2**20)
        if not version:
            info = _real.c_nvmlMemory_t()
            info.total, info.used, info.free = total, used + reserved, total - used - reserved
            return info
        if version != nvmlMemory_v2:
            raise NVMLError(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        info = _real.c_nvmlMemory_v2_t()
        info.version, info.total, info.reserved = version, total, reserved
        info.used, info.free = used, total - used - reserved
        return info

    def nvmlDeviceGetPowerUsage(self, handle: FakeGPU) -> int:
        return int(self._at(handle.power_mw, self._whole_gpu_only("nvmlDeviceGetPowerUsage", handle)))

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeGPU) -> int:
        return int(self._at(handle.power_limit_mw, self._whole_gpu_only("nvmlDeviceGetEnforcedPowerLimit", handle)))

    def nvmlDeviceGetTemperature(self, handle: FakeGPU, sensor: int) -> int:
        assert sensor == NVML_TEMPERATURE_GPU
        return int(self._at(handle.temperature_c, self._whole_gpu_only("nvmlDeviceGetTemperature", handle)))

    def nvmlDeviceGetTemperatureV(self, handle: FakeGPU, sensor: int, version: int = nvmlTemperature_v1) -> int:
        assert sensor == NVML_TEMPERATURE_GPU
        if version != nvmlTemperature_v1:
            raise NVMLError(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        return int(self._at(handle.temperature_c, self._whole_gpu_only("nvmlDeviceGetTemperatureV", handle)))

    def nvmlDeviceGetClockInfo(self, handle: FakeGPU, type: int) -> int:  # noqa: A002 - the real parameter's name
        now = self._whole_gpu_only("nvmlDeviceGetClockInfo", handle)
        return int(self._at({NVML_CLOCK_SM: handle.sm_clock_mhz, NVML_CLOCK_MEM: handle.memory_clock_mhz}[type], now))

    def nvmlDeviceGetMaxClockInfo(self, handle: FakeGPU, type: int) -> int:  # noqa: A002
        self._whole_gpu_only("nvmlDeviceGetMaxClockInfo", handle)
        return int({NVML_CLOCK_SM: handle.max_sm_clock_mhz, NVML_CLOCK_MEM: handle.max_memory_clock_mhz}[type])

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeGPU) -> int:
        now = self._whole_gpu_only("nvmlDeviceGetCurrentClocksEventReasons", handle)
        return int(self._at(handle.throttle_mask, now))

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeGPU) -> int:
        now = self._whole_gpu_only("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        return int(self._at(handle.throttle_mask, now))

    def nvmlDeviceGetPcieThroughput(self, device: FakeGPU, counter: int) -> int:
        now = self._whole_gpu_only("nvmlDeviceGetPcieThroughput", device)
        if self.pcie_block_s:
            time.sleep(self.pcie_block_s)
        readings = {NVML_PCIE_UTIL_TX_BYTES: device.pcie_tx_kb_s, NVML_PCIE_UTIL_RX_BYTES: device.pcie_rx_kb_s}
        return int(self._at(readings[counter], now))

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeGPU) -> int:
        now = self._whole_gpu_only("nvmlDeviceGetTotalEnergyConsumption", handle)
        return int(self._at(handle.energy_mj, now))

    def nvmlDeviceGetArchitecture(self, device: FakeGPU) -> int:
        self._whole_gpu_only("nvmlDeviceGetArchitecture", device)
        return device.architecture

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeGPU) -> tuple[int, int]:
        self._call("nvmlDeviceGetCudaComputeCapability", handle)
        return (handle.parent or handle).compute_capability

    def nvmlDeviceGetNvLinkState(self, device: FakeGPU, link: int) -> int:
        self._whole_gpu_only("nvmlDeviceGetNvLinkState", device)
        if not device.nvlinks:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < NVML_NVLINK_MAX_LINKS:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return int(link < device.nvlinks)  # NVML_FEATURE_ENABLED for the active links, DISABLED for the rest

    def nvmlDeviceGetP2PStatus(self, device1: FakeGPU, device2: FakeGPU, p2pIndex: int) -> int:  # noqa: N803
        self._call("nvmlDeviceGetP2PStatus", device1)
        assert p2pIndex == NVML_P2P_CAPS_INDEX_NVLINK
        return 0 if device1.nvlinks and device2.nvlinks else NVML_P2P_STATUS_NOT_SUPPORTED

    def nvmlDeviceGetTopologyCommonAncestor(self, device1: FakeGPU, device2: FakeGPU) -> int:
        self._call("nvmlDeviceGetTopologyCommonAncestor", device1)
        return self.topology_level

    # GPM
    def nvmlGpmQueryDeviceSupport(self, device: FakeGPU) -> Any:
        self._whole_gpu_only("nvmlGpmQueryDeviceSupport", device)
        support = _real.c_nvmlGpmSupport_t()
        support.version, support.isSupportedDevice = _real.NVML_GPM_SUPPORT_VERSION, int(device.architecture >= 9)
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        self._call("nvmlGpmSampleAlloc")
        sample = _real.c_nvmlGpmSample_t(_real.struct_c_nvmlGpmSample_t())  # an opaque pointer, as the real one
        return sample

    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:  # noqa: N803
        self._call("nvmlGpmSampleFree")
        self._samples.pop(ctypes.addressof(gpmSample.contents), None)

    def nvmlGpmSampleGet(self, device: FakeGPU, gpmSample: Any) -> Any:  # noqa: N803
        self._samples[ctypes.addressof(gpmSample.contents)] = (self._whole_gpu_only("nvmlGpmSampleGet", device), device)
        return gpmSample

    def nvmlGpmMigSampleGet(self, device: FakeGPU, gpuInstanceId: int, gpmSample: Any) -> Any:  # noqa: N803
        now = self._whole_gpu_only("nvmlGpmMigSampleGet", device)
        mig = next(m for m in device.mig if m.gpu_instance_id == gpuInstanceId)
        self._samples[ctypes.addressof(gpmSample.contents)] = (now, mig)
        return gpmSample

    @property
    def c_nvmlGpmMetricsGet_t(self) -> type:
        return _GpmMetricsGet12 if self.binding == "12" else _real.c_nvmlGpmMetricsGet_t

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:  # noqa: N803
        self._call("nvmlGpmMetricsGet")
        if metricsGet.version != NVML_GPM_METRICS_GET_VERSION:
            raise NVMLError(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        first = self._samples[ctypes.addressof(metricsGet.sample1.contents)]
        t, device = self._samples[ctypes.addressof(metricsGet.sample2.contents)]
        if not first[0] < t:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        for metric in metricsGet.metrics[: metricsGet.numMetrics]:
            reading = device.gpm.get(metric.metricId)
            metric.nvmlReturn = NVML_ERROR_NOT_SUPPORTED if reading is None else 0
            metric.value = 0.0 if reading is None else float(self._at(reading, t))
        return metricsGet

    # health
    def c_handle(self, device: FakeGPU) -> Any:
        """The `c_nvmlDevice_t` that names `device` in event data (the real binding's type, not the fake handle)."""
        if id(device) not in self._c_handles:
            self._c_handles[id(device)] = _real.c_nvmlDevice_t(_real.struct_c_nvmlDevice_t())
        return self._c_handles[id(device)]

    def nvmlDeviceGetSupportedEventTypes(self, handle: FakeGPU) -> int:
        self._whole_gpu_only("nvmlDeviceGetSupportedEventTypes", handle)
        return handle.event_types

    def nvmlEventSetCreate(self) -> Any:
        self._call("nvmlEventSetCreate")
        event_set = _real.c_nvmlEventSet_t(_real.struct_c_nvmlEventSet_t())  # an opaque pointer, as the real one
        self._event_sets[ctypes.addressof(event_set.contents)] = _EventSet()
        return event_set

    def _event_set(self, event_set: Any) -> _EventSet:
        if not isinstance(event_set, _real.c_nvmlEventSet_t) or not event_set:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        found = self._event_sets.get(ctypes.addressof(event_set.contents))
        if found is None:  # freed, or never created here
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return found

    def nvmlDeviceRegisterEvents(self, handle: FakeGPU, eventTypes: int, eventSet: Any) -> None:  # noqa: N803
        now = self._whole_gpu_only("nvmlDeviceRegisterEvents", handle)
        state = self._event_set(eventSet)
        if not isinstance(eventTypes, int) or eventTypes & ~handle.event_types:  # nvml.h: "some of requested types"
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        state.registered.append((handle, eventTypes, now))

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:  # noqa: N803
        return self._wait("nvmlEventSetWait_v2", eventSet, timeoutms)

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any:  # noqa: N803
        return self._wait("nvmlEventSetWait", eventSet, timeoutms)

    def _wait(self, function: str, event_set: Any, timeout_ms: int) -> Any:
        """The earliest undelivered event of the set (never blocks: TIMEOUT at once when none waits)."""
        now = self._call(function)
        assert isinstance(timeout_ms, int) and timeout_ms >= 0, timeout_ms  # the binding's c_uint
        state = self._event_set(event_set)
        waiting = []
        for device, mask, since in state.registered:
            if function in device.errors:
                raise NVMLError(device.errors[function])
            scripted = [(t, nvmlEventTypeXidCriticalError, code) for t, code in device.xids]
            scripted += [(t, kind, 0) for t, kind in device.ecc_events]
            for number, (t, kind, value) in enumerate(sorted(scripted, key=lambda e: e[0])):
                key = (id(device), number)
                if kind & mask and since <= t <= now and key not in state.delivered:
                    waiting.append((t, key, device, kind, value))
        if waiting:
            _, key, device, kind, value = min(waiting, key=lambda e: e[0])
            state.delivered.add(key)
            data = _real.c_nvmlEventData_t()
            data.device, data.eventType, data.eventData = self.c_handle(device), kind, value
            return data
        if state.registered and self.fail_at is not None and now >= self.fail_at:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        raise NVMLError(NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, eventSet: Any) -> None:  # noqa: N803
        self._call("nvmlEventSetFree")
        self._event_set(eventSet)
        del self._event_sets[ctypes.addressof(eventSet.contents)]

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeGPU, errorType: int, counterType: int) -> int:  # noqa: N803
        now = self._whole_gpu_only("nvmlDeviceGetTotalEccErrors", handle)
        kinds, counters = {0: "corrected", 1: "uncorrected"}, {0: "volatile", 1: "aggregate"}
        if errorType not in kinds or counterType not in counters:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return int(self._at(handle.ecc.get((kinds[errorType], counters[counterType]), 0), now))

    def nvmlDeviceGetRemappedRows(self, device: FakeGPU) -> tuple[int, int, int, int]:
        now = self._whole_gpu_only("nvmlDeviceGetRemappedRows", device)
        if device.architecture < NVML_DEVICE_ARCH_AMPERE:  # row remapping came with Ampere
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        corrected, uncorrected, pending, failure = device.remapped_rows
        return (int(self._at(corrected, now)), int(self._at(uncorrected, now)), int(pending), int(failure))

    def nvmlDeviceGetRetiredPages(self, device: FakeGPU, sourceFilter: int) -> list[int]:  # noqa: N803
        self._whole_gpu_only("nvmlDeviceGetRetiredPages", device)
        if device.architecture >= NVML_DEVICE_ARCH_AMPERE:  # Ampere and newer remap rows instead
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        causes = {0: "single_bit", 1: "double_bit"}
        if sourceFilter not in causes:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return [0x1000 * (page + 1) for page in range(device.retired_pages.get(causes[sourceFilter], 0))]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: FakeGPU) -> int:
        self._whole_gpu_only("nvmlDeviceGetRetiredPagesPendingStatus", device)
        if device.architecture >= NVML_DEVICE_ARCH_AMPERE:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return int(device.retired_pages_pending)  # NVML_FEATURE_ENABLED or _DISABLED


@dataclass(eq=False)
class _EventSet:
    """An event set's registrations (device, event mask, time registered) and the events it has handed out."""

    registered: list[tuple[FakeGPU, int, float]] = field(default_factory=list)
    delivered: set[tuple[int, int]] = field(default_factory=set)


def install(monkeypatch: Any, fake: FakeNVML) -> FakeNVML:
    """Make lightning_accel call `fake` instead of pynvml (undone by monkeypatch)."""
    import lightning_accel.telemetry.nvml as nvml

    monkeypatch.setattr(nvml, "pynvml", fake)
    return fake
