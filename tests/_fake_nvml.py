"""A scripted stand-in for the `pynvml` module: GPUs (and MIG devices) whose readings are functions of a fake clock.

Install it where the telemetry code looks the module up: `monkeypatch.setattr(lightning_accel.telemetry.nvml, "pynvml",
fake)` (or `install(monkeypatch, fake)`). Readings are numbers or functions of the clock's time, in NVML's own units
(mW, bytes, KB/s, mJ), so tests check the conversions too. `unsupported` makes named NVML functions raise
NotSupported on a device; `fail_at` makes every device call raise GPU_IS_LOST from that time on. The driver's
version and the CUDA version it supports, compute capabilities, NVLink links and the PCIe topology serve
lightning_accel.system (accel-doctor and Preflight).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_GPM_METRICS_GET_VERSION = 1
NVML_P2P_STATUS_NOT_SUPPORTED = 5
_NAMES = {2: "Invalid Argument", 3: "Not Supported", 6: "Not Found", 12: "NVML Shared Library Not Found",
          15: "GPU is lost"}  # fmt: skip

Reading = float | Callable[[float], float]


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _NAMES.get(self.value, f"NVML Error with code {self.value}")


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
    memory_total_mib: float = 81_559.0
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
    mig: list[FakeGPU] = field(default_factory=list)
    parent: FakeGPU | None = None
    gpu_instance_id: int = 0
    compute_capability: tuple[int, int] = (9, 0)
    nvlinks: int = 0  # active NVLink links; 0: the GPU has none (NVML says NotSupported)


class FakeNVML:
    """The subset of `pynvml` that lightning_accel.telemetry calls, over `gpus` in NVML (PCI) order."""

    NVMLError = NVMLError
    NVML_GPM_METRICS_GET_VERSION = NVML_GPM_METRICS_GET_VERSION

    def __init__(self, gpus: list[FakeGPU], clock: Callable[[], float] | None = None, fail_at: float | None = None,
                 init_error: int | None = None, *, driver_version: str = "550.54.15",
                 cuda_driver_version: int | None = 12040, topology_level: int = 30) -> None:  # fmt: skip
        self.gpus = gpus
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version  # None: this driver does not say (NotSupported)
        self.topology_level = topology_level  # nvmlDeviceGetTopologyCommonAncestor of every pair; 30: PHB
        self.clock = clock or FakeClock()
        self.fail_at = fail_at
        self.init_error = init_error
        self.calls: Counter[str] = Counter()
        self.inits = 0
        self.shutdowns = 0
        for gpu in gpus:
            for mig in gpu.mig:
                mig.parent = gpu

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
        now = self.clock()
        if self.fail_at is not None and now >= self.fail_at:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        if device is not None and function in device.unsupported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return now

    @staticmethod
    def _at(reading: Reading, now: float) -> float:
        return reading(now) if callable(reading) else reading

    # system
    def nvmlSystemGetDriverVersion(self) -> str:
        self._call("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._call("nvmlSystemGetCudaDriverVersion")
        if self.cuda_driver_version is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return self.cuda_driver_version

    # devices
    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGPU:
        self._call("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, device: FakeGPU) -> str:
        self._call("nvmlDeviceGetUUID", device)
        return device.uuid

    def nvmlDeviceGetName(self, device: FakeGPU) -> bytes:
        self._call("nvmlDeviceGetName", device)
        return device.name.encode()  # older nvidia-ml-py returns bytes

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

    # readings
    def _whole_gpu_only(self, function: str, device: FakeGPU) -> float:
        now = self._call(function, device)
        if device.parent is not None:  # NVML gives power, temperature, clocks ... of the whole GPU only
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return now

    def nvmlDeviceGetUtilizationRates(self, device: FakeGPU) -> Any:
        now = self._whole_gpu_only("nvmlDeviceGetUtilizationRates", device)
        return SimpleNamespace(gpu=int(self._at(device.utilization, now)),
                               memory=int(self._at(device.memory_utilization, now)))  # fmt: skip

    def nvmlDeviceGetMemoryInfo(self, device: FakeGPU) -> Any:
        now = self._call("nvmlDeviceGetMemoryInfo", device)
        used, total = int(self._at(device.memory_used_mib, now) * 2**20), int(device.memory_total_mib * 2**20)
        return SimpleNamespace(used=used, total=total, free=total - used)

    def nvmlDeviceGetPowerUsage(self, device: FakeGPU) -> int:
        return int(self._at(device.power_mw, self._whole_gpu_only("nvmlDeviceGetPowerUsage", device)))

    def nvmlDeviceGetEnforcedPowerLimit(self, device: FakeGPU) -> int:
        return int(self._at(device.power_limit_mw, self._whole_gpu_only("nvmlDeviceGetEnforcedPowerLimit", device)))

    def nvmlDeviceGetTemperature(self, device: FakeGPU, sensor: int) -> int:
        assert sensor == 0
        return int(self._at(device.temperature_c, self._whole_gpu_only("nvmlDeviceGetTemperature", device)))

    def nvmlDeviceGetClockInfo(self, device: FakeGPU, clock: int) -> int:
        now = self._whole_gpu_only("nvmlDeviceGetClockInfo", device)
        return int(self._at({1: device.sm_clock_mhz, 2: device.memory_clock_mhz}[clock], now))

    def nvmlDeviceGetMaxClockInfo(self, device: FakeGPU, clock: int) -> int:
        self._whole_gpu_only("nvmlDeviceGetMaxClockInfo", device)
        return int({1: device.max_sm_clock_mhz, 2: device.max_memory_clock_mhz}[clock])

    def nvmlDeviceGetCurrentClocksEventReasons(self, device: FakeGPU) -> int:
        return int(self._at(device.throttle_mask,
                            self._whole_gpu_only("nvmlDeviceGetCurrentClocksEventReasons", device)))  # fmt: skip

    def nvmlDeviceGetPcieThroughput(self, device: FakeGPU, counter: int) -> int:
        now = self._whole_gpu_only("nvmlDeviceGetPcieThroughput", device)
        return int(self._at({0: device.pcie_tx_kb_s, 1: device.pcie_rx_kb_s}[counter], now))

    def nvmlDeviceGetTotalEnergyConsumption(self, device: FakeGPU) -> int:
        now = self._whole_gpu_only("nvmlDeviceGetTotalEnergyConsumption", device)
        return int(self._at(device.energy_mj, now))

    def nvmlDeviceGetArchitecture(self, device: FakeGPU) -> int:
        self._whole_gpu_only("nvmlDeviceGetArchitecture", device)
        return device.architecture

    def nvmlDeviceGetCudaComputeCapability(self, device: FakeGPU) -> tuple[int, int]:
        self._call("nvmlDeviceGetCudaComputeCapability", device)
        return (device.parent or device).compute_capability

    def nvmlDeviceGetNvLinkState(self, device: FakeGPU, link: int) -> int:
        self._whole_gpu_only("nvmlDeviceGetNvLinkState", device)
        if not device.nvlinks:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if link >= device.nvlinks:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return 1  # NVML_FEATURE_ENABLED

    def nvmlDeviceGetP2PStatus(self, first: FakeGPU, second: FakeGPU, index: int) -> int:
        self._call("nvmlDeviceGetP2PStatus", first)
        assert index == 2  # NVML_P2P_CAPS_INDEX_NVLINK
        return 0 if first.nvlinks and second.nvlinks else NVML_P2P_STATUS_NOT_SUPPORTED

    def nvmlDeviceGetTopologyCommonAncestor(self, first: FakeGPU, second: FakeGPU) -> int:
        self._call("nvmlDeviceGetTopologyCommonAncestor", first)
        return self.topology_level

    # GPM
    def nvmlGpmQueryDeviceSupport(self, device: FakeGPU) -> Any:
        self._whole_gpu_only("nvmlGpmQueryDeviceSupport", device)
        return SimpleNamespace(isSupportedDevice=int(device.architecture >= 9))

    def nvmlGpmSampleAlloc(self) -> Any:
        self._call("nvmlGpmSampleAlloc")
        return SimpleNamespace(t=None, device=None)

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self.calls["nvmlGpmSampleFree"] += 1

    def nvmlGpmSampleGet(self, device: FakeGPU, sample: Any) -> Any:
        sample.t, sample.device = self._whole_gpu_only("nvmlGpmSampleGet", device), device
        return sample

    def nvmlGpmMigSampleGet(self, device: FakeGPU, gpu_instance_id: int, sample: Any) -> Any:
        sample.t = self._whole_gpu_only("nvmlGpmMigSampleGet", device)
        sample.device = next(m for m in device.mig if m.gpu_instance_id == gpu_instance_id)
        return sample

    @staticmethod
    def c_nvmlGpmMetricsGet_t() -> Any:
        metrics = [SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(16)]
        return SimpleNamespace(version=0, numMetrics=0, sample1=None, sample2=None, metrics=metrics)

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        self._call("nvmlGpmMetricsGet")
        assert request.version == NVML_GPM_METRICS_GET_VERSION and request.sample1.t < request.sample2.t
        for metric in request.metrics[: request.numMetrics]:
            reading = request.sample2.device.gpm.get(metric.metricId)
            metric.nvmlReturn = NVML_ERROR_NOT_SUPPORTED if reading is None else 0
            metric.value = 0.0 if reading is None else float(self._at(reading, request.sample2.t))
        return request


def install(monkeypatch: Any, fake: FakeNVML) -> FakeNVML:
    """Make lightning_accel.telemetry call `fake` instead of pynvml (undone by monkeypatch)."""
    import lightning_accel.telemetry.nvml as nvml

    monkeypatch.setattr(nvml, "pynvml", fake)
    return fake
