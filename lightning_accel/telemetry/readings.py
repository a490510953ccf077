"""The metrics GPUMonitor logs, and one reading of a device through NVML."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from lightning_accel.telemetry import nvml
from lightning_accel.telemetry.nvml import GpuDevice, unsupported

__all__ = ["METRICS", "READINGS", "DeviceReader", "Metric"]

# Values from nvml.h (a stable ABI), used as numbers so that a fake module needs only the functions.
_TEMPERATURE_GPU, _CLOCK_SM, _CLOCK_MEM, _PCIE_TX, _PCIE_RX = 0, 1, 2, 0, 1
_SW_POWER_CAP, _HW_SLOWDOWN, _SW_THERMAL, _HW_THERMAL, _HW_POWER_BRAKE = 0x4, 0x8, 0x20, 0x40, 0x80
_ARCH_HOPPER = 9
_MEMORY_V2 = 0x02000028  # nvmlMemory_v2: `used` leaves out what the driver reserves, v1's includes it
_FUNCTION_NOT_FOUND = 13  # NVML_ERROR_FUNCTION_NOT_FOUND: this driver's libnvidia-ml lacks the symbol
_MIB = 2**20
_GPM = ((2, "sm_activity_pct"), (3, "sm_occupancy_pct"), (5, "tensor_activity_pct"), (10, "dram_bw_util_pct"))


@dataclass(frozen=True, slots=True)
class Metric:
    """One per-GPU metric: its key suffix, unit and the window statistics logged for it."""

    name: str
    unit: str
    stats: tuple[str, ...]
    """Window statistics logged: "mean" (time-weighted), "min", "max"; ("last",) for a counter."""
    reading: str
    """The NVML reading (see READINGS) it comes from."""
    description: str


_G, _M = ("mean", "min", "max"), ("mean",)
METRICS: tuple[Metric, ...] = (
    Metric("utilization_pct", "%", _G, "utilization", "time a kernel was running (NVML utilization.gpu)"),
    Metric("memory_utilization_pct", "%", _G, "utilization", "time device memory was read or written"),
    Metric(
        "memory_used_mib",
        "MiB",
        _G,
        "memory",
        "device memory allocated by all processes (driver-reserved memory left out where the driver says)",
    ),
    Metric("memory_total_mib", "MiB", _M, "memory", "device memory"),
    Metric("memory_used_pct", "%", _G, "memory", "memory_used_mib / memory_total_mib"),
    Metric("power_w", "W", _G, "power", "board power draw"),
    Metric("power_limit_w", "W", _M, "power", "enforced power limit"),
    Metric("power_pct", "%", _G, "power", "power_w / power_limit_w"),
    Metric("temperature_c", "C", _G, "temperature", "GPU core temperature"),
    Metric("sm_clock_mhz", "MHz", _G, "clocks", "SM clock"),
    Metric("sm_clock_pct", "%", _G, "clocks", "SM clock / its maximum"),
    Metric("memory_clock_mhz", "MHz", _G, "clocks", "memory clock"),
    Metric("memory_clock_pct", "%", _G, "clocks", "memory clock / its maximum"),
    Metric("throttle_thermal_frac", "fraction of time", _M, "throttle", "clocks held down by thermal slowdown"),
    Metric("throttle_power_frac", "fraction of time", _M, "throttle", "clocks held down by the power cap or brake"),
    Metric("throttle_hw_slowdown_frac", "fraction of time", _M, "throttle", "hardware slowdown engaged"),
    Metric("throttle_any_frac", "fraction of time", _M, "throttle", "any of the three above"),
    Metric("pcie_rx_mb_s", "MB/s", _G, "pcie", "PCIe receive throughput (host to GPU)"),
    Metric("pcie_tx_mb_s", "MB/s", _G, "pcie", "PCIe transmit throughput (GPU to host)"),
    Metric("energy_wh", "Wh", ("last",), "energy", "energy used since the fit started (total-energy counter)"),
    Metric("sm_activity_pct", "%", _G, "gpm", "GPM: time SMs were busy executing (Hopper or newer)"),
    Metric("sm_occupancy_pct", "%", _G, "gpm", "GPM: resident warps / maximum (Hopper or newer)"),
    Metric("tensor_activity_pct", "%", _G, "gpm", "GPM: tensor-core pipe activity (Hopper or newer)"),
    Metric("dram_bw_util_pct", "%", _G, "gpm", "GPM: DRAM bandwidth / peak (Hopper or newer)"),
)
READINGS = tuple(dict.fromkeys(m.reading for m in METRICS))


class DeviceReader:
    """Reads the metrics of one device. A reading the device does not support is dropped for good, quietly.

    Args:
        device: the device.
        readings: names from READINGS to take; None takes all.

    Any other NVML error propagates: the sampler treats it as a failure of NVML.
    """

    def __init__(self, device: GpuDevice, readings: Collection[str] | None = None) -> None:
        self.device = device
        self.dropped: set[str] = set()
        self._whole = device.parent if device.parent is not None else device.handle
        self._energy_start: float | None = None
        self._gpm: list[Any] = []
        self._gpm_primed = False
        self._max_clock = {_CLOCK_SM: self._static_max(_CLOCK_SM), _CLOCK_MEM: self._static_max(_CLOCK_MEM)}
        wanted = set(READINGS if readings is None else readings)
        table: list[tuple[str, str, Callable[[], dict[str, float]]]] = [
            ("utilization", "utilization", self._utilization),
            ("memory", "memory", self._memory),
            ("power", "power", lambda: {"power_w": nvml.pynvml.nvmlDeviceGetPowerUsage(self._whole) / 1000.0}),
            (
                "power_limit",
                "power",
                lambda: {"power_limit_w": nvml.pynvml.nvmlDeviceGetEnforcedPowerLimit(self._whole) / 1000.0},
            ),
            ("temperature", "temperature", self._temperature),
            ("sm_clock", "clocks", lambda: self._clock(_CLOCK_SM, "sm_clock")),
            ("memory_clock", "clocks", lambda: self._clock(_CLOCK_MEM, "memory_clock")),
            ("throttle", "throttle", self._throttle),
            (
                "pcie_rx",
                "pcie",
                lambda: {"pcie_rx_mb_s": nvml.pynvml.nvmlDeviceGetPcieThroughput(self._whole, _PCIE_RX) / 1000.0},
            ),
            (
                "pcie_tx",
                "pcie",
                lambda: {"pcie_tx_mb_s": nvml.pynvml.nvmlDeviceGetPcieThroughput(self._whole, _PCIE_TX) / 1000.0},
            ),
            ("energy", "energy", self._energy),
            ("gpm", "gpm", self._gpm_metrics),
        ]
        self._readers = [(name, read) for name, group, read in table if group in wanted]
        if "gpm" in wanted and not self._gpm_setup():
            self._drop("gpm")

    def read(self) -> dict[str, float]:
        """One reading of every supported metric (NVML units converted to those of METRICS)."""
        values: dict[str, float] = {}
        for name, read in list(self._readers):
            try:
                values.update(read())
            except Exception as err:
                if not unsupported(err):
                    raise
                self._drop(name)
        if "power_w" in values and values.get("power_limit_w"):
            values["power_pct"] = 100.0 * values["power_w"] / values["power_limit_w"]
        return values

    def close(self) -> None:
        for sample in self._gpm:
            try:
                nvml.pynvml.nvmlGpmSampleFree(sample)
            except Exception:  # freeing after NVML went away
                pass
        self._gpm = []

    def _drop(self, name: str) -> None:
        self._readers = [(n, r) for n, r in self._readers if n != name]
        self.dropped.add(name)

    def _static_max(self, clock: int) -> float | None:
        try:
            return float(nvml.pynvml.nvmlDeviceGetMaxClockInfo(self._whole, clock)) or None
        except Exception as err:
            if unsupported(err):
                return None
            raise

    def _newer_or_older(self, newer: Callable[[], Any], older: Callable[[], Any]) -> Any:
        """`newer()`, or `older()` on a driver whose NVML lacks the newer function (FUNCTION_NOT_FOUND: the Python
        attribute exists in nvidia-ml-py whatever the driver has)."""
        try:
            return newer()
        except Exception as err:
            if not (isinstance(err, AttributeError) or getattr(err, "value", None) == _FUNCTION_NOT_FOUND):
                raise
        return older()

    def _temperature(self) -> dict[str, float]:
        celsius = self._newer_or_older(  # nvmlDeviceGetTemperature is deprecated for removal in CUDA 14
            lambda: nvml.pynvml.nvmlDeviceGetTemperatureV(self._whole, _TEMPERATURE_GPU),
            lambda: nvml.pynvml.nvmlDeviceGetTemperature(self._whole, _TEMPERATURE_GPU),
        )
        return {"temperature_c": float(celsius)}

    def _utilization(self) -> dict[str, float]:
        rates = nvml.pynvml.nvmlDeviceGetUtilizationRates(self.device.handle)
        return {"utilization_pct": float(rates.gpu), "memory_utilization_pct": float(rates.memory)}

    def _memory(self) -> dict[str, float]:
        info = self._newer_or_older(
            lambda: nvml.pynvml.nvmlDeviceGetMemoryInfo(self.device.handle, _MEMORY_V2),
            lambda: nvml.pynvml.nvmlDeviceGetMemoryInfo(self.device.handle),
        )
        values = {"memory_used_mib": info.used / _MIB, "memory_total_mib": info.total / _MIB}
        if info.total:
            values["memory_used_pct"] = 100.0 * info.used / info.total
        return values

    def _clock(self, clock: int, prefix: str) -> dict[str, float]:
        mhz = float(nvml.pynvml.nvmlDeviceGetClockInfo(self._whole, clock))
        values = {f"{prefix}_mhz": mhz}
        highest = self._max_clock[clock]
        if highest:
            values[f"{prefix}_pct"] = 100.0 * mhz / highest
        return values

    def _throttle(self) -> dict[str, float]:
        mask = int(
            self._newer_or_older(
                lambda: nvml.pynvml.nvmlDeviceGetCurrentClocksEventReasons(self._whole),
                lambda: nvml.pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(self._whole),
            )
        )
        thermal, power, slowdown = _SW_THERMAL | _HW_THERMAL, _SW_POWER_CAP | _HW_POWER_BRAKE, _HW_SLOWDOWN
        return {
            "throttle_thermal_frac": float(bool(mask & thermal)),
            "throttle_power_frac": float(bool(mask & power)),
            "throttle_hw_slowdown_frac": float(bool(mask & slowdown)),
            "throttle_any_frac": float(bool(mask & (thermal | power | slowdown))),
        }

    def _energy(self) -> dict[str, float]:
        millijoules = float(nvml.pynvml.nvmlDeviceGetTotalEnergyConsumption(self._whole))
        if self._energy_start is None:
            self._energy_start = millijoules
        return {"energy_wh": (millijoules - self._energy_start) / 3.6e6}

    def _gpm_setup(self) -> bool:
        """GPM (GPU performance monitoring) counters exist on Hopper and newer, where the driver supports them."""
        try:
            if nvml.pynvml.nvmlDeviceGetArchitecture(self._whole) < _ARCH_HOPPER:
                return False
            if not nvml.pynvml.nvmlGpmQueryDeviceSupport(self._whole).isSupportedDevice:
                return False
            self._gpm = [nvml.pynvml.nvmlGpmSampleAlloc(), nvml.pynvml.nvmlGpmSampleAlloc()]
        except Exception as err:
            if unsupported(err):
                return False
            raise
        return True

    def _gpm_metrics(self) -> dict[str, float]:
        """GPM metrics over the time since the previous reading (the first reading only takes a sample)."""
        previous, current = self._gpm
        if self.device.gpu_instance_id is None:
            nvml.pynvml.nvmlGpmSampleGet(self._whole, current)
        else:
            nvml.pynvml.nvmlGpmMigSampleGet(self._whole, self.device.gpu_instance_id, current)
        self._gpm = [current, previous]
        if not self._gpm_primed:
            self._gpm_primed = True
            return {}
        request = nvml.pynvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(_GPM)
        request.sample1, request.sample2 = previous, current
        for slot, (metric_id, _) in enumerate(_GPM):
            request.metrics[slot].metricId = metric_id
        nvml.pynvml.nvmlGpmMetricsGet(request)
        return {
            name: float(request.metrics[slot].value)
            for slot, (_, name) in enumerate(_GPM)
            if request.metrics[slot].nvmlReturn == 0
        }
