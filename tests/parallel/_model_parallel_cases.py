"""GPT-tiny runs under ModelParallelStrategy for tests/parallel/test_model_parallel.py, on 2 ranks under torchrun.

`python -m torch.distributed.run --standalone --nproc-per-node 2 _model_parallel_cases.py OUT_DIR` runs every case
on both ranks and each rank writes OUT_DIR/rank<k>.json; `reference_losses()` is the single-process run in plain
PyTorch the cases are held to.

Cases: FSDP2 (dp=2) with a sharded checkpoint after epoch 1 (step 10) and a resume from it; the same with activation
checkpointing; tensor parallel (tp=2) with the GPT plan; and FSDP2 under 4-micro-batch accumulation with the
reduce-scatter per micro-batch switched on and off, counting the reduce-scatter calls. With `--nproc-per-node 4` and
a second argument `2d`: FSDP2 x tensor parallel (dp=2 x tp=2) with activation checkpointing, saved and resumed.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from _byte_data import byte_sequences
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_accel import examples, schedules
from lightning_accel.callbacks.parallelize import Parallelize
from lightning_accel.strategies import ModelParallelStrategy

GPTLanguageModel = examples.GPTLanguageModel

SEED = 0
GLOBAL_BATCH = 8  # sequences per optimizer step (dp=2: 4 per rank; tp=2: all 8 on both ranks)
BATCHES_PER_EPOCH = 10
EPOCHS = 2  # 20 optimizer steps; the checkpoint is written after epoch 1 (step 10)
BLOCK_SIZE = 16
MODEL = {"block_size": BLOCK_SIZE, "n_layer": 2, "n_head": 4, "n_embd": 32, "dropout": 0.0}
LR = 3e-3
WEIGHT_DECAY = 0.1
CLIP = 0.5  # gradient-norm clipping, active on most steps: clipping sees all shards' gradients
BLOCK_CLASSES = ["Block"]
TP_PLAN = {  # the plan conf/model/gpt.yaml carries
    "blocks.*.attn.q_proj": "colwise",
    "blocks.*.attn.k_proj": "colwise",
    "blocks.*.attn.v_proj": "colwise",
    "blocks.*.attn.out_proj": "rowwise",
    "blocks.*.mlp.fc": "colwise",
    "blocks.*.mlp.proj": "rowwise",
}


def dataset() -> TensorDataset:
    return byte_sequences(GLOBAL_BATCH * BATCHES_PER_EPOCH, BLOCK_SIZE, SEED)


def make_model() -> GPTLanguageModel:
    torch.manual_seed(SEED)  # every rank and the reference start from the same weights
    return GPTLanguageModel(
        **MODEL,
        optimizer=functools.partial(torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY),
        lr_scheduler=functools.partial(schedules.cosine_schedule, min_lr_ratio=0.1),
    )


def reference_losses(steps: int = EPOCHS * BATCHES_PER_EPOCH) -> tuple[list[float], int]:
    """The single-process run in plain PyTorch: one AdamW step per global batch, in dataset order.

    Returns:
        The loss of each step, and the number of steps whose gradients were clipped.
    """
    model = make_model()
    optimizer = torch.optim.AdamW(model.param_groups(), lr=LR)
    scheduler = schedules.cosine_schedule(optimizer, total_steps=steps, min_lr_ratio=0.1)
    x, y = dataset().tensors
    losses, clipped = [], 0
    for step in range(steps):
        rows = slice(step % BATCHES_PER_EPOCH * GLOBAL_BATCH, (step % BATCHES_PER_EPOCH + 1) * GLOBAL_BATCH)
        loss = model._loss((x[rows], y[rows]))
        loss.backward()
        clipped += int(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item() > CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, clipped


class LossRecorder(pl.Callback):
    """The loss of each micro-batch, averaged over the data-parallel ranks: the loss of the global batch."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"].detach().clone() * trainer.accumulate_grad_batches
        dp = pl_module.device_mesh["data_parallel"]
        dist.all_reduce(loss, group=dp.get_group())
        self.losses.append(loss.item() / dp.size())


