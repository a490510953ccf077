"""torch.compile on the GPT example: compile time against steady-state speedup; a benchmark: it measures and prints.

For eager and each `--modes` entry, the GPT example (`--layers`, `--embd`, `--block`, batch `--batch`) trains
`--steps` optimizer steps on random bytes in a fresh Trainer with the `Compile` callback; the first `--warmup` steps
(where inductor compiles) are timed apart as the compile cost, the rest as the steady state. Rounds are interleaved
(`--rounds`); figures are medians with intervals. The break-even is how many steady steps the compile time takes to
pay back. Each run is a fresh interpreter with an empty inductor cache directory, so the compile cost is a cold one,
as a new job on a new machine pays it.

Run:
    python tests/benchmarks/bench_compile.py [--modes default max-autotune] [--steps 40] [--rounds 3]
        [--layers 2] [--embd 128] [--block 128] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_accel.callbacks import Compile  # noqa: E402
from lightning_accel.examples import GPTLanguageModel  # noqa: E402
from lightning_accel.measure import interleaved, summarize  # noqa: E402


class _Clock(pl.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())


def run(mode: str, args: argparse.Namespace) -> dict[str, float]:
    torch._dynamo.reset()  # each run compiles afresh: dynamo's cache of earlier runs' models would hit its recompile
    pl.seed_everything(0, verbose=False)  # limit and fall back to eager without a word
    data = torch.randint(0, 256, (args.steps * args.batch, args.block + 1), generator=torch.Generator().manual_seed(0))
    pairs = list(zip(data[:, :-1], data[:, 1:], strict=True))
    model = GPTLanguageModel(block_size=args.block, n_layer=args.layers, n_head=4, n_embd=args.embd)
    clock = _Clock()
    extra = [] if mode == "eager" else [Compile(mode=mode)]
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # cold: nothing compiled before
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=args.steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[*extra, clock],
            limit_val_batches=0,
        )
        started = time.perf_counter()
        trainer.fit(model, torch.utils.data.DataLoader(pairs, batch_size=args.batch))
    steps = [b - a for a, b in zip([started, *clock.ends], clock.ends, strict=False)]
    warm, steady = steps[: args.warmup], steps[args.warmup :]
    return {"first_s": sum(warm), "step_s": summarize(steady).median}


def run_cold(mode: str, args: argparse.Namespace) -> dict[str, float]:
    """`run` in a fresh interpreter: a cold compile, as a new job has (no kernels or graphs of earlier runs)."""
    argv = [
        sys.executable,
        __file__,
        "--one",
        mode,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--layers",
        str(args.layers),
        "--embd",
        str(args.embd),
        "--block",
        str(args.block),
        "--batch",
        str(args.batch),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)  # one run in this process; its figures as JSON
    parser.add_argument("--modes", nargs="+", default=["default", "max-autotune"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3, help="first steps counted as compile cost")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if args.one:
        print(json.dumps(run(args.one, args)))
        return
    names = ["eager", *args.modes]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPU(s), torch {torch.__version__}, threads "
        f"{torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}; GPT {args.layers}x{args.embd}, block "
        f"{args.block}, batch {args.batch}, {args.steps} steps ({args.warmup} as compile), "
        f"{args.rounds} rounds"
    )
    for _round, name in interleaved(names, args.rounds):
        results[name].append(run_cold(name, args))
    eager = summarize([r["step_s"] for r in results["eager"]]).median
    eager_first = summarize([r["first_s"] for r in results["eager"]]).median
    print(f"{'mode':>14} | first {args.warmup} steps s | steady s/step median [interval] | speedup | break-even steps")
    for name in names:
        first = summarize([r["first_s"] for r in results[name]])
        step = summarize([r["step_s"] for r in results[name]])
        saved = eager - step.median
        extra = first.median - eager_first
        even = "-" if name == "eager" else (f"{extra / saved:.0f}" if saved > 0 else "never")
        print(
            f"{name:>14} | {first.median:>18.1f} | {step.median:.4f} [{step.low:.4f}, {step.high:.4f}] | "
            f"{eager / step.median:>6.2f}x | {even:>16}"
        )
    print(f"load at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
