"""Step time with the heartbeat's alerts on (accel-train's default `callbacks/monitor.yaml`) against the same heartbeat
without them (what the default was before they came), and against no monitor at all.

Run: `python tests/benchmarks/bench_heartbeat_alerts.py [--reps 9] [--steps 1500] [--publish-interval 0.25]`.
Each repetition fits the same small MLP once per configuration, back to back, the order rotating between
repetitions; a fit's step time is the mean interval between training batch ends after `--warmup` steps. The three:
- `none`: no GPUMonitor;
- `heartbeat`: GPUMonitor as `callbacks/monitor.yaml` has it (publish only, `log_metrics: false`), with the heartbeat's
  alerts and card-health reads taken out (`heartbeat_checks` and `health_reader` patched to give none);
- `heartbeat + alerts`: the same GPUMonitor as shipped: throttling, memory headroom, non-finite loss (a NonFiniteGuard
  in the Trainer, in all three configurations), no progress (`hung_after_steps: 10`) and health (XID events, ECC,
  remapped rows, a lost card), each checked on the publisher's thread at each heartbeat.
One scripted card (fake NVML) with memory held, so every reading and check has a card to work on. The heartbeat
comes every `--publish-interval` s (default 0.25: 8x as often as the shipped 2 s, so a fit of a few seconds holds a
dozen). The fake NVML answers in Python, holding the GIL, so the publisher's thread costs the training thread more
here than it would with the real library (ctypes releases the GIL during NVML calls): an upper bound.
Prints each configuration's median step time, and each one's median per-repetition overhead against `none` and
between the two heartbeats (paired within a repetition, which cancels slow drifts in the machine's load), with the
spread of the paired differences (min, max) as the noise they sit in.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import lightning
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_gpu_monitor: the model and the timer
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the fake NVML
import bench_gpu_monitor as base  # noqa: E402
from _fake_nvml import FakeGPU, FakeNVML  # noqa: E402

import lightning_accel.callbacks.gpu_monitor as gpu_monitor  # noqa: E402
import lightning_accel.telemetry.nvml as nvml  # noqa: E402
from lightning_accel.callbacks import GPUMonitor, NonFiniteGuard  # noqa: E402

CONFIGS = ("none", "heartbeat", "heartbeat + alerts")


def fit_once(config: str, steps: int, warmup: int, root: Path, publish_interval_s: float) -> float:
    """Mean step time (s) of one fit."""
    timer = base.StepTimer()
    callbacks: list[pl.Callback] = [timer, NonFiniteGuard()]
    with ExitStack() as patches:
        if config != "none":
            callbacks.append(
                GPUMonitor(  # conf/callbacks/monitor.yaml's values, the heartbeat faster
                    interval_s=1.0,
                    device_indices=[0],
                    report_dir=root / "report",
                    print_report=False,
                    plot=False,
                    log_metrics=False,
                    publish=True,
                    runs_dir=root / "runs",
                    publish_interval_s=publish_interval_s,
                    hung_after_steps=10.0,
                )
            )
        if config == "heartbeat":
            patches.enter_context(mock.patch.object(gpu_monitor, "heartbeat_checks", lambda *args: None))
            patches.enter_context(mock.patch.object(gpu_monitor, "health_reader", lambda devices: None))
        gen = torch.Generator().manual_seed(0)
        data = TensorDataset(
            torch.randn(base.BATCH * steps, 64, generator=gen), torch.randint(0, 10, (base.BATCH * steps,))
        )
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=steps,
            callbacks=callbacks,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        torch.manual_seed(0)
        trainer.fit(base.MLP(), DataLoader(data, batch_size=base.BATCH))
    if config != "none":  # the patches did what they say: card health in the heartbeat with the alerts only
        (heartbeat,) = [json.loads(path.read_text()) for path in (root / "runs").rglob("*.json")]
        if any("health" in gpu for gpu in heartbeat["gpus"]) != (config == "heartbeat + alerts"):
            raise SystemExit(f"{config}: the heartbeat's gpus hold {[sorted(gpu) for gpu in heartbeat['gpus']]}")
    intervals = [b - a for a, b in zip(timer.ends[warmup:], timer.ends[warmup + 1 :], strict=False)]
    return statistics.fmean(intervals)


def paired(times: dict[str, list[float]], config: str, against: str) -> str:
    ratios = [t / b - 1 for t, b in zip(times[config], times[against], strict=True)]
    return f"{100 * statistics.median(ratios):+6.2f}% [{100 * min(ratios):+.2f}, {100 * max(ratios):+.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)  # repetitions of each configuration (the median is reported)
    parser.add_argument("--steps", type=int, default=1500)  # training steps per fit (~3 s at width 256 here)
    parser.add_argument("--warmup", type=int, default=50)  # first steps of each fit left out
    parser.add_argument("--threads", type=int, default=1)  # torch intra-op threads (1 is steadier on a busy machine)
    parser.add_argument("--width", type=int, default=256)  # hidden width of the MLP (256: ~2 ms per step here)
    parser.add_argument("--publish-interval", type=float, default=0.25)  # seconds between heartbeats
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base.WIDTH = args.width
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    start = time.monotonic()
    nvml.pynvml = FakeNVML(  # the fake's card holds 20 000 MiB
        [FakeGPU("GPU-bench-0000", utilization=lambda t: 50 + 40 * (int(t) % 2))],
        clock=lambda: time.monotonic() - start,
    )
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for config in CONFIGS[rep % len(CONFIGS) :] + CONFIGS[: rep % len(CONFIGS)]:  # rotate the order
                root = Path(tmp) / f"{rep}-{CONFIGS.index(config)}"
                times[config].append(fit_once(config, args.steps, args.warmup, root, args.publish_interval))
    load = os.getloadavg()
    print(
        f"torch {torch.__version__}, lightning {lightning.__version__}, Python {platform.python_version()}, "
        f"{torch.get_num_threads()} torch threads, {platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{load[0]:.2f} at the end ({args.reps} reps x {args.steps} steps, MLP width {base.WIDTH}, a heartbeat "
        f"every {args.publish_interval} s)"
    )
    for config in CONFIGS:
        runs = ", ".join(f"{1e3 * t:.3f}" for t in times[config])
        line = f"{config:>18}: {1e3 * statistics.median(times[config]):7.3f} ms/step"
        if config != "none":
            line += f"  vs none {paired(times, config, 'none')}"
        print(f"{line}   [{runs}]")
    print(f"alerts on vs the heartbeat without them: {paired(times, 'heartbeat + alerts', 'heartbeat')} per repetition")


if __name__ == "__main__":
    main()
