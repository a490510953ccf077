"""MicroBatchFinder on 2 DDP ranks (gloo, CPU), run by tests/callbacks/test_micro_batch_finder.py under torchrun.

Each rank trains `BudgetedModel` on its half of 640 samples (batches of 32, so a global batch of 64) for 20 optimizer
steps, twice in the same process group:

- `oom`: under a budget of 4 samples per forward; rank 1 alone runs out of memory once at step 5;
- `peak`: no out-of-memory error, but a simulated CUDA peak (the test's `_FakeMeter`: 1000 B plus 100 B per sample)
  against a budget of 2000 B on rank 0 and 1500 B on rank 1, so rank 0 alone would take 8 and rank 1 takes 4.

Every rank writes OUT_DIR/rank<k>.json: for each fit, its final weights, the micro-batch found and run, its sizing
steps and its recoveries.
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
from test_micro_batch_finder import BudgetedModel, _FakeMeter, budget_for, loader
from torch.utils.data import DataLoader, DistributedSampler

from lightning_accel.callbacks import MicroBatchFinder, micro_batch


def run(out: Path, rank: int, model: BudgetedModel) -> dict[str, Any]:
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
    return {
        "weights": {name: value.flatten().tolist() for name, value in model.state_dict().items()},
        "found": finder.found,
        "size": finder.size,
        "sizing": [[t.size, t.fits, t.peak_bytes] for t in finder.sizing],
        "recoveries": finder.oom_recoveries,
        "steps": trainer.global_step,
        "pieces": model.pieces,
    }


def main(out: Path) -> None:
    warnings.filterwarnings("ignore")
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    result = {"oom": run(out, rank, BudgetedModel(budget_for(4), oom_at_steps=(5,) if rank == 1 else ()))}
    budget = 2000 if rank == 0 else 1500
    micro_batch._cuda_meter = lambda trainer, module, params, fraction: _FakeMeter(module, budget)  # type: ignore
    result["peak"] = run(out, rank, BudgetedModel())
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
