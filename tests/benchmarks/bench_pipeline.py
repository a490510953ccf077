"""The measured pipeline bubble of each schedule at pp=2 against the ideal; a benchmark: it measures, asserts nothing.

The GPT example (deep and narrow by default here) is timed for one optimizer step's forward and backward over a batch
of m micro-batches, first the whole model in one process (T1, the micro-batches one after another, so both runs do
the same arithmetic on the same shapes; timed on both ranks at once, just before each pipeline run, so that it meets
the same cores and load), then split into stages exactly as `strategy=pipeline` splits it, on 2 processes under each
schedule (T2). A perfect 2-stage pipeline takes T1 / 2; the rest is the bubble (stages idling while the pipeline
fills and drains) plus the activation sends: measured bubble = 1 - (T1 / 2) / T2. The CPU load average is printed
too: other processes on the machine inflate both; each time is the fastest of `--steps` steps, the one least
disturbed by them. `idle` is measured inside the pipeline instead: the share of the timed steps in which a rank's
stages were not computing a forward, backward or weight-gradient chunk (waiting for a neighbour or sending),
averaged over the ranks; it needs no one-process baseline. Beside them, the schedule's ideal bubble with free
communication: (p - 1) / (m + p - 1) for GPipe and 1F1B, (p - 1) / (v m + p - 1) for interleaved 1F1B with v stages
per rank (looped BFS too), about 0 for the zero-bubble schedules. Each rank runs with one thread, so the two
processes are two workers on two cores.

Run:
    python tests/benchmarks/bench_pipeline.py [--steps N] [--warmup N] [--microbatches 4,8] [--schedules a,b]
           [--layers N] [--width N] [--batch N] [--seq N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_accel import examples
from lightning_accel.strategies.pipeline import plan_pipeline_stages, prune_to_stages, schedule_spec, stage_ranks


def make(args: argparse.Namespace) -> examples.GPTLanguageModel:
    torch.manual_seed(0)
    return examples.GPTLanguageModel(block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.width)


def batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def time_single(args: argparse.Namespace, n_micro: int) -> float:
    """Seconds per forward + backward of the whole batch in one process, cut into the same micro-batches (fastest)."""
    torch.set_num_threads(1)
    model = make(args)
    x, y = batch(args)
    times = []
    for step in range(args.warmup + args.steps):
        started = time.perf_counter()
        for xs, ys in zip(x.chunk(n_micro), y.chunk(n_micro), strict=True):
            (model.pipeline_loss(model(xs), ys) / n_micro).backward()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
    return min(times)


class BusyClock:
    """Seconds this rank's stages spend computing (forward, backward, weight-gradient chunks), the rest being idle."""

    METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, stages: list) -> None:
        self.seconds = 0.0
        for stage in stages:
            for name in self.METHODS:
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return timed


def time_pipeline(args: argparse.Namespace, schedule: str, n_micro: int) -> tuple[float, float]:
    """Seconds per `schedule.step` over the whole batch on this rank (fastest), the stages as PipelineStrategy cuts,
    and the share of all timed steps this rank's stages were computing."""
    from torch.distributed.pipelining import PipelineStage

    rank, world = dist.get_rank(), dist.get_world_size()
    spec = schedule_spec(schedule)
    model = make(args)
    plan = plan_pipeline_stages(args.layers, block_list="blocks", n_stages=world * spec.stages_per_rank)
    ranks = stage_ranks(plan.n_stages, world, spec.placement)
    local = [s for s, r in enumerate(ranks) if r == rank]
    views = prune_to_stages(model, plan, local)
    stages = [PipelineStage(v, s, plan.n_stages, torch.device("cpu")) for s, v in zip(local, views, strict=True)]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return model.pipeline_loss(out, target) / n_micro

    pipe = spec.schedule_class(
        stages[0] if spec.single_stage else stages, n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=False
    )
    x, y = batch(args)
    first, last = 0 in local, plan.n_stages - 1 in local
    clock = BusyClock(stages)
    times, busy = [], 0.0
    for step in range(args.warmup + args.steps):
        dist.barrier()
        clock.seconds = 0.0
        started = time.perf_counter()
        pipe.step(*((x,) if first else ()), target=y if last else None)
        elapsed = time.perf_counter() - started
        dist.barrier()
        if step >= args.warmup:
            times.append(elapsed)
            busy += clock.seconds
        model.zero_grad(set_to_none=True)
    return min(times), busy / sum(times)


ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


def ideal_bubble(schedule: str, pp: int, n_micro: int) -> float:
    """The idle share of a step with free communication and equal stage times; 0 for the zero-bubble schedules,
    which fill the gaps with weight-gradient work once there are enough micro-batches."""
    if schedule in ZERO_BUBBLE:
        return 0.0
    per_rank = schedule_spec(schedule).stages_per_rank
    return (pp - 1) / (per_rank * n_micro + pp - 1)


def rank_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {}
    for schedule in args.schedules.split(","):
        for n_micro in (int(m) for m in args.microbatches.split(",")):
            # the whole model on both ranks at once, just before: the same cores under the same load as the pipeline
            dist.barrier()
            single = time_single(args, n_micro)
            fastest, busy = time_pipeline(args, schedule, n_micro)
            shares = [torch.zeros(()) for _ in range(dist.get_world_size())]
            dist.all_gather(shares, torch.tensor(busy))
            results[f"{schedule}/{n_micro}"] = (single, fastest, sum(float(b) for b in shares) / len(shares))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--microbatches", default="4,8")
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)  # set on the ranks of the 2-process launch
    args = parser.parse_args()
    if args.out is not None:
        return rank_main(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            __file__,
            *sys.argv[1:],
            "--out",
            str(out),
        ]
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
        times = json.loads(out.read_text())
    print(
        f"GPT n_layer={args.layers} n_embd={args.width}, batch {args.batch} x {args.seq} tokens, CPU gloo, "
        f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
        f"forward+backward per batch, fastest of {args.steps} steps"
    )
    print(
        f"{'schedule':<24}{'micro-batches':>14}{'1 proc ms':>11}{'ideal ms':>10}{'pp=2 ms':>10}{'speedup':>9}"
        f"{'bubble':>9}{'idle':>7}{'ideal bubble':>14}"
    )
    for key, (one, seconds, busy) in times.items():
        schedule, n_micro = key.split("/")
        measured = 1 - (one / 2) / seconds
        ideal = ideal_bubble(schedule, 2, int(n_micro))
        print(
            f"{schedule:<24}{n_micro:>14}{one * 1e3:>11.1f}{one * 1e3 / 2:>10.1f}{seconds * 1e3:>10.1f}"
            f"{one / seconds:>8.2f}x{measured:>9.1%}{1 - busy:>7.1%}{ideal:>14.1%}"
        )


if __name__ == "__main__":
    main()
