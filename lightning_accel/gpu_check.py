"""One-command check of the GPU paths on a real GPU: `python -m lightning_accel.gpu_check [--full]` writes one report.

Each part runs where it can and otherwise says why it was skipped, so the same command runs on a CPU machine (every
CUDA part skipped with its reason) and on a one-GPU machine. It needs no network and works with torch >= 2.4; the
check itself does not import Hydra (`--full` runs accel-bench and accel-tune, which need it, as subprocesses).
`--out DIR` receives `gpu_check.md`, `gpu_check.json` and, when there are figures to draw and matplotlib is
installed, `gpu_check.png`. Parts (about a minute on an H200):

- `nvml_vs_torch`: NVML's name, UUID mapping and free memory against torch's; the total differs by the memory
  the driver reserves (reported);
- `gpu_monitor_overhead`: a CUDA fit with GPUMonitor against one with DeviceStatsMonitor (both logging to a CSV
  logger), step-time ratio over 3 alternating repeats;
- `gpt_precision`: the GPT example at a GPU-sized configuration in fp32 and bf16-mixed: speedup, validation loss
  within 2%;
- `mfu`: the peak-FLOP/s table against a hand-timed bf16 matmul (kept for `--full`'s MFU cross-check);
- `doctor`: `accel-doctor` exits 0;
- `fsdp` and `model_parallel`: one step under FSDPStrategy, 8 under ModelParallelStrategy with `Parallelize`
  (FSDP2 per block), on one GPU;
- `fp8`: one fp8 step where the GPU (compute capability 8.9+) and Transformer Engine or torchao allow;
- `micro_batch`: MicroBatchFinder under a 3 GiB cap on the process (`set_per_process_memory_fraction`): the GPT
  example's batch of 128 does not fit, the first real steps size the micro-batch from real CUDA out-of-memory
  errors and measured peaks, a real allocator OOM injected in the first step after the sizing is recovered by
  halving, and the weights after 6 steps equal a run at a fixed micro-batch of 8 (1e-3).

`--full` adds (about 8 minutes on an H200 in all):

- `gpu_monitor`: GPUMonitor during a compiled bf16 fit of GPT-2 small: its GPM readings (SM activity, tensor-core
  activity) are there and non-zero, and its step-time overhead against the same fit without it, over alternating
  repeats, is within noise or at most 1%;
- `tune`: `accel-tune --profile gpu --time-budget 180` on `model=gpt2_small`, writing `preset=tuned_gpt2_small`;
- `ladder`: `accel-bench --profile gpu` over fp32 baseline, amp, amp + compile and the tuned preset: samples/s
  with intervals, MFU (cross-checked against the `mfu` part's hand-timed matmul), J/sample and quality verdicts;
  it passes when the tuned configuration (else the fastest stage) runs >= 6.53x the fp32 baseline's samples/s
  (the article's 4-GPU table, on one card), amp + compile reaches >= 50% MFU, and every stage's validation loss
  is within 2% of the baseline's over the same samples.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

from lightning_accel.files import directory_write_error

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import Strategy

    from examples.gpt import GPTLanguageModel

__all__ = [
    "FULL_PARTS",
    "PARTS",
    "CheckContext",
    "Part",
    "ladder_verdict",
    "main",
    "plot",
    "render",
    "run_checks",
    "to_json",
    "write_report",
]

ARTICLE_SPEEDUP = 6.53
"""The article's last rung (4 GPUs, model parallel + accumulation + OneCycleLR): what the tuned stage must reach."""
MFU_TARGET = 0.50
"""What bf16 + compile must reach on one GPU (nanoGPT-class GPT-2 small training reaches 40-50% on an H100)."""
QUALITY_TOLERANCE = 0.02
"""Largest relative difference of a stage's validation loss from the fp32 baseline's over the same samples."""
OVERHEAD_LIMIT = 0.01
"""GPUMonitor's step-time overhead on the compiled run that still passes when the interval does not hold 1.0."""


@dataclass(kw_only=True, slots=True)
class Part:
    """The outcome of one part of the check."""

    name: str
    status: str = "PASS"
    """PASS, FAIL or SKIP."""
    detail: str = ""
    figures: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass(kw_only=True, slots=True)
class CheckContext:
    """What the parts of one check share: where they write, and figures a later part reads (the hand-timed matmul's
    TFLOP/s for the ladder's MFU cross-check, the preset accel-tune wrote)."""

    out_dir: Path
    facts: dict[str, object] = field(default_factory=dict)
    timeout_scale: float = 1.0
    """Multiplies the subprocess timeouts of `--full` (a slower GPU than an H200)."""


class _Skip(Exception):
    """A part that cannot run here, with the reason."""


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        raise _Skip(f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})")


