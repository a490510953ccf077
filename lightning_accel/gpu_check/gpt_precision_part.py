"""`gpt_precision`: the GPT example in fp32 and bf16-mixed: speedup, validation loss within 2%."""

from __future__ import annotations

import torch

from lightning_accel.gpu_check.context import CheckContext, Part, Skip, need_cuda
from lightning_accel.gpu_check.gpt_fits import Precision, gpt_class, tiny_fit

__all__ = ["check_gpt_precision"]


def check_gpt_precision(ctx: CheckContext) -> Part:
    need_cuda()
    if not torch.cuda.is_bf16_supported():
        raise Skip("this GPU has no bf16")
    import lightning.pytorch as pl

    results = {}
    precisions: tuple[Precision, ...] = ("32-true", "bf16-mixed")
    for precision in precisions:
        pl.seed_everything(0)
        # big enough that the matmuls, not kernel launches, set the step time (a 4x512 model ran 1.03x in bf16)
        model = gpt_class()(block_size=512, n_layer=8, n_head=16, n_embd=1024)
        seconds = tiny_fit([], steps=60, precision=precision, model=model, batch_size=16)
        model.eval().cuda()
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=precision != "32-true"):
            x = torch.randint(0, 256, (16, 513), generator=torch.Generator().manual_seed(1)).cuda()
            loss = float(model._loss((x[:, :-1], x[:, 1:])))
        results[precision] = (seconds, loss)
    speedup = results["32-true"][0] / results["bf16-mixed"][0]
    drift = abs(results["bf16-mixed"][1] - results["32-true"][1]) / results["32-true"][1]
    figures: dict[str, str] = {p: f"{s:.4f} s/step, loss {v:.4f}" for p, (s, v) in results.items()}
    figures["bf16 speedup"] = f"{speedup:.2f}x"
    figures["loss difference"] = f"{drift:.2%}"
    return Part(name="gpt_precision", status="PASS" if drift <= 0.02 else "FAIL", figures=figures)
