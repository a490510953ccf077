"""What the team's view costs: the heartbeat and exporter on the training step, one scrape of 8 GPUs, and accel-dash's
page data for 64 jobs x 8 GPUs.

Run: `python tests/benchmarks/bench_dash.py [--reps 11] [--steps 400] [--scrapes 60] [--pages 30]`. It prints figures
(medians with intervals, `lightning_accel.measure`), it does not pass or fail:

1. Step time of a small MLP without GPUMonitor and with GPUMonitor publishing (`log_metrics=False`: the heartbeat
   every `publish_interval_s=2`, `/metrics` served on a free port and scraped every `--scrape-every` seconds (5: three
   times Prometheus's usual 15 s) by a thread here, eight fake GPUs read every second), interleaved fit by fit (the
   order alternating), as the ratio of each round's pair with its interval and verdict. The fake NVML answers in
   Python holding the GIL, so its sampler thread costs the training thread more than the real library would (ctypes
   releases the GIL during NVML calls). Then the same work timed alone and added up per second of training: the
   bound the step-time ratio cannot resolve on a busy machine.
2. One scrape of `/metrics` over HTTP for a heartbeat of 8 GPUs with every reading.
3. `GET /api/state` from a real accel-dash (uvicorn, in a subprocess) over a runs directory of 64 heartbeats of 8 GPUs
   with ten minutes of history each, every file rewritten before each request (as 64 live jobs rewrite theirs every
   2 s), so nothing is served from the parse cache.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the fake NVML, the dash server helper
from _fake_nvml import FakeGPU, FakeNVML  # noqa: E402

import lightning_accel.telemetry.nvml as nvml  # noqa: E402
from lightning_accel.callbacks.gpu_monitor import GPUMonitor  # noqa: E402
from lightning_accel.measure import interleaved, ratio, summarize, verdict  # noqa: E402
from lightning_accel.telemetry.heartbeat import (  # noqa: E402
    HISTORY_METRICS,
    HISTORY_S,
    HISTORY_STEP_S,
    SCHEMA,
    heartbeat_path,
    write_json_atomic,
)
from lightning_accel.telemetry.prometheus import Exporter  # noqa: E402

BATCH, WIDTH = 64, 256


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())


class Scraper:
    """Scrapes the monitor's /metrics every `every_s` from a thread while the fit runs (Prometheus: every 15 s)."""

    def __init__(self, monitor: GPUMonitor, every_s: float) -> None:
        self.monitor, self.every_s, self.scrapes = monitor, every_s, 0
        self._stop = threading.Event()

    def on_train_start(self, *args: Any) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if self.monitor.metrics_url:
                try:
                    with urllib.request.urlopen(self.monitor.metrics_url, timeout=10) as response:
                        response.read()
                    self.scrapes += 1
                except OSError:  # the fit ended (and the server with it) while this scrape was under way
                    return

    def on_train_end(self, *args: Any) -> None:
        self._stop.set()


def fit_once(config: str, steps: int, warmup: int, root: Path, scrape_every_s: float = 5.0) -> float:
    """Mean step time (s) of one fit."""
    timer = StepTimer()
    callbacks: list[pl.Callback] = [timer]
    scraper = None
    if config == "publishing":
        monitor = GPUMonitor(
            device_indices=list(range(8)),
            log_metrics=False,
            interval_s=1.0,
            publish_interval_s=2.0,
            runs_dir=root / "runs",
            prometheus_port=0,
        )
        callbacks.append(monitor)
        scraper = Scraper(monitor, scrape_every_s)  # a thread, not a callback: Lightning's dispatch is not ours
        scraper.on_train_start()
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(BATCH * steps, 64, generator=gen), torch.randint(0, 10, (BATCH * steps,)))
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
    trainer.fit(MLP(), DataLoader(data, batch_size=BATCH))
    if scraper is not None:
        scraper.on_train_end()
    ends = timer.ends[warmup:]
    return (ends[-1] - ends[0]) / (len(ends) - 1)