def _nvml_vs_torch(ctx: CheckContext) -> Part:
    _need_cuda()
    from lightning_accel.telemetry import nvml

    why = nvml.init_nvml()
    if why is not None:
        raise _Skip(why)
    try:
        count = torch.cuda.device_count()
        uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]
        devices = nvml.resolve_devices(list(range(count)), os.environ.get("CUDA_VISIBLE_DEVICES"), uuids)
        problems, figures = [], {}
        for i, device in enumerate(devices):
            free, total = torch.cuda.mem_get_info(i)
            info = nvml.pynvml.nvmlDeviceGetMemoryInfo(device.handle)
            name = torch.cuda.get_device_name(i)
            figures[f"cuda:{i}"] = (
                f"{device.name} / torch {name}; NVML total {info.total / 2**20:.0f} MiB, "
                f"torch {total / 2**20:.0f} MiB; used NVML {info.used / 2**20:.0f} MiB, "
                f"torch {(total - free) / 2**20:.0f} MiB"
            )
            if not device.name.startswith(name) and not name.startswith(device.name):
                problems.append(f"cuda:{i} name {name!r} vs NVML {device.name!r}")
            # NVML's total counts the memory the driver reserves for itself; cudaMemGetInfo's leaves it out (615 MiB
            # on an H200 with driver 580), so totals differ by that and the free memory is what must agree.
            reserved = info.total - total
            figures[f"cuda:{i} driver-reserved"] = f"{reserved / 2**20:.0f} MiB"
            if not 0 <= reserved <= max(2 * 2**30, info.total // 50):
                problems.append(f"cuda:{i} total memory {total} vs NVML {info.total}: more than the driver reserves")
            if abs(info.free - free) > 256 * 2**20:
                problems.append(f"cuda:{i} free memory {free} vs NVML {info.free}: more than 256 MiB apart")
        return Part(
            name="nvml_vs_torch", status="FAIL" if problems else "PASS", detail="; ".join(problems), figures=figures
        )
    finally:
        nvml.shutdown_nvml()


_Precision = Literal["32-true", "bf16-mixed"]
"""The precisions the check trains in."""


def _gpt_class() -> type[GPTLanguageModel]:
    """The GPT example: `lightning_accel.examples` in a wheel, `examples/` beside the package in a checkout."""
    try:
        from lightning_accel.examples.gpt import GPTLanguageModel
    except ImportError:
        from examples.gpt import GPTLanguageModel
    return GPTLanguageModel


def _next_byte_pairs(data: torch.Tensor) -> torch.utils.data.TensorDataset:
    """(input, target) samples of the GPT example, one per row of `data`: the target is the input shifted by one."""
    return torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:])


