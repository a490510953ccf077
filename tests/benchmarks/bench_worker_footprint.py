"""A DataLoader worker's own footprint: what the memory check measures before launch against real workers in a fit.

accel-train's memory check (and the DataLoaderTuner's guard) counts each worker's own memory, beside the batches it
holds, against the cgroup's limit: `measure_worker_bytes` starts one worker from the launching process and reads its
unique set size (USS, the pages only it holds, which its cgroup is charged for). This benchmark takes that figure in
a process set up as accel-train's is when it checks (torch and Lightning imported, nothing built yet), then trains
the GPT example on the standard-library text with `--workers` workers in the same process and reads every worker's
USS at `--samples` points of the fit. It prints both, and the real workers' largest USS over the measured one: the
measured figure bounds them when the ratio is at most 1. The measured worker runs a full garbage collection before
each reading, which copies the pages of every Python object the parent holds (the most a forked worker comes to
hold); workers that never run one hold much less.

A benchmark: it measures and prints, it asserts nothing.

Run:
    python tests/benchmarks/bench_worker_footprint.py [--workers 2] [--steps 60] [--samples 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import warnings

import lightning.pytorch as pl
import psutil
import torch

from lightning_accel.system.loader_memory import WORKER_BYTES, measure_worker_bytes

MIB = 2**20


class WorkerUss(pl.Callback):
    """Every DataLoader worker's USS (children of this process), read at `samples` evenly spaced training steps."""

    def __init__(self, steps: int, samples: int) -> None:
        self.at = {max(1, round(steps * (i + 1) / (samples + 1))) for i in range(samples)}
        self.readings: dict[int, list[int]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step not in self.at:
            return
        for child in psutil.Process().children(recursive=True):
            try:
                self.readings.setdefault(child.pid, []).append(child.memory_full_info().uss)
            except psutil.Error:
                continue


def main(args: argparse.Namespace) -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    from lightning_accel.examples import GPTLanguageModel, StdlibTextDataModule

    start = time.perf_counter()
    measured = measure_worker_bytes()
    took = time.perf_counter() - start
    parent = psutil.Process().memory_full_info()
    print(
        f"torch {torch.__version__}, lightning {pl.__version__}, start method "
        f"{torch.multiprocessing.get_start_method()}; launching process RSS {parent.rss / MIB:.0f} MiB, "
        f"USS {parent.uss / MIB:.0f} MiB; load average {os.getloadavg()[0]:.1f}"
    )
    if measured is None:
        print(f"measure_worker_bytes: no figure here (the check assumes {WORKER_BYTES / MIB:.0f} MiB)")
        return
    print(f"measured before launch: {measured / MIB:.1f} MiB per worker, in {took:.2f} s")

    pl.seed_everything(0, verbose=False)
    data = StdlibTextDataModule(num_workers=args.workers, persistent_workers=True)
    model = GPTLanguageModel()
    probe = WorkerUss(args.steps, args.samples)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data)
    largest = 0
    for pid, readings in sorted(probe.readings.items()):
        largest = max(largest, *readings)
        shown = ", ".join(f"{r / MIB:.1f}" for r in readings)
        print(f"worker pid {pid}: USS {shown} MiB over the fit")
    if not probe.readings:
        print("no worker was seen during the fit")
        return
    print(
        f"real workers' largest USS {largest / MIB:.1f} MiB = {largest / measured:.2f} x the measured "
        f"{measured / MIB:.1f} MiB (the assumption it replaces: {WORKER_BYTES / MIB:.0f} MiB)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers of the fit")
    parser.add_argument("--steps", type=int, default=60, help="training steps of the fit")
    parser.add_argument("--samples", type=int, default=3, help="points of the fit at which workers are read")
    main(parser.parse_args())
