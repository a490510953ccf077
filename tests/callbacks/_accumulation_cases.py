"""Accumulation scenarios run by tests/callbacks/test_accumulation.py, in-process or on 2 ranks under torchrun.

Each case fits a linear regression with SGD under an accumulation schedule and an LR schedule and records, per
optimizer step, the LR used and the window size; per backward, whether DDP synchronised gradients. Run directly
(`python -m torch.distributed.run --nproc-per-node 2 _accumulation_cases.py OUT_DIR`, with `tests/` on PYTHONPATH as
`_torchrun.torchrun` sets it) every rank writes OUT_DIR/rank<k>.json with the results of all cases.
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
from _tiny import TinyRegression
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_accel import estimated_optimizer_steps, schedules
from lightning_accel.callbacks import AccumulationScheduler

MICRO_BATCH = 2
BATCHES_PER_RANK = 10  # per epoch
FEATURES = 4
LR = 0.05

# name -> (AccumulationScheduler kwargs, max_epochs, max_steps)
SCHEDULES: dict[str, tuple[dict[str, Any], int, int]] = {
    "epoch": ({"scheduling": {0: 1, 1: 2, 2: 4}}, 3, -1),
    "step": ({"scheduling": {0: 1, 4: 3}, "unit": "step"}, 2, -1),
    "global_batch": ({"global_batch_size": 16}, 2, -1),
    "step_capped": ({"scheduling": {0: 1, 3: 4}, "unit": "step"}, 5, 9),
}
LR_SCHEDULES = {
    "cosine": functools.partial(schedules.cosine_schedule, min_lr_ratio=0.1),
    "onecycle": functools.partial(schedules.onecycle_schedule, pct_start=0.3),
}


def dataset(world_size: int) -> TensorDataset:
    """World-size x the samples of one rank, so every rank sees BATCHES_PER_RANK micro-batches per epoch."""
    gen = torch.Generator().manual_seed(0)
    n = BATCHES_PER_RANK * MICRO_BATCH * world_size
    x = torch.randn(n, FEATURES, generator=gen)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(n, generator=gen)
    return TensorDataset(x, y.unsqueeze(1))


class Regression(TinyRegression):
    """The same weights in every process (seed 1); SGD at LR under `lr_scheduler`, the estimate of its steps kept."""

    def __init__(self, lr_scheduler: Any) -> None:
        super().__init__(FEATURES, lr=LR, seed=1)
        self.lr_scheduler = lr_scheduler
        self.estimated_steps: int | None = None

    def configure_optimizers(self) -> Any:
        self.estimated_steps = estimated_optimizer_steps(self.trainer)
        return schedules.configure_optimizers(self, functools.partial(torch.optim.SGD, lr=LR), self.lr_scheduler)


class ShardedRegression(Regression):
    """The same model with its layer sharded by FSDP2 under ModelParallelStrategy."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.layer, mesh=self.device_mesh["data_parallel"])


def _fsdp_reduces_grads(module: nn.Module) -> bool:
    """Whether an FSDP2 module will reduce-scatter gradients on this backward (torch internals, tests only)."""
    return bool(module._get_fsdp_state()._fsdp_param_group.reduce_grads)


class Recorder(pl.Callback):
    """Per optimizer step: epoch, LR used, window size. Per backward: DDP's gradient-sync flag and window end."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.syncs: list[tuple[bool, bool]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.steps.append(
            {
                "step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "lr": optimizer.param_groups[0]["lr"],
                "window": trainer.accumulate_grad_batches,
            }
        )

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if isinstance(pl_module, ShardedRegression):
            sync = _fsdp_reduces_grads(pl_module.layer)
        else:
            sync = bool(getattr(trainer.strategy.model, "require_backward_grad_sync", True))
        ends = next(cb for cb in trainer.callbacks if isinstance(cb, AccumulationScheduler)).window_complete
        self.syncs.append((sync, ends))


def run_case(
    schedule: str,
    lr_schedule: str,
    root: str,
    *,
    resume_from: str | None = None,
    save_every_step: bool = False,
    fsdp: bool = False,
) -> dict[str, Any]:
    """Fit one case; returns what the tests compare."""
    kwargs, max_epochs, max_steps = SCHEDULES[schedule]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    recorder = Recorder()
    callbacks: list[pl.Callback] = [AccumulationScheduler(**kwargs), recorder]
    if save_every_step:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=f"{root}/ckpt",
                filename="s{step}",
                auto_insert_metric_name=False,
                every_n_train_steps=1,
                save_top_k=-1,
                save_on_train_epoch_end=False,
            )
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
        if fsdp
        else ("ddp" if world > 1 else "auto"),
        max_epochs=max_epochs,
        max_steps=max_steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=save_every_step,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        use_distributed_sampler=False,  # Lightning's own DistributedSampler always shuffles training data
    )
    model = (ShardedRegression if fsdp else Regression)(LR_SCHEDULES[lr_schedule])
    data = dataset(world)
    rank = int(os.environ.get("RANK", "0"))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False) if world > 1 else None
    loader = DataLoader(data, batch_size=MICRO_BATCH, sampler=sampler)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader, ckpt_path=resume_from)
    return {
        "schedule": schedule,
        "lr_schedule": lr_schedule,
        "world": world,
        "estimated": model.estimated_steps,
        "global_step": trainer.global_step,
        "steps": recorder.steps,
        "syncs": recorder.syncs,
        "initial": {k: v.tolist() for k, v in model.initial.items()},
        "final": {k: _full(v).tolist() for k, v in model.layer.state_dict().items()},
        "accumulate_after_fit": trainer.accumulate_grad_batches,
    }


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def run_all(root: str) -> dict[str, Any]:
    """Every schedule x LR schedule, then a resume from a mid-schedule checkpoint of each schedule."""
    results: dict[str, Any] = {}
    for schedule in SCHEDULES:
        for lr_schedule in LR_SCHEDULES:
            results[f"{schedule}/{lr_schedule}"] = run_case(schedule, lr_schedule, f"{root}/{schedule}-{lr_schedule}")
    for schedule in ("epoch", "step", "global_batch"):
        full_root = f"{root}/{schedule}-full"
        full = run_case(schedule, "cosine", full_root, save_every_step=True)
        mid = resume_step(full)
        checkpoint = f"{full_root}/ckpt/s{mid}.ckpt"
        resumed = run_case(schedule, "cosine", f"{root}/{schedule}-resumed", resume_from=checkpoint)
        results[f"{schedule}/resume"] = {"full": full, "resumed": resumed, "resumed_at": mid}
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        results["step/fsdp"] = run_case("step", "cosine", f"{root}/step-fsdp", fsdp=True)
    return results


def resume_step(full: dict[str, Any]) -> int:
    """The first optimizer step from the middle of the fit on that falls inside an epoch (a mid-epoch checkpoint)."""
    steps = full["steps"]
    return next(i for i in range(len(steps) // 2, len(steps)) if steps[i]["epoch"] == steps[i - 1]["epoch"])


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    results = run_all(str(out_dir / "runs"))
    rank = int(os.environ.get("RANK", "0"))
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    if torch.distributed.is_initialized():  # an orderly end: a group torn down at interpreter exit can abort a rank
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
