"""`fsdp`: one step under FSDPStrategy on one GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lightning_accel.gpu_check.context import CheckContext, Part, need_cuda
from lightning_accel.gpu_check.gpt_fits import gpt_class, next_byte_pairs

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy

__all__ = ["check_fsdp"]


def _one_step(strategy: str | Strategy) -> Part:
    need_cuda()
    import lightning.pytorch as pl

    model = gpt_class()(block_size=64, n_layer=2, n_head=4, n_embd=128)
    data = torch.randint(0, 256, (8, 65))
    loader = torch.utils.data.DataLoader(next_byte_pairs(data), batch_size=8)
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, loader)
    return Part(name="", status="PASS", detail=f"1 step, global_step={trainer.global_step}")


def check_fsdp(ctx: CheckContext) -> Part:
    need_cuda()
    from lightning.pytorch.strategies import FSDPStrategy

    part = _one_step(FSDPStrategy())
    part.name = "fsdp"
    return part
