"""MicroBatchFinder on 2 DDP ranks (gloo, CPU), run by tests/callbacks/test_micro_batch_finder.py under torchrun.

Each rank trains `BudgetedModel` under a budget of 4 samples per forward on its half of 640 samples (batches of
32, so a global batch of 64) for 20 optimizer steps; rank 1 alone runs out of memory once at step 5. Every rank
writes OUT_DIR/rank<k>.json: its final weights, the micro-batch found and run, and its recoveries.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from test_micro_batch_finder import BudgetedModel, budget_for, loader
from torch.utils.data import DataLoader, DistributedSampler

from lightning_accel.callbacks import MicroBatchFinder


def main(out: Path) -> None:
    warnings.filterwarnings("ignore")
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    model = BudgetedModel(budget_for(4), oom_at_steps=(5,) if rank == 1 else ())
    finder = MicroBatchFinder(grow_after=None)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=20,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
        callbacks=[finder],
        use_distributed_sampler=False,
    )
    data = loader(640, 32).dataset  # in order: rank r takes samples r, r + 2, ...; a step's 64 are one process's batch
    trainer.fit(model, DataLoader(data, batch_size=32, sampler=DistributedSampler(data, 2, rank, shuffle=False)))
    weights = {name: value.flatten().tolist() for name, value in model.state_dict().items()}
    result = {
        "weights": weights,
        "found": finder.found,
        "size": finder.size,
        "recoveries": finder.oom_recoveries,
        "steps": trainer.global_step,
        "pieces": model.pieces,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
