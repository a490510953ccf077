"""`gpu_monitor_overhead`: a CUDA fit with GPUMonitor against one with DeviceStatsMonitor, step-time ratio."""

from __future__ import annotations

import statistics

from lightning_accel.gpu_check.context import CheckContext, Part, need_cuda
from lightning_accel.gpu_check.gpt_fits import tiny_fit

__all__ = ["check_gpu_monitor_overhead"]


def check_gpu_monitor_overhead(ctx: CheckContext) -> Part:
    need_cuda()
    from lightning.pytorch.callbacks import DeviceStatsMonitor

    from lightning_accel.callbacks import GPUMonitor

    ours, theirs = [], []
    for _ in range(3):  # alternating, so drift in clocks or load hits both alike
        ours.append(tiny_fit([GPUMonitor(interval_s=0.1)], steps=60))
        theirs.append(tiny_fit([DeviceStatsMonitor()], steps=60))
    ratio = statistics.median(ours) / statistics.median(theirs)
    figures = {
        "GPUMonitor s/step": " ".join(f"{t:.4f}" for t in ours),
        "DeviceStatsMonitor s/step": " ".join(f"{t:.4f}" for t in theirs),
        "ratio (median)": f"{ratio:.3f}",
    }
    return Part(
        name="gpu_monitor_overhead",
        status="PASS" if ratio <= 1.05 else "FAIL",
        detail="GPUMonitor step time over DeviceStatsMonitor's",
        figures=figures,
    )
