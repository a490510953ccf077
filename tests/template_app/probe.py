"""A callback the template-app tests add (`+callbacks.probe`): what each rank really ran, as JSON.

Per rank: world size, strategy, precision, torch's float32 matmul precision inside training, the accumulation, and
for every optimizer step the learning rate it used and the samples it took on this rank (so the test sees the global
batch, the LR curve and the epochs, not what a config says).
"""

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch


class Probe(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path = path
        self.steps: list[dict] = []
        self._samples = 0
        self._matmul = ""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._matmul = torch.get_float32_matmul_precision()
        self._lr = trainer.optimizers[0].param_groups[0]["lr"]
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        first = batch[0] if isinstance(batch, (list, tuple)) else batch
        self._samples += len(first)
        if trainer.global_step > self._step:  # the optimizer stepped on this batch
            self.steps.append(
                {"step": self._step, "lr": self._lr, "samples": self._samples, "epoch": trainer.current_epoch}
            )
            self._samples = 0

    def on_train_end(self, trainer, pl_module):
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "pid": os.getpid(),
            "strategy": type(trainer.strategy).__name__,
            "precision": str(trainer.precision),
            "float32_matmul_precision": self._matmul,
            "global_step": trainer.global_step,
            "epochs": trainer.current_epoch,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "callbacks": sorted(type(c).__name__ for c in trainer.callbacks),
            "steps": self.steps,
        }
        Path(self.path).mkdir(parents=True, exist_ok=True)
        (Path(self.path) / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