def _tiny_fit(
    callbacks: list[pl.Callback],
    steps: int,
    precision: _Precision = "32-true",
    model: pl.LightningModule | None = None,
    batch_size: int = 16,
    strategy: str | Strategy = "auto",
) -> float:
    """Seconds per training step of a small CUDA fit (the first 5 steps left out), logging to a throwaway CSV logger
    (DeviceStatsMonitor refuses a Trainer without one)."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    class _Timer(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_end(self, *args: object) -> None:
            torch.cuda.synchronize()
            self.times.append(time.perf_counter())

    timer = _Timer()
    module = model or _gpt_class()(block_size=256, n_layer=4, n_head=8, n_embd=512)
    block = module.hparams.get("block_size", 256)
    data = torch.randint(0, 256, (steps * batch_size, block + 1))
    loader = torch.utils.data.DataLoader(_next_byte_pairs(data), batch_size=batch_size)
    with tempfile.TemporaryDirectory() as logs:
        trainer = pl.Trainer(
            accelerator="cuda",
            devices=1,
            max_steps=steps,
            precision=precision,
            strategy=strategy,
            callbacks=[*callbacks, timer],
            logger=CSVLogger(logs),
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, loader)
    gaps = [b - a for a, b in zip(timer.times[5:], timer.times[6:], strict=False)]
    return statistics.median(gaps)


def _gpu_monitor_overhead(ctx: CheckContext) -> Part:
    _need_cuda()
    from lightning.pytorch.callbacks import DeviceStatsMonitor

    from lightning_accel.callbacks import GPUMonitor

    ours, theirs = [], []
    for _ in range(3):  # alternating, so drift in clocks or load hits both alike
        ours.append(_tiny_fit([GPUMonitor(interval_s=0.1)], steps=60))
        theirs.append(_tiny_fit([DeviceStatsMonitor()], steps=60))
    ratio = statistics.median(ours) / statistics.median(theirs)
    figures = {
        "GPUMonitor s/step": " ".join(f"{t:.4f}" for t in ours),
        "DeviceStatsMonitor s/step": " ".join(f"{t:.4f}" for t in theirs),
        "ratio (median)": f"{ratio:.3f}",
    }
    return Part(
        name="gpu_monitor_overhead",
        status="PASS" if ratio <= 1.05 else "FAIL",
        detail="GPUMonitor step time over DeviceStatsMonitor's",
        figures=figures,
    )


def _gpt_precision(ctx: CheckContext) -> Part:
    _need_cuda()
    if not torch.cuda.is_bf16_supported():
        raise _Skip("this GPU has no bf16")
    import lightning.pytorch as pl

    results = {}
    precisions: tuple[_Precision, ...] = ("32-true", "bf16-mixed")
    for precision in precisions:
        pl.seed_everything(0)
        # big enough that the matmuls, not kernel launches, set the step time (a 4x512 model ran 1.03x in bf16)
        model = _gpt_class()(block_size=512, n_layer=8, n_head=16, n_embd=1024)
        seconds = _tiny_fit([], steps=60, precision=precision, model=model, batch_size=16)
        model.eval().cuda()
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=precision != "32-true"):
            x = torch.randint(0, 256, (16, 513), generator=torch.Generator().manual_seed(1)).cuda()
            loss = float(model._loss((x[:, :-1], x[:, 1:])))
        results[precision] = (seconds, loss)
    speedup = results["32-true"][0] / results["bf16-mixed"][0]
    drift = abs(results["bf16-mixed"][1] - results["32-true"][1]) / results["32-true"][1]
    figures: dict[str, str] = {p: f"{s:.4f} s/step, loss {v:.4f}" for p, (s, v) in results.items()}
    figures["bf16 speedup"] = f"{speedup:.2f}x"
    figures["loss difference"] = f"{drift:.2%}"
    return Part(name="gpt_precision", status="PASS" if drift <= 0.02 else "FAIL", figures=figures)


def _mfu(ctx: CheckContext) -> Part:
    _need_cuda()
    from lightning_accel.telemetry.peak_flops import lookup_peak_flops

    n, dtype = 8192, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    a, b = torch.randn(n, n, device="cuda", dtype=dtype), torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    measured = 2 * n**3 * reps / (time.perf_counter() - start)
    peak = lookup_peak_flops(torch.cuda.get_device_name(0), "bf16" if dtype == torch.bfloat16 else "fp16")
    ctx.facts["matmul_tflops"] = measured / 1e12
    if peak.flops:
        ctx.facts["table_peak_tflops"] = peak.flops / 1e12
    figures = {
        "hand-timed matmul": f"{measured / 1e12:.1f} TFLOP/s",
        "table peak": f"{peak.flops / 1e12:.1f} TFLOP/s ({peak.source})" if peak.flops else peak.reason,
    }
    if peak.flops is None:
        return Part(name="mfu", status="SKIP", detail=peak.reason, figures=figures)
    share = measured / peak.flops
    figures["matmul / table peak"] = f"{share:.2f}"
    return Part(
        name="mfu",
        status="PASS" if 0.3 <= share <= 1.05 else "FAIL",
        detail="the table's peak against a hand-timed matmul (expected 0.6-0.9)",
        figures=figures,
    )


def _doctor(ctx: CheckContext) -> Part:
    done = subprocess.run(
        [sys.executable, "-m", "lightning_accel.doctor", "--json"], capture_output=True, text=True, timeout=120
    )
    figures: dict[str, str] = {}
    try:
        checks = json.loads(done.stdout)["checks"]
        figures = {c["name"]: f"{c['status']}: {c.get('detail') or c.get('message') or ''}".strip() for c in checks}
    except (ValueError, KeyError, TypeError):
        figures = {"output": " / ".join((done.stdout + done.stderr).strip().splitlines()[-5:])}
    return Part(
        name="doctor",
        status="PASS" if done.returncode == 0 else "FAIL",
        detail=f"exit {done.returncode}",
        figures=figures,
    )


def _one_step(strategy: str | Strategy) -> Part:
    _need_cuda()
    import lightning.pytorch as pl

    model = _gpt_class()(block_size=64, n_layer=2, n_head=4, n_embd=128)
    data = torch.randint(0, 256, (8, 65))
    loader = torch.utils.data.DataLoader(_next_byte_pairs(data), batch_size=8)
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, loader)
    return Part(name="", status="PASS", detail=f"1 step, global_step={trainer.global_step}")


def _fsdp(ctx: CheckContext) -> Part:
    _need_cuda()
    from lightning.pytorch.strategies import FSDPStrategy

    part = _one_step(FSDPStrategy())
    part.name = "fsdp"
    return part


def _model_parallel(ctx: CheckContext) -> Part:
    """One step under ModelParallelStrategy, parallelized the project's way: the `Parallelize` callback installs
    `configure_model` (FSDP2 per GPT block) on a module that has none of its own."""
    _need_cuda()
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_accel.callbacks import Parallelize

    model = _gpt_class()(block_size=64, n_layer=2, n_head=4, n_embd=128)
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    seconds = _tiny_fit([Parallelize(block_classes=["Block"])], steps=8, model=model, batch_size=8, strategy=strategy)
    return Part(
        name="model_parallel",
        status="PASS",
        detail="8 steps, FSDP2 per block through Parallelize",
        figures={"s/step": f"{seconds:.4f}"},
    )


def _fp8(ctx: CheckContext) -> Part:
    _need_cuda()
    capability = torch.cuda.get_device_capability(0)
    if capability < (8, 9):
        raise _Skip(f"fp8 needs compute capability 8.9+, this GPU has {capability[0]}.{capability[1]}")
    from lightning_accel.precision import resolve_precision

    try:
        resolved = resolve_precision("fp8", "cuda")
    except Exception as err:
        raise _Skip(str(err)) from None
    return Part(name="fp8", status="PASS", detail=resolved.describe())


def _micro_batch(ctx: CheckContext) -> Part:
    _need_cuda()
    import lightning.pytorch as pl

    from lightning_accel.callbacks import MicroBatchFinder

    cap = 3 * 2**30
    total = torch.cuda.get_device_properties(0).total_memory
    gpt = _gpt_class()

    class _SGD(gpt):  # type: ignore[misc, valid-type]  # a base class found at run time
        """Plain SGD: the weights then differ by what the gradients differ (Adam's first steps amplify rounding)."""

        def configure_optimizers(self) -> object:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class _OOMOnce(_SGD):
        """A real CUDA out-of-memory error from the allocator, once, in the first piece after the sizing ended."""

        finder: MicroBatchFinder | None = None
        injected = False

        def training_step(self, batch: object, batch_idx: int) -> object:
            if self.finder is not None and self.finder.found is not None and not self.injected:
                self.injected = True
                torch.empty(total, dtype=torch.uint8, device="cuda")  # more than the cap: raises OutOfMemoryError
            return super().training_step(batch, batch_idx)

    data = torch.randint(0, 256, (6 * 128, 257), generator=torch.Generator().manual_seed(0))
    pairs = _next_byte_pairs(data)
    runs = {}
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    try:
        for name, finder in (("auto", MicroBatchFinder(grow_after=None)), ("fixed 8", MicroBatchFinder(8))):
            pl.seed_everything(0)
            model = (_OOMOnce if name == "auto" else _SGD)(block_size=256, n_layer=4, n_head=8, n_embd=512)
            if isinstance(model, _OOMOnce):
                model.finder = finder
            trainer = pl.Trainer(
                accelerator="cuda",
                devices=1,
                max_steps=6,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[finder],
            )
            started = time.perf_counter()
            trainer.fit(model, torch.utils.data.DataLoader(pairs, batch_size=128))
            runs[name] = (finder, time.perf_counter() - started, [p.detach().float().cpu() for p in model.parameters()])
            del model, trainer
            torch.cuda.empty_cache()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    finder, seconds, weights = runs["auto"]
    drift = max(float((a - b).abs().max()) for a, b in zip(weights, runs["fixed 8"][2], strict=True))
    trials = ", ".join(
        f"{t.size}: {'fits' if t.fits else 'no'}" + (f" ({t.peak_bytes / 2**30:.2f} GiB)" if t.peak_bytes else "")
        for t in finder.sizing
    )
    # >= 1: a real OOM of its own during training (the cap limits reserved memory, fragmentation included) is fine
    ok = finder.found is not None and finder.found < 128 and finder.oom_recoveries >= 1 and drift <= 1e-3
    ok = ok and finder.found is not None and finder.size is not None and finder.size <= finder.found // 2
    return Part(
        name="micro_batch",
        status="PASS" if ok else "FAIL",
        detail=f"cap {cap / 2**30:.0f} GiB, GPT 4x512, block 256, batch 128, 6 steps",
        figures={
            "micro-batch found": str(finder.found),
            "sizing steps": trials,
            "after the injected OOM": f"{finder.size} ({finder.oom_recoveries} recoveries)",
            "max |w_auto - w_fixed8|": f"{drift:.2e}",
            "fit s (auto, fixed 8)": f"{seconds:.1f}, {runs['fixed 8'][1]:.1f}",
        },
    )


def _timed_fit(
    model: pl.LightningModule,
    callbacks: list[pl.Callback],
    steps: int,
    warmup: int,
    precision: _Precision,
    batch_size: int,
) -> float:
    """Seconds per training step of a CUDA fit, from the end of batch `warmup` to the end of training (the device
    synchronised only there, so the host queues work as it does in training); no logger, no checkpoint."""
    import lightning.pytorch as pl

    class _Clock(pl.Callback):
        def __init__(self) -> None:
            self.start = self.end = 0.0

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            if trainer.global_step == warmup:
                torch.cuda.synchronize()
                self.start = time.perf_counter()

        def on_train_end(self, *args: object) -> None:
            torch.cuda.synchronize()
            self.end = time.perf_counter()

    clock = _Clock()
    block = model.hparams["block_size"]
    data = torch.randint(0, 256, (steps * batch_size, block + 1), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(_next_byte_pairs(data), batch_size=batch_size, pin_memory=True)
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=steps,
        precision=precision,
        callbacks=[*callbacks, clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    return (clock.end - clock.start) / (steps - warmup)


def _gpu_monitor(ctx: CheckContext) -> Part:
    """GPUMonitor on a compiled bf16 fit of GPT-2 small: GPM readings present, overhead within noise or <= 1%."""
    _need_cuda()
    if not torch.cuda.is_bf16_supported():
        raise _Skip("this GPU has no bf16")
    from lightning_accel.system.software import compile_problem

    problem = compile_problem(on_cuda=True)
    if problem:
        raise _Skip(problem)
    import functools

    from lightning_accel.callbacks import Compile, GPUMonitor
    from lightning_accel.measure import ratio, verdict

    adamw = functools.partial(torch.optim.AdamW, lr=6e-4, fused=True)
    model = _gpt_class()(block_size=1024, n_layer=12, n_head=12, n_embd=768, optimizer=adamw)  # compiled once, reused
    on, off, monitors = [], [], []
    for _ in range(3):  # alternating: the same drift touches both
        monitor = GPUMonitor(interval_s=0.5, print_report=False, report_dir=str(ctx.out_dir / "gpu_monitor"))
        on.append(_timed_fit(model, [Compile(), monitor], steps=100, warmup=20, precision="bf16-mixed", batch_size=16))
        monitors.append(monitor)
        off.append(_timed_fit(model, [Compile()], steps=100, warmup=20, precision="bf16-mixed", batch_size=16))
    overhead = ratio(on, off)
    gpus = monitors[-1].report.gpus
    readings = {
        name: max((run[name].mean for run in gpus.values() if name in run), default=math.nan)
        for name in ("sm_activity_pct", "tensor_activity_pct", "utilization_pct", "power_w")
    }
    figures = {
        "s/step with GPUMonitor": " ".join(f"{t:.4f}" for t in on),
        "s/step without": " ".join(f"{t:.4f}" for t in off),
        "overhead (ratio, paired rounds)": f"{overhead.format('.4f')} ({verdict(overhead)})",
        **{f"GPM {k}" if "activity" in k else k: f"{v:.1f}" for k, v in readings.items()},
    }
    problems = [f"no {name} reading" for name in ("sm_activity_pct", "tensor_activity_pct") if not readings[name] > 0]
    if not (overhead.contains(1.0) or overhead.median <= 1 + OVERHEAD_LIMIT):
        problems.append(f"overhead {overhead.median - 1:.1%} is above {OVERHEAD_LIMIT:.0%} and outside the noise")
    ctx.facts["gpm"] = readings
    return Part(
        name="gpu_monitor",
        status="FAIL" if problems else "PASS",
        detail="; ".join(problems) or "compiled bf16 GPT-2 small, 3 alternating pairs of 100 steps",
        figures=figures,
    )


def _subprocess(command: list[str], log: Path, timeout: float) -> int:
    """Run one of the project's commands, its output into `log`; the exit code (124 after `timeout` seconds)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        try:
            return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124


def _tail(log: Path, lines: int = 3) -> str:
    text = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    return " / ".join(text[-lines:])


def _tune(ctx: CheckContext) -> Part:
    """`accel-tune --profile gpu --time-budget 180` on GPT-2 small; its preset feeds the ladder's tuned stage."""
    _need_cuda()
    out, conf = ctx.out_dir / "tune", ctx.out_dir / "conf"
    command = [
        sys.executable,
        "-m",
        "lightning_accel.tune",
        "--profile",
        "gpu",
        "--time-budget",
        "180",
        "--name",
        "gpt2_small",
        "--config-dir",
        str(conf),
        "--out",
        str(out),
        "model=gpt2_small",
    ]
    code = _subprocess(command, ctx.out_dir / "tune.log", timeout=420 * ctx.timeout_scale)
    preset = conf / "preset" / "tuned_gpt2_small.yaml"
    figures = {"command": " ".join(command[1:]), "exit": str(code)}
    try:
        trace = json.loads((out / "tune.json").read_text())
        figures.update(
            {
                "pick": str(trace.get("pick")),
                "confirmed": str(trace.get("confirmed")),
                "seconds": f"{float(trace.get('total_s') or 0):.0f}",
                "stopped": str(trace.get("stop")),
            }
        )
    except (OSError, ValueError) as err:
        figures["tune.json"] = f"unreadable: {err}"
    if code == 0 and preset.is_file():
        ctx.facts["tuned_preset"] = "tuned_gpt2_small"
        return Part(name="tune", status="PASS", detail=f"preset {preset.name}", figures=figures)
    return Part(name="tune", status="FAIL", detail=f"exit {code}: {_tail(ctx.out_dir / 'tune.log')}", figures=figures)


def ladder_verdict(stages: Sequence[dict], facts: dict[str, object]) -> tuple[list[str], dict[str, str]]:
    """The ladder's problems (empty: PASS) and figures, from bench.json's stages (`StageResult` as dicts).

    The tuned stage (else the fastest that ran) must reach `ARTICLE_SPEEDUP` over the first stage, `amp_compile`
    `MFU_TARGET`, and every stage's metric stay within `QUALITY_TOLERANCE` of the first's.
    """
    figures: dict[str, str] = {}
    problems = [
        f"{s['name']}: {s['status']} ({s.get('reason') or 'no reason given'})" for s in stages if s["status"] != "ok"
    ]
    ran = [s for s in stages if s["status"] == "ok"]
    if len(ran) < 2:
        return [*problems, "fewer than two stages ran: no speedup to judge"], figures
    matmul, peak = facts.get("matmul_tflops"), facts.get("table_peak_tflops")
    for s in ran:
        interval = s.get("samples_interval") or {}
        speed = s.get("speedup_interval") or {}
        cells = [
            f"{s['samples_per_s']:.1f} samples/s [{interval.get('low', math.nan):.1f}, "
            f"{interval.get('high', math.nan):.1f}]"
        ]
        if s.get("speedup") is not None:
            cells.append(f"{s['speedup']:.2f}x [{speed.get('low', math.nan):.2f}, {speed.get('high', math.nan):.2f}]")
        if s.get("mfu") is not None:
            cells.append(f"MFU {s['mfu']:.1%}")
            if isinstance(matmul, float) and isinstance(peak, float):
                cells.append(f"{s['mfu'] * peak / matmul:.1%} of the hand-timed matmul")
        if s.get("energy_j_per_sample") is not None:
            cells.append(f"{s['energy_j_per_sample']:.3f} J/sample")
        cells.append(f"{s.get('metric_value')} ({s.get('quality')}, {s.get('quality_delta_pct')}%)")
        figures[s["name"]] = "; ".join(cells)
        delta = s.get("quality_delta_pct")
        if s is not ran[0] and (s.get("quality") == "FAIL" or (delta is not None and delta > 100 * QUALITY_TOLERANCE)):
            problems.append(
                f"{s['name']}: validation loss {delta:+.2f}% from the baseline's (limit {QUALITY_TOLERANCE:.0%})"
            )
    tuned = next((s for s in ran if s["name"].startswith("tuned")), None)
    best = tuned or max(ran[1:], key=lambda s: s.get("speedup") or 0.0)
    speedup = best.get("speedup") or 0.0
    figures["verdict: speedup"] = f"{best['name']} {speedup:.2f}x against {ARTICLE_SPEEDUP}x"
    if speedup < ARTICLE_SPEEDUP:
        problems.append(f"{best['name']} runs {speedup:.2f}x the baseline's samples/s, below {ARTICLE_SPEEDUP}x")
    compiled = next((s for s in ran if s["name"] == "amp_compile"), None)
    if compiled is not None:
        mfu = compiled.get("mfu")
        figures["verdict: MFU"] = f"amp_compile {'n/a' if mfu is None else f'{mfu:.1%}'} against {MFU_TARGET:.0%}"
        if mfu is None or mfu < MFU_TARGET:
            problems.append(
                f"amp_compile MFU {'n/a' if mfu is None else f'{mfu:.1%}'} is below {MFU_TARGET:.0%}"
                + (f" ({compiled.get('mfu_note')})" if compiled.get("mfu_note") else "")
            )
    return problems, figures


def _ladder(ctx: CheckContext) -> Part:
    """`accel-bench --profile gpu` over baseline, amp, amp + compile and the tuned preset."""
    _need_cuda()
    return _run_ladder(ctx, ["--profile", "gpu"], timeout=900)


def _run_ladder(ctx: CheckContext, bench_args: list[str], timeout: float) -> Part:
    ladder = ["baseline", "amp", "amp_compile"]
    extra = []
    if ctx.facts.get("tuned_preset"):
        ladder.append(str(ctx.facts["tuned_preset"]))
        extra.append(f"hydra.searchpath=[file://{(ctx.out_dir / 'conf').resolve()}]")
    out = ctx.out_dir / "bench"
    command = [
        sys.executable,
        "-m",
        "lightning_accel.bench",
        *bench_args,
        "--ladder",
        ",".join(ladder),
        "--out",
        str(out),
        "--overwrite",
        *extra,
    ]
    code = _subprocess(command, ctx.out_dir / "bench.log", timeout=timeout * ctx.timeout_scale)
    try:
        stages = json.loads((out / "bench.json").read_text())["stages"]
    except (OSError, ValueError, KeyError) as err:
        return Part(
            name="ladder",
            status="FAIL",
            detail=f"exit {code}, no bench.json ({err}): {_tail(ctx.out_dir / 'bench.log')}",
        )
    ctx.facts["ladder"] = stages
    problems, figures = ladder_verdict(stages, ctx.facts)
    figures = {"command": " ".join(command[1:]), **figures}
    if not ctx.facts.get("tuned_preset"):
        figures["tuned stage"] = "none: the tune part wrote no preset; the fastest stage is judged instead"
    return Part(
        name="ladder",
        status="FAIL" if problems or code not in (0, 1) else "PASS",
        detail="; ".join(problems) or f"{len(stages)} stages, exit {code}",
        figures=figures,
    )


PARTS: dict[str, Callable[[CheckContext], Part]] = {
    "nvml_vs_torch": _nvml_vs_torch,
    "gpu_monitor_overhead": _gpu_monitor_overhead,
    "gpt_precision": _gpt_precision,
    "mfu": _mfu,
    "doctor": _doctor,
    "fsdp": _fsdp,
    "model_parallel": _model_parallel,
    "fp8": _fp8,
    "micro_batch": _micro_batch,
}
FULL_PARTS: dict[str, Callable[[CheckContext], Part]] = {"gpu_monitor": _gpu_monitor, "tune": _tune, "ladder": _ladder}
"""`--full`'s parts, run after `PARTS` in this order (the ladder's tuned stage is the tune part's preset)."""


def run_checks(names: Sequence[str] | None = None, ctx: CheckContext | None = None) -> list[Part]:
    """Run the named parts (default: `PARTS`); a part that cannot run is SKIP with the reason, one that breaks FAIL.

    `ctx` carries the output folder and the figures one part leaves for another (default: a temporary folder).
    """
    ctx = ctx or CheckContext(out_dir=Path(tempfile.mkdtemp(prefix="gpu_check_")))
    every = {**PARTS, **FULL_PARTS}
    parts = []
    for name in names or PARTS:
        started = time.perf_counter()
        try:
            part = every[name](ctx)
            part.name = name
        except _Skip as why:
            part = Part(name=name, status="SKIP", detail=str(why))
        except Exception as err:  # one broken part must not hide the others
            part = Part(
                name=name,
                status="FAIL",
                detail=f"{type(err).__name__}: {err}",
                figures={"traceback": traceback.format_exc().strip().splitlines()[-1]},
            )
        part.seconds = time.perf_counter() - started
        parts.append(part)
        print(f"{part.status:4}  {part.name} ({part.seconds:.0f} s): {part.detail}", flush=True)
    return parts


def _machine() -> dict[str, str]:
    """Date, device, driver, torch and Python: the header of the report and the README's table."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    driver = "n/a"
    if torch.cuda.is_available():
        try:
            from lightning_accel.telemetry import nvml

            if nvml.init_nvml() is None:
                try:
                    raw = nvml.pynvml.nvmlSystemGetDriverVersion()
                    driver = raw.decode() if isinstance(raw, bytes) else str(raw)
                finally:
                    nvml.shutdown_nvml()
        except Exception as err:  # the header must not stop the check
            driver = f"n/a ({type(err).__name__})"
    return {
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        "device": device,
        "driver": driver,
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
        "python": f"{platform.python_version()} on {platform.platform()}",
    }


def render(parts: Sequence[Part], machine: dict[str, str] | None = None) -> str:
    """The Markdown report: the machine, then one row per part and its figures."""
    machine = machine or _machine()
    lines = [
        "# lightning_accel GPU check",
        "",
        *(f"- {key}: {value}" for key, value in machine.items()),
        "",
        "| part | status | seconds | detail |",
        "|---|---|---|---|",
    ]
    lines += [f"| {p.name} | {p.status} | {p.seconds:.0f} | {p.detail.replace('|', '/')} |" for p in parts]
    for part in parts:
        if part.figures:
            lines += ["", f"## {part.name}", ""] + [f"- {k}: {v}" for k, v in part.figures.items()]
    return "\n".join(lines) + "\n"


def to_json(parts: Sequence[Part], machine: dict[str, str], facts: dict[str, object]) -> dict[str, object]:
    """gpu_check.json: the machine, every part (status, detail, seconds, figures) and the ladder's stages."""
    return {
        "schema_version": 1,
        **machine,
        "parts": [asdict(p) for p in parts],
        "ladder": facts.get("ladder", []),
        "gpm": facts.get("gpm"),
    }


def _no_plot(stages: Sequence[dict]) -> str | None:
    """Why gpu_check.png cannot be drawn (no stage ran, or no matplotlib), or None."""
    if not any(s.get("status") == "ok" and s.get("samples_per_s") for s in stages):
        return "no ladder stage ran: gpu_check.png not drawn"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed (pip install 'lightning_accel[plot]'): gpu_check.png not drawn"
    return None


def plot(stages: Sequence[dict], path: Path) -> str | None:
    """gpu_check.png: each ladder stage's samples/s with its interval and speedup, the article's 6.53x as a line;
    returns why not (no stage ran, or no matplotlib)."""
    note = _no_plot(stages)
    if note is not None:
        return note
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [s for s in stages if s.get("status") == "ok" and s.get("samples_per_s")]
    values = [s["samples_per_s"] for s in ran]
    intervals = [s.get("samples_interval") or {} for s in ran]
    errors = [
        [v - i.get("low", v) for v, i in zip(values, intervals, strict=True)],
        [i.get("high", v) - v for v, i in zip(values, intervals, strict=True)],
    ]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.8 * len(ran)), 4.0))
    colors = ["tab:red" if s.get("quality") == "FAIL" else "tab:blue" for s in ran]
    bars = ax.bar([s["name"] for s in ran], values, color=colors, yerr=errors, capsize=4, ecolor="black")
    for bar, s in zip(bars, ran, strict=True):
        label = f"{s['speedup']:.2f}x" if s.get("speedup") is not None else ""
        if s.get("mfu") is not None:
            label += f"\nMFU {s['mfu']:.0%}"
        ax.annotate(
            label,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=9,
            xytext=(0, 3),
            textcoords="offset points",
        )
    ax.axhline(
        values[0] * ARTICLE_SPEEDUP,
        color="tab:green",
        linestyle="--",
        label=f"the article's 4-GPU table: {ARTICLE_SPEEDUP}x",
    )
    ax.set_ylabel("samples/s, median [interval]")
    ax.set_title(f"GPU check ladder ({ran[0].get('device') or 'GPU'})", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.margins(y=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)
    return None


def write_report(parts: Sequence[Part], ctx: CheckContext, machine: dict[str, str] | None = None) -> list[Path]:
    """Write gpu_check.md, gpu_check.json and (when there is a ladder to draw) gpu_check.png into `ctx.out_dir`,
    each written beside its target and then renamed; returns the files written."""
    from lightning_accel.files import atomic_path, atomic_write

    machine = machine or _machine()
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    ladder = cast("list[dict[str, Any]]", ctx.facts.get("ladder") or [])  # the ladder part's stage rows
    png, stages = ctx.out_dir / "gpu_check.png", list(ladder)
    note = _no_plot(stages)
    if note is None:
        with atomic_path(png) as tmp:
            plot(stages, tmp)
    text = render(parts, machine) + (f"\n{note}\n" if note else "\n![ladder](gpu_check.png)\n")
    files = [
        atomic_write(ctx.out_dir / "gpu_check.md", text),
        atomic_write(
            ctx.out_dir / "gpu_check.json", json.dumps(to_json(parts, machine, ctx.facts), indent=2, default=str)
        ),
    ]
    return [*files, png] if note is None else files


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_accel.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("gpu_check"),
        help="the folder for gpu_check.md, gpu_check.json and gpu_check.png (default ./gpu_check)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="also the GPM monitor run, accel-tune --time-budget 180 and the gpt2_small ladder "
        "(about 8 minutes on an H200; needs Hydra, as accel-bench does)",
    )
    parser.add_argument("--parts", nargs="*", choices=[*PARTS, *FULL_PARTS], help="run only these parts")
    parser.add_argument(
        "--timeout-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="multiply the subprocess timeouts of --full (a slower GPU than an H200; default 1)",
    )
    args = parser.parse_args(argv)
    if not (args.timeout_scale > 0 and math.isfinite(args.timeout_scale)):
        parser.error(f"--timeout-scale must be a finite number > 0, got {args.timeout_scale}")
    problem = directory_write_error(args.out)  # before the parts run, not after minutes of GPU time
    if problem is not None:
        parser.error(f"--out {args.out} cannot be written: {problem}; pass a writable folder")
    root = str(Path(__file__).resolve().parent.parent)  # `examples` sits beside the package in a checkout
    if root not in sys.path:
        sys.path.insert(0, root)
    os.environ.setdefault("TMPDIR", tempfile.gettempdir())
    ctx = CheckContext(out_dir=args.out.resolve(), timeout_scale=args.timeout_scale)
    names = args.parts or [*PARTS, *(FULL_PARTS if args.full else ())]
    parts = run_checks(names, ctx)
    files = write_report(parts, ctx)
    print("report: " + ", ".join(str(f) for f in files))
    return 1 if any(p.status == "FAIL" for p in parts) else 0


if __name__ == "__main__":
    sys.exit(main())
