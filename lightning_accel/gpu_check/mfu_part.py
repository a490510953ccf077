"""`mfu`: the peak-FLOP/s table against a hand-timed bf16 matmul (kept for `--full`'s MFU cross-check)."""

from __future__ import annotations

import time

import torch

from lightning_accel.gpu_check.context import CheckContext, Part, need_cuda

__all__ = ["check_mfu"]


def check_mfu(ctx: CheckContext) -> Part:
    need_cuda()
    from lightning_accel.telemetry.peak_flops import lookup_peak_flops

    n, dtype = 8192, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    a, b = torch.randn(n, n, device="cuda", dtype=dtype), torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    measured = 2 * n**3 * reps / (time.perf_counter() - start)
    peak = lookup_peak_flops(torch.cuda.get_device_name(0), "bf16" if dtype == torch.bfloat16 else "fp16")
    ctx.facts["matmul_tflops"] = measured / 1e12
    if peak.flops:
        ctx.facts["table_peak_tflops"] = peak.flops / 1e12
    figures = {
        "hand-timed matmul": f"{measured / 1e12:.1f} TFLOP/s",
        "table peak": f"{peak.flops / 1e12:.1f} TFLOP/s ({peak.source})" if peak.flops else peak.reason,
    }
    if peak.flops is None:
        return Part(name="mfu", status="SKIP", detail=peak.reason, figures=figures)
    share = measured / peak.flops
    figures["matmul / table peak"] = f"{share:.2f}"
    return Part(
        name="mfu",
        status="PASS" if 0.3 <= share <= 1.05 else "FAIL",
        detail="the table's peak against a hand-timed matmul (expected 0.6-0.9)",
        figures=figures,
    )
