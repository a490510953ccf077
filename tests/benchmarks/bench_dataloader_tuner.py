"""DataLoaderTuner on the example models: tuning time against one epoch, and the epoch's speedup over num_workers=0.

For each case one epoch is trained from the same seed with the DataModule's loader as shipped (`num_workers=0`),
then with a `DataLoaderTuner`, which rebuilds the train loader with the settings it finds before the epoch; the pair
is repeated `--repeats` times (the first tuner tunes, later ones find its decision in a throw-away cache) and the
fastest epoch of each kind counts. Reported: the choice, the tuning time and a cache hit's, both epoch times (tuning
excluded), tuning as a share of one epoch, the epoch speedup, and the load average around the case (the machine may
be shared). A benchmark: it measures and prints, it asserts nothing.

Cases: `gpt` (GPTLanguageModel on StdlibTextDataModule, 1,098 steps), `digits` (DigitsClassifier on
DigitsDataModule, 19 steps; needs scikit-learn), and `gpt-latency`: the GPT case with a simulated 2 ms storage
latency per window (a dataset that waits on I/O), its epoch cut to `--latency-batches` batches.

`io-busy` (the tuner's criterion: >= 80% of the sweep's best) is run alone: `--runs` tunings of an I/O-bound dataset (3
ms sleep per item, the tests' SleepyDataset) while `--busy` CPU-bound processes (1 unless told) that are not ours run
beside them; after each, the tests' Referee times every worker count 0..8 and the choice under the same load, in
`--sweep-rounds` interleaved rounds, and takes each setting's median. Printed per run: the choice, its share of the
sweep's best median (with the paired rounds' range), whether the tuner flagged interference, the sweep's spread; then
how many runs reached 80%.

Run:
    python tests/benchmarks/bench_dataloader_tuner.py [--cases gpt digits gpt-latency] [--repeats 2] [--threads N]
        [--max-tuning-time-s 60] [--latency-batches 300] [--table]
    python tests/benchmarks/bench_dataloader_tuner.py --cases io-busy [--runs 10] [--max-tuning-time-s 30]
        [--sweep-rounds 3] [--busy 1] [--dataset io|cpu]

The tests keep the tuner's decisions (more workers than CPUs for I/O, both 0 and the CPU count timed for CPU work); the
share-of-best figures, which need the machine to themselves, are this benchmark's: `--busy 0` on a quiet machine (the
I/O-bound choice at >= 90% of the best), `--busy 1` (>= 80% beside a busy process), `--dataset cpu --busy 0` (>= 90%,
or the paired rounds reaching it).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_accel.callbacks.dataloader_tuner import DataLoaderTuner
from lightning_accel.examples import DigitsClassifier, DigitsDataModule, GPTLanguageModel, StdlibTextDataModule
from lightning_accel.system import read_cpu_budget, read_cpu_info
from lightning_accel.tuning.dataloader.loader_settings import LoaderSettings


class EpochTimer(pl.Callback):
    """Wall time of the first training epoch (after any tuning at fit start)."""

    def __init__(self) -> None:
        self.start = self.seconds = 0.0
        self.steps = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seconds, self.steps = time.perf_counter() - self.start, trainer.global_step


class _Latency(Dataset):
    """Another dataset's items, each after `delay_s` of waiting (a read from network storage)."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        time.sleep(self.delay_s)
        return self.inner[index]


class LatencyTextDataModule(StdlibTextDataModule):
    def __init__(self, delay_s: float = 0.002, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.delay_s = delay_s

    def train_dataloader(self) -> DataLoader:
        loader = super().train_dataloader()
        return DataLoader(
            _Latency(loader.dataset, self.delay_s),
            batch_size=loader.batch_size,
            shuffle=True,
            drop_last=True,
            generator=loader.generator,
        )


def _case(name: str, latency_batches: int) -> tuple[pl.LightningModule, pl.LightningDataModule, int | float]:
    """Model, data and `limit_train_batches` of a case."""
    if name == "gpt":
        return GPTLanguageModel(), StdlibTextDataModule(), 1.0
    if name == "digits":
        return DigitsClassifier(), DigitsDataModule(), 1.0
    if name == "gpt-latency":
        return GPTLanguageModel(), LatencyTextDataModule(), latency_batches
    raise ValueError(f"unknown case {name!r}; choose from gpt, digits, gpt-latency")


def one_epoch(name: str, tuner: DataLoaderTuner | None, latency_batches: int) -> EpochTimer:
    L.seed_everything(0, verbose=False)
    model, data, limit = _case(name, latency_batches)
    timer = EpochTimer()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=limit,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer] + ([tuner] if tuner else []),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data)
    return timer


