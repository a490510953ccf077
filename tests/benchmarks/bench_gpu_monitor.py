"""Step time of a small model with no monitor, with GPUMonitor (fake NVML, interval_s=0.1) and with DeviceStatsMonitor.

Run: `python tests/benchmarks/bench_gpu_monitor.py [--reps 9] [--steps 300] [--threads 1]`. Each repetition fits the
same model once per configuration, back to back, the order rotating between repetitions so no configuration always
runs first; a fit's step time is the mean interval between training batch ends after `--warmup` steps (logging steps
included, where the monitors do their work; Lightning's default `log_every_n_steps=50`, a CSVLogger for all three).
Prints each configuration's median step time over the repetitions, the overhead of the medians, and the median of
the per-repetition overheads (each against the no-monitor fit of the same repetition, which cancels slow drifts in
the machine's load). The fake NVML answers in Python, holding the GIL, so the sampler thread costs the training
thread more here than the real library (ctypes releases the GIL during NVML calls) would.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import DeviceStatsMonitor
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the fake NVML
from _fake_nvml import FakeGPU, FakeNVML  # noqa: E402

import lightning_accel.telemetry.nvml as nvml  # noqa: E402
from lightning_accel.callbacks.gpu_monitor import GPUMonitor  # noqa: E402

BATCH = 64  # samples per step
WIDTH = 256  # hidden width of the MLP (--width)


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepTimer(pl.Callback):
    """Times training batch end to batch end."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())


def fit_once(config: str, steps: int, warmup: int, root: Path, log_every: int = 50) -> tuple[float, float | None]:
    """Mean step time (s) of one fit, and GPUMonitor's own measure of its overhead (%)."""
    timer = StepTimer()
    callbacks: list[pl.Callback] = [timer]
    monitor = None
    if config == "GPUMonitor":
        monitor = GPUMonitor(
            interval_s=0.1, device_indices=[0], report_dir=root / "report", print_report=False, plot=False
        )
        callbacks.append(monitor)
    elif config == "DeviceStatsMonitor":
        callbacks.append(DeviceStatsMonitor())
    elif config == "empty Callback":
        callbacks.append(pl.Callback())  # what any callback costs: Lightning calls every hook of every callback
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(BATCH * steps, 64, generator=gen), torch.randint(0, 10, (BATCH * steps,)))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=callbacks,
        logger=CSVLogger(root, name=config),
        log_every_n_steps=log_every,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    torch.manual_seed(0)
    trainer.fit(MLP(), DataLoader(data, batch_size=BATCH))
    intervals = [b - a for a, b in zip(timer.ends[warmup:], timer.ends[warmup + 1 :], strict=False)]
    overhead = monitor.report.to_dict()["monitor_overhead_pct"] if monitor is not None else None
    return statistics.fmean(intervals), overhead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)  # repetitions of each configuration (the median is reported)
    parser.add_argument("--steps", type=int, default=300)  # training steps per fit
    parser.add_argument("--warmup", type=int, default=50)  # first steps of each fit left out
    parser.add_argument("--threads", type=int, default=1)  # torch intra-op threads (1 is steadier on a busy machine)
    parser.add_argument("--width", type=int, default=256)  # hidden width of the MLP (256: ~2 ms per step here)
    parser.add_argument("--log-every", type=int, default=50)  # Trainer(log_every_n_steps): when monitors log
    parser.add_argument("--empty-callback", action="store_true")  # also time a no-op Callback, any callback's floor
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global WIDTH
    WIDTH = args.width
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    start = time.monotonic()
    nvml.pynvml = FakeNVML(
        [FakeGPU("GPU-bench-0000", utilization=lambda t: 50 + 40 * (int(t) % 2))],
        clock=lambda: time.monotonic() - start,
    )
    configs = ["none", "GPUMonitor", "DeviceStatsMonitor", "empty Callback"][: 4 if args.empty_callback else 3]
    times: dict[str, list[float]] = {c: [] for c in configs}
    own: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for config in configs[rep % len(configs) :] + configs[: rep % len(configs)]:  # rotate the order
                step_s, overhead = fit_once(config, args.steps, args.warmup, Path(tmp) / f"{rep}", args.log_every)
                times[config].append(step_s)
                if overhead is not None:
                    own.append(overhead)
    base = statistics.median(times["none"])
    print(
        f"torch {torch.__version__}, lightning {lightning.__version__}, Python {platform.python_version()}, "
        f"{torch.get_num_threads()} torch threads, {platform.machine()} ({args.reps} reps x {args.steps} steps, "
        f"log_every_n_steps={args.log_every}, MLP width {WIDTH})"
    )
    for config in configs:
        median = statistics.median(times[config])
        paired = statistics.median(t / b - 1 for t, b in zip(times[config], times["none"], strict=True))
        runs = ", ".join(f"{1e3 * t:.3f}" for t in times[config])
        print(
            f"{config:>18}: {1e3 * median:7.3f} ms/step  overhead {100 * (median / base - 1):+6.2f}% of the medians, "
            f"{100 * paired:+6.2f}% median per repetition   [{runs}]"
        )
    print(f"GPUMonitor's own measure of its time on the training thread: {statistics.median(own):.3f}% of the fit")


if __name__ == "__main__":
    main()
