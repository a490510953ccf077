"""Facts about the machine, read from files under a root path so tests can hand in fake trees; no Lightning imports."""

from __future__ import annotations

from lightning_accel.system.cpu import BF16_FLAGS, CpuInfo, native_bf16_flag, read_cpu_info

__all__ = ["BF16_FLAGS", "CpuInfo", "native_bf16_flag", "read_cpu_info"]