def io_busy(
    runs: int,
    max_tuning_time_s: float,
    table: bool = False,
    sweep_rounds: int = 3,
    busy_processes: int = 1,
    dataset: str = "io",
) -> list[tuple[LoaderSettings, float, bool]]:
    """The tuner's criterion: (choice, share of the sweep's best, flagged) of `runs` tunings of an I/O-bound dataset
    (`dataset="io"`; `"cpu"`: ~20 ms of Python a batch beside a ~8 ms CPU step, where 0, 2 and 8 workers lie close)
    beside `busy_processes` CPU-bound processes that are not ours (started through a shell that exits, so init adopts
    them)."""
    tests = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(tests / "callbacks"), str(tests)]
    import _dataloader_tuner_cases as cases
    from _busy import start_busy_processes, stop_processes

    space = [LoaderSettings(num_workers=w, prefetch_factor=2 if w else None) for w in range(9)]
    bar = 0.8 if busy_processes else 0.9  # the tests' criteria: 80% beside a busy process, 90% on a quiet machine
    busy, results = start_busy_processes(busy_processes), []
    make, fit_kwargs = {
        "io": (lambda: cases.SleepyDataset(delay_s=0.003), {}),
        "cpu": (cases.BusyDataset, {"batch_size": 16, "step_loops": 150_000}),
    }[dataset]
    print(f"io-busy ({dataset}): {runs} runs beside {busy_processes} CPU-bound process(es) (pids {busy})", flush=True)
    try:
        time.sleep(0.5)
        with tempfile.TemporaryDirectory() as root:
            for run in range(runs):
                tuner = DataLoaderTuner(max_tuning_time_s=max_tuning_time_s, use_cache=False, print_table=table)
                referee = cases.Referee(tuner, space, rounds=sweep_rounds)
                load = os.getloadavg()[0]
                cases.fit(make(), [tuner, referee], root, max_steps=2, **fit_kwargs)
                assert tuner.decision is not None and referee.best is not None
                flagged = any(t.flag for t in tuner.trials)
                share, paired, best = referee.share_of_best, referee.share_interval, referee.sweep[referee.best]
                results.append((tuner.decision, share, flagged))
                spread = max(v.relative_width for v in referee.sweep.values())
                print(
                    f"run {run + 1:>2}: chose {tuner.decision.num_workers} workers (prefetch "
                    f"{tuner.decision.prefetch_factor}) in {len(tuner.trials)} trials, {tuner.tuning_time_s:.1f} s; "
                    f"{100 * share:.0f}% of the sweep's best ({referee.best.num_workers} workers, median "
                    f"{best.format('.0f')} samples/s; paired rounds {100 * paired.low:.0f}-{100 * paired.high:.0f}%)"
                    f"; {'>=' if share >= bar else '<'} {100 * bar:.0f}%; "
                    f"interference flagged: {'yes' if flagged else 'no'};"
                    f" widest sweep spread {100 * spread:.0f}% of its median; load {load:.1f}",
                    flush=True,
                )
                print(f"        {referee.summary()}", flush=True)
    finally:
        stop_processes(busy)
    reached, choices = sum(share >= bar for _, share, _ in results), [d.num_workers for d, _, _ in results]
    print(
        f"\nio-busy ({dataset}) beside {busy_processes} busy process(es): {reached} of {len(results)} runs >= "
        f"{100 * bar:.0f}% of the exhaustive sweep's best (its median over {sweep_rounds} interleaved rounds; "
        f"criterion: >= 9 of 10); choices: {choices} workers; flagged under "
        f"interference (not cached): {sum(f for _, _, f in results)} of {len(results)}."
    )
    return results


