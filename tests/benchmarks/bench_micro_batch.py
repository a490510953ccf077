"""MicroBatchFinder's micro-batch against hand-chosen safe ones under the same memory budget; a benchmark: it measures
and prints, asserting nothing but that every run made the same update.

A model too large to train the loader's batch of `--batch` whole: a memory budget (the CPU seam of the tests, raising
torch's `OutOfMemoryError`) lets at most `--fits` samples through one forward. Each configuration trains the same
samples in the same order for `--steps` optimizer steps of `--batch` samples:

- `auto`: the loader's batch of `--batch` with `MicroBatchFinder()`, whose first batch runs whole, runs out of
  memory and is halved until it fits (the size every batch after it starts from);
- `hand N`: what a user does by hand to be safe: a loader batch of N and `accumulate_grad_batches = batch / N` (the
  smallest micro-batch that surely fits is 1; `--hand` lists the sizes to time).

Rounds are interleaved (every configuration once per round, in turn), the first `--warmup` steps of each run are not
timed, and each figure is the median over `--rounds` with its interval. The weights after the last step must equal
between the configurations (1e-4): the same update, micro-batched differently.

Run:
    python tests/benchmarks/bench_micro_batch.py [--batch 256] [--fits 48] [--steps 12] [--rounds 5]
        [--hand 1 4 16] [--width 1024]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _memory_budget import MemoryBudget  # noqa: E402

from lightning_accel.callbacks import MicroBatchFinder  # noqa: E402
from lightning_accel.measure import interleaved, summarize  # noqa: E402


class Wide(pl.LightningModule):
    """An MLP of `width` hidden units per layer on `features` inputs, behind a memory budget of samples."""

    def __init__(self, budget: MemoryBudget, features: int, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.budget = budget
        self.net = nn.Sequential(
            nn.Linear(features, width),
            nn.GELU(),
            nn.Linear(width, width),
            nn.GELU(),
            nn.Linear(width, width),
            nn.GELU(),
            nn.Linear(width, 1),
        )
        self.step_times: list[float] = []  # zero_grad to zero_grad: one optimizer step each
        self._started = 0.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.budget.check(x)
        return nn.functional.mse_loss(self.net(x), y)

    def on_before_zero_grad(self, optimizer: Any) -> None:  # once per optimizer step, at its start
        now = time.perf_counter()
        if self._started:
            self.step_times.append(now - self._started)
        self._started = now

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)


def run(name: str, args: argparse.Namespace, data: TensorDataset, root: str) -> dict[str, Any]:
    budget = MemoryBudget(limit_bytes=args.fits, bytes_per_token=1)
    budget.cost = lambda x: int(x.shape[0])  # type: ignore[method-assign]  # one unit per sample
    model = Wide(budget, data.tensors[0].shape[1], args.width)
    if name == "auto":
        finder = MicroBatchFinder()
        loader, callbacks, accumulate = DataLoader(data, batch_size=args.batch), [finder], 1
    else:
        size = int(name.split()[1])
        finder = None
        loader, callbacks, accumulate = DataLoader(data, batch_size=size), [], args.batch // size
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=root,
    )
    started = time.perf_counter()
    trainer.fit(model, loader)
    wall = time.perf_counter() - started
    timed = model.step_times[args.warmup :]
    return {
        "micro_batch": finder.found if finder is not None else int(name.split()[1]),
        "samples_per_s": args.batch * len(timed) / sum(timed),
        "wall_s": wall,
        "sizing_steps": None if finder is None else len(finder.sizing),
        "ooms": budget.ooms,
        "weights": torch.cat([p.detach().flatten() for p in model.parameters()]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256, help="the loader's batch, samples per optimizer step")
    parser.add_argument("--fits", type=int, default=48, help="the most samples one forward may take (the budget)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps of each run not timed")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each configuration, interleaved")
    parser.add_argument("--hand", type=int, nargs="+", default=[1, 4, 16], help="hand-chosen micro-batches")
    parser.add_argument("--width", type=int, default=1024, help="hidden units per layer")
    parser.add_argument("--features", type=int, default=256)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    gen = torch.Generator().manual_seed(1)
    samples = args.batch * args.steps
    data = TensorDataset(torch.randn(samples, args.features, generator=gen), torch.randn(samples, 1, generator=gen))
    names = ["auto", *(f"hand {n}" for n in args.hand)]
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPU(s), torch {torch.__version__}, threads "
        f"{torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}; batch {args.batch}, budget {args.fits} "
        f"samples per forward, {args.steps} steps ({args.warmup} untimed), {args.rounds} rounds, width "
        f"{args.width}"
    )
    with TemporaryDirectory() as root:
        for _round, name in interleaved(names, args.rounds):
            results[name].append(run(name, args, data, root))
    reference = results["auto"][0]["weights"]
    auto = summarize([r["samples_per_s"] for r in results["auto"]])
    print(
        f"{'configuration':>16} | micro-batch | samples/s median [interval] | vs auto | fit wall s (median) | "
        "sizes tried | same update"
    )
    for name in names:
        rates = summarize([r["samples_per_s"] for r in results[name]])
        same = all(torch.allclose(r["weights"], reference, rtol=1e-4, atol=1e-4) for r in results[name])
        trials = results[name][0]["sizing_steps"]
        wall = summarize([r["wall_s"] for r in results[name]]).median
        print(
            f"{name:>16} | {results[name][0]['micro_batch']:>11} | {rates.median:>10,.0f} [{rates.low:,.0f}, "
            f"{rates.high:,.0f}] | {rates.median / auto.median:>6.2f}x | {wall:>19.2f} | "
            f"{'-' if trials is None else trials:>11} | {'yes' if same else 'NO'}"
        )
    print(f"load at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
