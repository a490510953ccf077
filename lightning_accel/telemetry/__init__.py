"""GPU telemetry: NVML reading, device mapping, card health, the sampler, alerts, run reports; no Lightning imports."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_accel.telemetry.alerts import ALERTS, Alert, AlertThresholds, check_alerts
    from lightning_accel.telemetry.health import CardHealth, HealthReader
    from lightning_accel.telemetry.nvml import GpuDevice, resolve_devices
    from lightning_accel.telemetry.peak_flops import PeakFlops, compute_dtype, lookup_peak_flops
    from lightning_accel.telemetry.readings import METRICS, READINGS, DeviceReader, Metric
    from lightning_accel.telemetry.run_report import RunReport
    from lightning_accel.telemetry.sampler import NVMLSampler, Stat, Window, open_sampler

__all__ = [
    "ALERTS",
    "METRICS",
    "READINGS",
    "Alert",
    "AlertThresholds",
    "CardHealth",
    "DeviceReader",
    "GpuDevice",
    "HealthReader",
    "Metric",
    "NVMLSampler",
    "PeakFlops",
    "RunReport",
    "Stat",
    "Window",
    "check_alerts",
    "compute_dtype",
    "lookup_peak_flops",
    "open_sampler",
    "resolve_devices",
]

_HOMES = {
    **dict.fromkeys(
        (
            "ALERTS",
            "Alert",
            "AlertThresholds",
            "check_alerts",
        ),
        "lightning_accel.telemetry.alerts",
    ),
    **dict.fromkeys(("CardHealth", "HealthReader"), "lightning_accel.telemetry.health"),
    **dict.fromkeys(
        (
            "GpuDevice",
            "resolve_devices",
        ),
        "lightning_accel.telemetry.nvml",
    ),
    **dict.fromkeys(
        (
            "PeakFlops",
            "compute_dtype",
            "lookup_peak_flops",
        ),
        "lightning_accel.telemetry.peak_flops",
    ),
    **dict.fromkeys(
        (
            "METRICS",
            "READINGS",
            "DeviceReader",
            "Metric",
        ),
        "lightning_accel.telemetry.readings",
    ),
    **dict.fromkeys(("RunReport",), "lightning_accel.telemetry.run_report"),
    **dict.fromkeys(
        (
            "NVMLSampler",
            "Stat",
            "Window",
            "open_sampler",
        ),
        "lightning_accel.telemetry.sampler",
    ),
}
"""Each public name and the module it lives in: imported from there when first used, so importing one module of
the package (`lightning_accel.system.cpuset` before torch loads) does not load the others."""


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