def main(args: argparse.Namespace) -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    if "io-busy" in args.cases:
        io_busy(args.runs, args.max_tuning_time_s, args.table, args.sweep_rounds, args.busy, args.dataset)
        args.cases = [c for c in args.cases if c != "io-busy"]
        if not args.cases:
            return
    budget = read_cpu_budget()
    print(
        f"machine: {read_cpu_info().model_name or platform.processor()}, {budget.effective} effective CPU(s) "
        f"(affinity {budget.affinity}, quota {budget.quota}); torch {torch.__version__} with "
        f"{torch.get_num_threads()} intra-op threads, lightning {pl.__version__}, python {platform.python_version()}"
    )
    header = (
        f"{'case':<12} {'steps':>5}  {'choice':<23} {'tuning s':>8} {'cached s':>8} {'epoch s, 0 workers':>18} "
        f"{'epoch s, tuned':>14} {'tuning/epoch':>12} {'speedup':>7} {'in trials':>9}  load avg"
    )
    rows = []
    for name in args.cases:
        load = os.getloadavg()[0]
        base, tuned, tuners = [], [], []
        with tempfile.TemporaryDirectory() as cache:
            for repeat in range(args.repeats):  # alternated, so a burst of load from other jobs hits both sides
                base.append(one_epoch(name, None, args.latency_batches))
                tuner = DataLoaderTuner(
                    max_tuning_time_s=args.max_tuning_time_s,
                    force=repeat == 0,
                    cache_dir=cache,
                    print_table=args.table and repeat == 0,
                )
                tuned.append(one_epoch(name, tuner, args.latency_batches))
                tuners.append(tuner)
        first, tuning = tuners[0], [t.tuning_time_s for t in tuners]
        zero = next((t for t in first.trials if t.settings.num_workers == 0 and t.steps), None)
        chosen = next((t for t in first.trials if t.settings == first.decision and t.status == "done"), None)
        in_trials = chosen.samples_per_s / zero.samples_per_s if chosen and zero else float("nan")
        d = first.decision
        choice = "unchanged" if d is None else f"workers={d.num_workers} prefetch={d.prefetch_factor}"
        base_s, tuned_s = min(t.seconds for t in base), min(t.seconds for t in tuned)
        cached = min(tuning[1:]) if len(tuning) > 1 else float("nan")
        rows.append(
            f"{name:<12} {base[0].steps:>5}  {choice:<23} {tuning[0]:>8.1f} {cached:>8.2f} {base_s:>18.1f} "
            f"{tuned_s:>14.1f} {100 * tuning[0] / base_s:>11.0f}% {base_s / tuned_s:>6.2f}x {in_trials:>8.2f}x"
            f"  {load:.1f}-{os.getloadavg()[0]:.1f}"
        )
        print(rows[-1], flush=True)
    print(
        f"\nepoch times: the fastest of {args.repeats} (0 workers and tuned alternated); tuning s: the first fit's;"
        " cached s: a later fit's, which found the decision in the cache; speedup: epoch 0 workers / epoch tuned;"
        " in trials: the chosen setting's samples/s over 0 workers' in the tuner's own trials.\n"
    )
    print(header)
    print("\n".join(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["gpt", "digits", "gpt-latency"])
    parser.add_argument("--max-tuning-time-s", type=float, default=60.0)
    parser.add_argument("--latency-batches", type=int, default=300, help="batches of the gpt-latency epoch")
    parser.add_argument("--repeats", type=int, default=2, help="epochs of each kind; the fastest counts")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0: torch's default")
    parser.add_argument("--table", action="store_true", help="print the tuner's table of trials")
    parser.add_argument("--runs", type=int, default=10, help="tunings of the io-busy case")
    parser.add_argument("--sweep-rounds", type=int, default=3, help="interleaved rounds of the io-busy sweep")
    parser.add_argument("--busy", type=int, default=1, help="CPU-bound processes beside the io-busy case (0: quiet)")
    parser.add_argument(
        "--dataset",
        choices=["io", "cpu"],
        default="io",
        help="the io-busy case's dataset: io (a sleep per item) or cpu (Python work per item, a CPU step)",
    )
    main(parser.parse_args())
