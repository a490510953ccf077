"""`model_parallel`: 8 steps under ModelParallelStrategy with `Parallelize` (FSDP2 per block) on one GPU."""

from __future__ import annotations

from lightning_accel.gpu_check.context import CheckContext, Part, need_cuda
from lightning_accel.gpu_check.gpt_fits import gpt_class, tiny_fit

__all__ = ["check_model_parallel"]


def check_model_parallel(ctx: CheckContext) -> Part:
    """One step under ModelParallelStrategy, parallelized the project's way: the `Parallelize` callback installs
    `configure_model` (FSDP2 per GPT block) on a module that has none of its own."""
    need_cuda()
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_accel.callbacks import Parallelize

    model = gpt_class()(block_size=64, n_layer=2, n_head=4, n_embd=128)
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    seconds = tiny_fit([Parallelize(block_classes=["Block"])], steps=8, model=model, batch_size=8, strategy=strategy)
    return Part(
        name="model_parallel",
        status="PASS",
        detail="8 steps, FSDP2 per block through Parallelize",
        figures={"s/step": f"{seconds:.4f}"},
    )
