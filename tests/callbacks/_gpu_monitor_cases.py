"""GPUMonitor scenarios: a slow loader, a recording logger, a driver that scripts time, and the 2-process run.

Run under torchrun (`python -m torch.distributed.run --nproc-per-node=2 _gpu_monitor_cases.py OUT node`, or two
launches with `--nnodes=2 --nproc-per-node=1 --node-rank=K ... OUT nodes`), every rank installs a fake NVML of two
GPUs whose utilization tells its node, fits on CPU with `GPUMonitor(device_indices=[...])` and writes
OUT/rank<k>.json: whether it sampled, its NVML calls, the metrics its logger received and the warnings it raised.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _fake_nvml import FakeClock, FakeGPU, FakeNVML
from _tiny import TinyRegression
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, Dataset

from lightning_accel.callbacks.gpu_monitor import GPUMonitor
from lightning_accel.errors import LightningAccelWarning

BATCHES_PER_EPOCH = 10


class Data(Dataset):
    """Random regression pairs; `sleep_s` per sample makes a slow loader (a straggler)."""

    def __init__(self, length: int, sleep_s: float = 0.0) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(length, 4, generator=gen), torch.randn(length, 1, generator=gen)
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.x[index], self.y[index]


def loader(batches: int = BATCHES_PER_EPOCH, sleep_s: float = 0.0) -> DataLoader:
    return DataLoader(Data(2 * batches, sleep_s), batch_size=2)


class RecordingLogger(Logger):
    """Keeps every `log_metrics` call as (step, metrics)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def at(self, step: int) -> dict[str, float]:
        """Everything logged at `step`, merged."""
        merged: dict[str, float] = {}
        for logged_step, metrics in self.records:
            if logged_step == step:
                merged.update(metrics)
        return merged


def dt(sample: int) -> float:
    """Scripted seconds between readings: 0.5, 0.25, 0.5, 0.25, ... (irregular on purpose)."""
    return 0.5 if sample % 2 == 0 else 0.25


class Driver(pl.Callback):
    """Before GPUMonitor's hook: moves the fake clock on and takes one reading, after every training batch."""

    def __init__(self, clock: FakeClock, monitor: GPUMonitor) -> None:
        self.clock, self.monitor = clock, monitor
        self.samples = 0
        self.sampled_on: list[bool] = []
        self.own_group: list[bool] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.sampled_on.append(self.monitor.sampler is not None)
        self.own_group.append(self.monitor._own_group)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.clock.advance(dt(self.samples))
        self.samples += 1
        if self.monitor.sampler is not None:
            self.monitor.sampler.sample_once()


def node_gpus(node: int) -> list[FakeGPU]:
    """Two GPUs whose utilization names the node and the GPU: 10 + 40 x node + 20 x index."""
    return [FakeGPU(f"GPU-{node}{index}aaaaaa", utilization=10.0 + 40 * node + 20 * index) for index in range(2)]


def run_distributed(out: Path, topology: str) -> dict[str, Any]:
    import lightning_accel.callbacks.gpu_monitor as gpu_monitor
    import lightning_accel.telemetry.nvml as nvml

    if topology == "nodes":  # as under NCCL: the gather gets a gloo group of its own, destroyed at teardown
        gpu_monitor._cpu_group = lambda: (torch.distributed.new_group(backend="gloo"), True)

    node = int(os.environ.get("GROUP_RANK", "0"))
    rank = int(os.environ["RANK"])
    clock = FakeClock()
    fake = FakeNVML(node_gpus(node), clock=clock)
    nvml.pynvml = fake
    GPUMonitor._clock = staticmethod(clock)
    GPUMonitor._threaded = False
    indices = [0, 1] if topology == "node" else [0]  # explicit: there is no CUDA here
    monitor = GPUMonitor(
        device_indices=indices,
        warmup_steps=5,
        report_dir=out / "report",
        print_report=False,
        max_rank_skew_pct=20.0,
        low_utilization_pct=None,
    )
    driver, recorder = Driver(clock, monitor), RecordingLogger()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2 if topology == "node" else 1,
        num_nodes=1 if topology == "node" else 2,
        strategy="ddp",
        max_steps=15,
        log_every_n_steps=5,
        callbacks=[driver, monitor],
        logger=[recorder],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    sleep_s = 0.015 if rank == 1 else 0.0  # rank 1 waits 30 ms per batch for data: the straggler
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyRegression(), DataLoader(Data(40, sleep_s), batch_size=2))
    return {
        "rank": rank,
        "node": node,
        "local_rank": trainer.local_rank,
        "global_step": trainer.global_step,
        "sampled": any(driver.sampled_on),
        "own_group": all(driver.own_group),
        "nvml_inits": fake.inits,
        "nvml_calls": sum(fake.calls.values()),
        "records": recorder.records,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, LightningAccelWarning)],
    }


if __name__ == "__main__":
    out_dir, topology = Path(sys.argv[1]), sys.argv[2]
    result = run_distributed(out_dir, topology)
    (out_dir / f"rank{result['rank']}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():  # an orderly end: a group torn down at interpreter exit can abort a rank
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
