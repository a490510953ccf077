"""GPU telemetry: NVML reading, device mapping, the background sampler, alerts, the run report; no Lightning imports."""

from __future__ import annotations

from lightning_accel.telemetry.alerts import ALERTS, Alert, AlertThresholds, check_alerts
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
    "DeviceReader",
    "GpuDevice",
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
