"""`fp8`: one fp8 step where the GPU (compute capability 8.9+) and Transformer Engine or torchao allow."""

from __future__ import annotations

import torch

from lightning_accel.gpu_check.context import CheckContext, Part, Skip, need_cuda

__all__ = ["check_fp8"]


def check_fp8(ctx: CheckContext) -> Part:
    need_cuda()
    capability = torch.cuda.get_device_capability(0)
    if capability < (8, 9):
        raise Skip(f"fp8 needs compute capability 8.9+, this GPU has {capability[0]}.{capability[1]}")
    from lightning_accel.precision import resolve_precision

    try:
        resolved = resolve_precision("fp8", "cuda")
    except Exception as err:
        raise Skip(str(err)) from None
    return Part(name="fp8", status="PASS", detail=resolved.describe())
