"""`nvml_vs_torch`: NVML's name, UUID mapping and free memory against torch's."""

from __future__ import annotations

import os

import torch

from lightning_accel.gpu_check.context import CheckContext, Part, Skip, need_cuda

__all__ = ["check_nvml_vs_torch"]


def check_nvml_vs_torch(ctx: CheckContext) -> Part:
    need_cuda()
    from lightning_accel.telemetry import nvml

    why = nvml.init_nvml()
    if why is not None:
        raise Skip(why)
    try:
        count = torch.cuda.device_count()
        uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]
        devices = nvml.resolve_devices(list(range(count)), os.environ.get("CUDA_VISIBLE_DEVICES"), uuids)
        problems, figures = [], {}
        for i, device in enumerate(devices):
            free, total = torch.cuda.mem_get_info(i)
            info = nvml.pynvml.nvmlDeviceGetMemoryInfo(device.handle)
            name = torch.cuda.get_device_name(i)
            figures[f"cuda:{i}"] = (
                f"{device.name} / torch {name}; NVML total {info.total / 2**20:.0f} MiB, "
                f"torch {total / 2**20:.0f} MiB; used NVML {info.used / 2**20:.0f} MiB, "
                f"torch {(total - free) / 2**20:.0f} MiB"
            )
            if not device.name.startswith(name) and not name.startswith(device.name):
                problems.append(f"cuda:{i} name {name!r} vs NVML {device.name!r}")
            # NVML's total counts the memory the driver reserves for itself; cudaMemGetInfo's leaves it out (615 MiB
            # on an H200 with driver 580), so totals differ by that and the free memory is what must agree.
            reserved = info.total - total
            figures[f"cuda:{i} driver-reserved"] = f"{reserved / 2**20:.0f} MiB"
            if not 0 <= reserved <= max(2 * 2**30, info.total // 50):
                problems.append(f"cuda:{i} total memory {total} vs NVML {info.total}: more than the driver reserves")
            if abs(info.free - free) > 256 * 2**20:
                problems.append(f"cuda:{i} free memory {free} vs NVML {info.free}: more than 256 MiB apart")
        return Part(
            name="nvml_vs_torch", status="FAIL" if problems else "PASS", detail="; ".join(problems), figures=figures
        )
    finally:
        nvml.shutdown_nvml()
