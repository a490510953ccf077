"""Fit a small MLP under the `strategy=ddp` preset on every rank of a torchrun launch; rank k writes OUT/rank<k>.json.

Each rank reads its half of every global batch (DistributedSampler without shuffling), so a single process stepping
on the concatenated batches must end with the same weights.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

STEPS = 6
PER_RANK_BATCH = 4


def data(world: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    n = STEPS * PER_RANK_BATCH * world
    x = torch.randn(n, 8, generator=gen)
    return TensorDataset(x, (x.sum(dim=1, keepdim=True) > 0).float())


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.initial = {k: v.detach().clone() for k, v in self.net.state_dict().items()}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.binary_cross_entropy_with_logits(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net.parameters(), lr=0.5, momentum=0.9)


def ddp_strategy(static_graph: bool) -> pl.strategies.Strategy:
    """The DDPStrategy that `accel-train strategy=ddp` builds."""
    with initialize_config_module(config_module="lightning_accel.conf", version_base="1.3"):
        cfg = compose("train", overrides=["strategy=ddp", f"trainer.strategy.static_graph={static_graph}"])
    return instantiate(cfg.trainer.strategy)


def fit(static_graph: bool, root: str) -> dict[str, Any]:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    model = MLP()
    dataset = data(world)
    loader = DataLoader(
        dataset,
        batch_size=PER_RANK_BATCH,
        sampler=DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False),
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ddp_strategy(static_graph),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        use_distributed_sampler=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader)
    return {
        "strategy": type(trainer.strategy).__name__,
        "gradient_as_bucket_view": trainer.strategy._ddp_kwargs.get("gradient_as_bucket_view"),
        "steps": trainer.global_step,
        "initial": {k: v.tolist() for k, v in model.initial.items()},
        "final": {k: v.tolist() for k, v in model.net.state_dict().items()},
    }


if __name__ == "__main__":
    out = Path(sys.argv[1])
    results = {str(sg): fit(sg, str(out / f"static{sg}")) for sg in (False, True)}
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))
    if torch.distributed.is_initialized():  # an orderly end: a group torn down at interpreter exit can abort a rank
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