class Toggle(pl.Callback):
    """Switches a real GPUMonitor (publishing, 8 fake GPUs, /metrics scraped every `scrape_every_s`) on and off every
    `segment` steps of one long fit, in pairs whose order alternates (off on, on off, ...), and times each segment's
    steps: on and off then differ only in the monitor, a few seconds apart, whatever the machine's load does meanwhile.
    Switching calls the monitor's own hooks (setup, on_train_start; on_train_end, teardown) and adds it to or removes
    it from `trainer.callbacks`, which Lightning reads at every hook."""

    def __init__(self, root: Path, segment: int, skip: int, scrape_every_s: float) -> None:
        self.root, self.segment, self.skip, self.scrape_every_s = root, segment, skip, scrape_every_s
        self.monitor: GPUMonitor | None = None
        self.scraper: Scraper | None = None
        self.times: dict[str, list[float]] = {"off": [], "on": []}
        self._ends: list[float] = []
        self._index = 0

    def _state(self, index: int) -> str:
        first, second = ("off", "on") if (index // 2) % 2 == 0 else ("on", "off")
        return first if index % 2 == 0 else second

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._ends.append(time.perf_counter())
        if len(self._ends) < self.segment:
            return
        ends = self._ends[self.skip :]
        self.times[self._state(self._index)].append((ends[-1] - ends[0]) / (len(ends) - 1))
        self._ends, self._index = [], self._index + 1
        wanted = self._state(self._index)
        if wanted == "on" and self.monitor is None:
            self.monitor = GPUMonitor(
                device_indices=list(range(8)),
                log_metrics=False,
                interval_s=1.0,
                publish_interval_s=2.0,
                runs_dir=self.root,
                prometheus_port=0,
            )
            self.scraper = Scraper(self.monitor, self.scrape_every_s)
            self.monitor.setup(trainer, pl_module, "fit")
            self.monitor.on_train_start(trainer, pl_module)
            self.scraper.on_train_start()
            trainer.callbacks.append(self.monitor)
        elif wanted == "off":
            self._switch_off(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._switch_off(trainer, pl_module)

    def _switch_off(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is None or self.scraper is None:
            return
        trainer.callbacks.remove(self.monitor)
        self.scraper.on_train_end()
        self.monitor.on_train_end(trainer, pl_module)
        self.monitor.teardown(trainer, pl_module, "fit")
        self.monitor = self.scraper = None


class _SameBatch(torch.utils.data.IterableDataset):
    """One batch, forever (a long fit without a long dataset)."""

    def __iter__(self) -> Any:
        gen = torch.Generator().manual_seed(0)
        x, y = torch.randn(BATCH, 64, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)
        while True:
            yield x, y


def bench_toggled(pairs: int, segment: int, scrape_every_s: float) -> None:
    start = time.monotonic()
    gpus = [FakeGPU(f"GPU-bench-{i}", utilization=lambda t: 50 + 40 * (int(t) % 2)) for i in range(8)]
    nvml.pynvml = FakeNVML(gpus, clock=lambda: time.monotonic() - start)
    with tempfile.TemporaryDirectory() as tmp:
        toggle = Toggle(Path(tmp), segment, skip=segment // 10, scrape_every_s=scrape_every_s)
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=segment * 2 * pairs,
            callbacks=[toggle],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        torch.manual_seed(0)
        trainer.fit(MLP(), DataLoader(_SameBatch(), batch_size=None))
    on, off = toggle.times["on"], toggle.times["off"]
    pairs_done = min(len(on), len(off))
    overhead = ratio(on[:pairs_done], off[:pairs_done])
    calm = ratio(off[1:pairs_done], off[: pairs_done - 1])  # off against the off before it: the noise floor
    for name, interval in (("GPUMonitor publishing, on/off", overhead), ("noise floor, off/previous off", calm)):
        low, median, high = (100 * (x - 1) for x in (interval.low, interval.median, interval.high))
        said = {"faster": "slower", "slower": "faster"}.get(verdict(interval), "no clear difference")  # a time ratio
        print(
            f"  {name}: step time {median:+.2f}% [{low:+.2f}%, {high:+.2f}%] ({interval.method}, "
            f"n={interval.n} pairs): {said}"
        )
    print(
        f"switched on and off within one fit ({pairs} pairs of {segment}-step segments, "
        f"{1e3 * statistics.median(off):.3f} ms/step off; a scrape every {scrape_every_s:g} s); target <= +0.5%"
    )


def heartbeat(index: int, gpus: int = 8, now: float | None = None) -> dict[str, Any]:
    """A heartbeat as a running job of `gpus` cards writes it after ten minutes (a full history)."""
    now = time.time() if now is None else now
    points = int(HISTORY_S // HISTORY_STEP_S)
    t = [round(now - HISTORY_S + HISTORY_STEP_S * k, 2) for k in range(points)]
    latest = {
        "sm_activity_pct": 71.2,
        "sm_occupancy_pct": 33.1,
        "tensor_activity_pct": 48.9,
        "dram_bw_util_pct": 55.0,
        "utilization_pct": 99.0,
        "memory_utilization_pct": 41.0,
        "memory_used_mib": 61234.5,
        "memory_total_mib": 81559.0,
        "memory_used_pct": 75.1,
        "power_w": 612.3,
        "power_limit_w": 700.0,
        "power_pct": 87.5,
        "temperature_c": 71.0,
        "sm_clock_mhz": 1980.0,
        "sm_clock_pct": 100.0,
        "memory_clock_mhz": 2619.0,
        "memory_clock_pct": 100.0,
        "throttle_thermal_frac": 0.0,
        "throttle_power_frac": 0.1,
        "throttle_hw_slowdown_frac": 0.0,
        "throttle_any_frac": 0.1,
        "pcie_rx_mb_s": 120.5,
        "pcie_tx_mb_s": 30.2,
    }
    return {
        "schema": SCHEMA,
        "run_id": f"run-{index:03d}",
        "name": f"experiment {index}",
        "host": f"node-{index // 8:02d}",
        "user": "ada",
        "pid": 1000 + index,
        "command": "accel-train preset=ddp trainer.devices=8",
        "node_rank": 0,
        "num_nodes": 1,
        "rank": 0,
        "started": now - 3600,
        "updated": now,
        "interval_s": 2.0,
        "status": "running",
        "reason": "",
        "slurm_job_id": None,
        "metrics_url": None,
        "ranks": [
            {"rank": r, "local_rank": r, "device": f"cuda:{r}", "uuid": f"GPU-{index:03d}-{r}"} for r in range(gpus)
        ],
        "gpus": [
            {
                "index": g,
                "uuid": f"GPU-{index:03d}-{g}",
                "name": "NVIDIA H100 80GB HBM3",
                "latest": latest,
                "energy_j": 1.23e6,
                "history": {m: [round(50 + 0.37 * k, 2) for k in range(points)] for m in HISTORY_METRICS},
            }
            for g in range(gpus)
        ],
        "step": 12345,
        "max_steps": 100000,
        "samples": 12345 * 512,
        "samples_per_s": 4321.5,
        "eta_s": 17999.0,
        "alerts": [],
        "history": {"t": t, "samples_per_s": [4300.0 + k for k in range(points)]},
    }


def bench_scrape(scrapes: int) -> None:
    exporter = Exporter(lambda: {**heartbeat(0), "pid": 1})
    port = exporter.serve(0)
    url = f"http://127.0.0.1:{port}/metrics"
    times, size = [], 0
    for _ in range(scrapes):
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as response:
            size = len(response.read())
        times.append(time.perf_counter() - started)
    exporter.close()
    interval = summarize([1e3 * t for t in times])
    print(
        f"one scrape of 8 GPUs (HTTP GET /metrics, {size} bytes): {interval.format('.2f', ' ms')} "
        f"({interval.method}, n={interval.n}); target <= 50 ms"
    )


def bench_page(pages: int) -> None:
    from _dash_server import dash_server

    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp) / "runs"
        runs.mkdir()
        beats = [heartbeat(i) for i in range(64)]
        for beat in beats:
            write_json_atomic(heartbeat_path(runs, beat["run_id"], beat["host"], 0), beat)
        total = sum(p.stat().st_size for p in runs.iterdir())
        with dash_server(["--runs-dir", str(runs), "--no-host-gpus"]) as (url, _):
            times, size = [], 0
            for _ in range(pages):
                now = time.time()
                for beat in beats:  # every job wrote a new heartbeat since the last request
                    beat["updated"] = now
                    write_json_atomic(heartbeat_path(runs, beat["run_id"], beat["host"], 0), beat)
                time.sleep(1.1)  # past DashState's reuse window (1 s)
                started = time.perf_counter()
                with urllib.request.urlopen(f"{url}/api/state", timeout=30) as response:
                    size = len(response.read())
                times.append(time.perf_counter() - started)
    interval = summarize([1e3 * t for t in times])
    print(
        f"accel-dash page data, 64 jobs x 8 GPUs ({total / 2**20:.1f} MiB of heartbeats, all rewritten before each "
        f"request; {size / 2**20:.1f} MiB served): {interval.format('.0f', ' ms')} ({interval.method}, "
        f"n={interval.n}); target <= 200 ms"
    )


def bench_background(scrape_every_s: float, repeats: int = 50) -> None:
    """The work publishing adds off the training thread, per second of training: a reading of 8 fake GPUs every
    second, a heartbeat every 2 s, a scrape every `scrape_every_s` (each timed alone, then added up)."""
    from lightning_accel.telemetry.nvml import resolve_devices
    from lightning_accel.telemetry.publisher import JobInfo, PublishSettings, RunPublisher
    from lightning_accel.telemetry.readings import DeviceReader
    from lightning_accel.telemetry.sampler import NVMLSampler

    start = time.monotonic()
    gpus = [FakeGPU(f"GPU-bench-{i}", utilization=lambda t: 50 + 40 * (int(t) % 2)) for i in range(8)]
    nvml.pynvml = FakeNVML(gpus, clock=lambda: time.monotonic() - start)
    readings = ["utilization", "memory", "power", "temperature", "clocks", "throttle", "energy", "gpm"]
    sampler = NVMLSampler([DeviceReader(d, readings) for d in resolve_devices(range(8))], interval_s=1.0)
    sampler.start(threaded=False)
    with tempfile.TemporaryDirectory() as tmp:
        job = JobInfo(
            run_id="bench",
            name="bench",
            host="h",
            user="u",
            pid=1,
            command="c",
            gpus=[{"index": i, "uuid": f"GPU-bench-{i}", "name": "H100"} for i in range(8)],
        )
        publisher = RunPublisher(PublishSettings(runs_dir=Path(tmp)), job, sampler)
        costs = {}
        for name, work in (("read 8 GPUs", sampler.sample_once), ("heartbeat", publisher.publish)):
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                work()
                times.append(time.perf_counter() - started)
            costs[name] = summarize([1e3 * t for t in times])
        publisher.finish("finished")
    exporter = Exporter(lambda: heartbeat(0))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        exporter.exposition()
        times.append(time.perf_counter() - started)
    costs["render /metrics"] = summarize([1e3 * t for t in times])
    per_second = (
        costs["read 8 GPUs"].median / 1.0
        + costs["heartbeat"].median / 2.0
        + costs["render /metrics"].median / scrape_every_s
    )
    print(
        "work off the training thread: "
        + ", ".join(f"{k} {v.format('.2f', ' ms')}" for k, v in costs.items())
        + f"; at 1 reading/s, 1 heartbeat/2 s, 1 scrape/{scrape_every_s:g} s: {per_second:.2f} ms per second of "
        f"training, {per_second / 10:.2f}% of one core (the share of the GIL it can take from the training thread; "
        "the fake NVML is Python, the real one is C and releases the GIL)"
    )


class _HookTimer(pl.Callback):
    """At step 20 of a fit, calls the monitor's per-batch hooks `calls` times and times them (its only work on the
    training thread once training runs)."""

    def __init__(self, monitor: GPUMonitor, calls: int = 20_000) -> None:
        self.monitor, self.calls, self.per_call_s = monitor, calls, float("nan")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx != 20:
            return
        started = time.perf_counter()
        for _ in range(self.calls):
            self.monitor.on_train_batch_start(trainer, pl_module, batch, batch_idx)
            self.monitor.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.per_call_s = (time.perf_counter() - started) / self.calls


def bench_hooks() -> None:
    """GPUMonitor's time on the training thread per step, publishing (the hooks Lightning calls every batch)."""
    start = time.monotonic()
    nvml.pynvml = FakeNVML([FakeGPU(f"GPU-bench-{i}") for i in range(8)], clock=lambda: time.monotonic() - start)
    with tempfile.TemporaryDirectory() as tmp:
        monitor = GPUMonitor(device_indices=list(range(8)), log_metrics=False, runs_dir=Path(tmp), prometheus_port=0)
        timer = _HookTimer(monitor)
        gen = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(BATCH * 40, 64, generator=gen), torch.randint(0, 10, (BATCH * 40,)))
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=40,
            callbacks=[monitor, timer],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(MLP(), DataLoader(data, batch_size=BATCH))
    print(f"GPUMonitor's per-batch hooks on the training thread, publishing: {1e6 * timer.per_call_s:.2f} us per step")


def bench_step(reps: int, steps: int, warmup: int, scrape_every_s: float) -> None:
    """Whole fits without and with GPUMonitor publishing, interleaved (the order rotating by round), and a second fit
    without it in every round: its ratio to the first is the noise floor the comparison has to beat."""
    start = time.monotonic()
    gpus = [FakeGPU(f"GPU-bench-{i}", utilization=lambda t: 50 + 40 * (int(t) % 2)) for i in range(8)]
    nvml.pynvml = FakeNVML(gpus, clock=lambda: time.monotonic() - start)
    configs = ["off", "publishing", "off again"]
    times: dict[str, list[float]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index, position in interleaved(range(len(configs)), reps):
            config = configs[(position + round_index) % len(configs)]  # rotate which runs first
            monitored = "publishing" if config == "publishing" else "off"
            times[config].append(fit_once(monitored, steps, warmup, Path(tmp) / f"{round_index}", scrape_every_s))
    for config in configs:
        interval = summarize([1e3 * t for t in times[config]])
        print(f"  {config:>10}: {interval.format('.3f', ' ms/step')} ({interval.method}, n={interval.n})")
    for name, top, bottom in (
        ("publishing/off", "publishing", "off"),
        ("noise floor, off again/off", "off again", "off"),
    ):
        interval = ratio(times[top], times[bottom])
        low, median, high = (100 * (x - 1) for x in (interval.low, interval.median, interval.high))
        said = {"faster": "slower", "slower": "faster"}.get(verdict(interval), "no clear difference")  # a time ratio
        print(f"  {name}: step time {median:+.2f}% [{low:+.2f}%, {high:+.2f}%] ({interval.method}): {said}")
    print(
        f"whole fits, interleaved ({reps} rounds of {steps} steps; 8 fake GPUs, a scrape every {scrape_every_s:g} "
        "s); target <= +0.5%"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=11)  # rounds of the step-time comparison
    parser.add_argument("--steps", type=int, default=400)  # training steps per fit
    parser.add_argument("--warmup", type=int, default=50)  # first steps of each fit left out
    parser.add_argument("--scrapes", type=int, default=60)  # scrapes timed
    parser.add_argument("--pages", type=int, default=30)  # page-data requests timed
    parser.add_argument("--threads", type=int, default=1)  # torch intra-op threads
    parser.add_argument("--scrape-every", type=float, default=5.0)  # s between scrapes while a fit runs
    parser.add_argument("--pairs", type=int, default=12)  # on/off pairs of segments within one fit
    parser.add_argument("--segment", type=int, default=800)  # steps per segment (a few seconds)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    print(
        f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the start"
    )
    bench_scrape(args.scrapes)
    bench_page(args.pages)
    bench_background(args.scrape_every)
    bench_hooks()
    bench_toggled(args.pairs, args.segment, args.scrape_every)
    bench_step(args.reps, args.steps, args.warmup, args.scrape_every)
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
