"""`gpu_monitor` (`--full`): GPUMonitor on a compiled bf16 fit of GPT-2 small: GPM readings there and
non-zero, step-time overhead within noise or at most 1%."""

from __future__ import annotations

import math

import torch

from lightning_accel.gpu_check.context import CheckContext, Part, Skip, need_cuda
from lightning_accel.gpu_check.gpt_fits import gpt_class, timed_fit

__all__ = ["OVERHEAD_LIMIT", "check_gpu_monitor"]

OVERHEAD_LIMIT = 0.01
"""GPUMonitor's step-time overhead on the compiled run that still passes when the interval does not hold 1.0."""


def check_gpu_monitor(ctx: CheckContext) -> Part:
    """GPUMonitor on a compiled bf16 fit of GPT-2 small: GPM readings present, overhead within noise or <= 1%."""
    need_cuda()
    if not torch.cuda.is_bf16_supported():
        raise Skip("this GPU has no bf16")
    from lightning_accel.system.software import compile_problem

    problem = compile_problem(on_cuda=True)
    if problem:
        raise Skip(problem)
    import functools

    from lightning_accel.callbacks import Compile, GPUMonitor
    from lightning_accel.measure import ratio, verdict

    adamw = functools.partial(torch.optim.AdamW, lr=6e-4, fused=True)
    model = gpt_class()(block_size=1024, n_layer=12, n_head=12, n_embd=768, optimizer=adamw)  # compiled once, reused
    on, off, monitors = [], [], []
    for _ in range(3):  # alternating: the same drift touches both
        monitor = GPUMonitor(interval_s=0.5, print_report=False, report_dir=str(ctx.out_dir / "gpu_monitor"))
        on.append(timed_fit(model, [Compile(), monitor], steps=100, warmup=20, precision="bf16-mixed", batch_size=16))
        monitors.append(monitor)
        off.append(timed_fit(model, [Compile()], steps=100, warmup=20, precision="bf16-mixed", batch_size=16))
    overhead = ratio(on, off)
    gpus = monitors[-1].report.gpus
    readings = {
        name: max((run[name].mean for run in gpus.values() if name in run), default=math.nan)
        for name in ("sm_activity_pct", "tensor_activity_pct", "utilization_pct", "power_w")
    }
    figures = {
        "s/step with GPUMonitor": " ".join(f"{t:.4f}" for t in on),
        "s/step without": " ".join(f"{t:.4f}" for t in off),
        "overhead (ratio, paired rounds)": f"{overhead.format('.4f')} ({verdict(overhead)})",
        **{f"GPM {k}" if "activity" in k else k: f"{v:.1f}" for k, v in readings.items()},
    }
    problems = [f"no {name} reading" for name in ("sm_activity_pct", "tensor_activity_pct") if not readings[name] > 0]
    if not (overhead.contains(1.0) or overhead.median <= 1 + OVERHEAD_LIMIT):
        problems.append(f"overhead {overhead.median - 1:.1%} is above {OVERHEAD_LIMIT:.0%} and outside the noise")
    ctx.facts["gpm"] = readings
    return Part(
        name="gpu_monitor",
        status="FAIL" if problems else "PASS",
        detail="; ".join(problems) or "compiled bf16 GPT-2 small, 3 alternating pairs of 100 steps",
        figures=figures,
    )