class ReduceScatterCounter:
    """Counts the reduce-scatter collectives FSDP2 issues (torch.distributed's functions, wrapped while active)."""

    NAMES = ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter")

    def __init__(self) -> None:
        self.calls = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> ReduceScatterCounter:
        for name in self.NAMES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original

            def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                self.calls += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


def run_case(
    root: str,
    *,
    tp: int = 1,
    parallelize: dict[str, Any] | None = None,
    accumulate: int = 1,
    max_epochs: int = EPOCHS,
    checkpoint: bool = False,
    resume_from: str | None = None,
) -> dict[str, Any]:
    """One fit of the tiny GPT on 2 ranks: `tp` tensor-parallel ranks, the rest data parallel (FSDP2)."""
    world = int(os.environ["WORLD_SIZE"])
    recorder = LossRecorder()
    callbacks: list[pl.Callback] = [Parallelize(**(parallelize or {"block_classes": BLOCK_CLASSES})), recorder]
    if checkpoint:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=f"{root}/ckpt",
                filename="epoch{epoch}",
                save_top_k=-1,
                every_n_epochs=1,
                save_on_train_epoch_end=True,
                auto_insert_metric_name=False,
            )
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ModelParallelStrategy(tensor_parallel_size=tp),
        max_epochs=max_epochs,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=CLIP,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=checkpoint,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    dp_size = world // tp
    data = dataset()
    rank = int(os.environ["RANK"])
    dp_rank = rank // tp  # Lightning's mesh is (data_parallel, tensor_parallel), row-major
    sampler = DistributedSampler(data, num_replicas=dp_size, rank=dp_rank, shuffle=False) if dp_size > 1 else None
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // dp_size // accumulate, sampler=sampler)
    model = make_model()
    with warnings.catch_warnings(), ReduceScatterCounter() as counter:
        warnings.simplefilter("ignore")
        trainer.fit(model, loader, ckpt_path=resume_from)
    return {
        "losses": recorder.losses,
        "global_step": trainer.global_step,
        "reduce_scatters": counter.calls,
        "micro_batches": len(recorder.losses),
        "fsdp_units": sum(1 for m in model.modules() if type(m).__name__.startswith("FSDP")),
        "dtensor_params": [n for n, p in model.named_parameters() if type(p).__name__ == "DTensor"],
    }


def run_2d(root: str) -> dict[str, Any]:
    """dp=2 x tp=2 on 4 ranks: the tensor-parallel blocks sharded again by FSDP2 into 2-D DTensors."""
    plan = {"block_classes": BLOCK_CLASSES, "tp_plan": TP_PLAN, "activation_checkpointing": True}
    results = {"2d": run_case(f"{root}/2d", tp=2, parallelize=plan, checkpoint=True)}
    checkpoint = f"{root}/2d/ckpt/epoch0.ckpt"
    results["2d_resumed"] = run_case(f"{root}/2d_resumed", tp=2, parallelize=plan, resume_from=checkpoint)
    return results


def run_all(root: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    results["dp2"] = run_case(f"{root}/dp2", checkpoint=True)
    checkpoint = f"{root}/dp2/ckpt/epoch0.ckpt"
    results["dp2_checkpoint_is_sharded"] = Path(checkpoint).is_dir()
    results["dp2_resumed"] = run_case(f"{root}/dp2_resumed", resume_from=checkpoint)
    results["dp2_ac"] = run_case(
        f"{root}/dp2_ac", parallelize={"block_classes": BLOCK_CLASSES, "activation_checkpointing": True}
    )
    results["tp2"] = run_case(f"{root}/tp2", tp=2, parallelize={"block_classes": BLOCK_CLASSES, "tp_plan": TP_PLAN})
    for sync in (True, False):
        results[f"accumulate4_sync{sync}"] = run_case(
            f"{root}/acc_{sync}",
            accumulate=4,
            max_epochs=1,
            parallelize={"block_classes": BLOCK_CLASSES, "sync_grads_every_micro_batch": sync},
        )
    return results


if __name__ == "__main__":
    out = Path(sys.argv[1])
    found = run_2d(str(out / "runs")) if sys.argv[2:] == ["2d"] else run_all(str(out / "runs"))
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(found))
    if torch.distributed.is_initialized():  # an orderly end: a group torn down at interpreter exit can abort a rank
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
