"""One-command check of the GPU paths on a real GPU: `python -m lightning_accel.gpu_check` writes one Markdown report.

Each part runs where it can and otherwise says why it was skipped, so the same command runs on a CPU machine (every
CUDA part skipped with its reason) and on a one-GPU machine (about a minute on an H200). It needs no network, works
with torch >= 2.4 and does not import Hydra. Parts:

- `nvml_vs_torch`: NVML's name, UUID mapping and free memory against torch's; the total differs by the memory
  the driver reserves (reported);
- `gpu_monitor_overhead`: a CUDA fit with GPUMonitor against one with DeviceStatsMonitor (both logging to a CSV
  logger), step-time ratio over 3 alternating repeats;
- `gpt_precision`: the GPT example at a GPU-sized configuration in fp32 and bf16-mixed: speedup, validation loss
  within 2%;
- `mfu`: BenchMonitor's MFU is in (0, 1] and near the figure from a hand-timed bf16 matmul;
- `doctor`: `accel-doctor` exits 0;
- `fsdp` and `model_parallel`: one step under FSDPStrategy, 8 under ModelParallelStrategy with `Parallelize`
  (FSDP2 per block), on one GPU;
- `fp8`: one fp8 step where the GPU (compute capability 8.9+) and Transformer Engine or torchao allow;
- `micro_batch`: MicroBatchFinder under a 3 GiB cap on the process (`set_per_process_memory_fraction`): the GPT
  example's batch of 128 does not fit, the search finds the largest micro-batch that does from real CUDA
  out-of-memory errors and measured peaks, a real allocator OOM injected at step 3 is recovered by halving, and the
  weights after 6 steps equal a run at a fixed micro-batch of 8 (1e-3).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = [
    "Part",
    "main",
    "render",
    "run_checks",
]


@dataclass(kw_only=True, slots=True)
class Part:
    """The outcome of one part of the check."""

    name: str
    status: str = "PASS"
    """PASS, FAIL or SKIP."""
    detail: str = ""
    figures: dict[str, str] = field(default_factory=dict)


class _Skip(Exception):
    """A part that cannot run here, with the reason."""


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        raise _Skip(f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})")


def _nvml_vs_torch() -> Part:
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
            figures[f"cuda:{i}"] = (f"{device.name} / torch {name}; NVML total {info.total / 2**20:.0f} MiB, "
                                    f"torch {total / 2**20:.0f} MiB; used NVML {info.used / 2**20:.0f} MiB, "
                                    f"torch {(total - free) / 2**20:.0f} MiB")  # fmt: skip
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
        return Part(name="nvml_vs_torch", status="FAIL" if problems else "PASS", detail="; ".join(problems),
                    figures=figures)  # fmt: skip
    finally:
        nvml.shutdown_nvml()


def _gpt_class() -> type:
    """The GPT example: `lightning_accel.examples` in a wheel, `examples/` beside the package in a checkout."""
    try:
        from lightning_accel.examples.gpt import GPTLanguageModel  # type: ignore[import-not-found]
    except ImportError:
        from examples.gpt import GPTLanguageModel
    return GPTLanguageModel


def _tiny_fit(
    callbacks: list,
    steps: int,
    precision: str = "32-true",
    model: object = None,
    batch_size: int = 16,
    strategy: object = "auto",
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
    block = module.hparams.get("block_size", 256)  # type: ignore[attr-defined]
    data = torch.randint(0, 256, (steps * batch_size, block + 1))
    loader = torch.utils.data.DataLoader(list(zip(data[:, :-1], data[:, 1:], strict=True)), batch_size=batch_size)
    with tempfile.TemporaryDirectory() as logs:
        trainer = pl.Trainer(
            accelerator="cuda", devices=1, max_steps=steps, precision=precision, strategy=strategy,  # type: ignore[arg-type]
            callbacks=[*callbacks, timer], logger=CSVLogger(logs), enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module, loader)
    gaps = [b - a for a, b in zip(timer.times[5:], timer.times[6:], strict=False)]
    return statistics.median(gaps)


def _gpu_monitor_overhead() -> Part:
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
    return Part(name="gpu_monitor_overhead", status="PASS" if ratio <= 1.05 else "FAIL",
                detail="GPUMonitor step time over DeviceStatsMonitor's", figures=figures)  # fmt: skip


def _gpt_precision() -> Part:
    _need_cuda()
    if not torch.cuda.is_bf16_supported():
        raise _Skip("this GPU has no bf16")
    import lightning.pytorch as pl

    results = {}
    for precision in ("32-true", "bf16-mixed"):
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
    figures = {p: f"{s:.4f} s/step, loss {v:.4f}" for p, (s, v) in results.items()}
    figures["bf16 speedup"] = f"{speedup:.2f}x"
    figures["loss difference"] = f"{drift:.2%}"
    return Part(name="gpt_precision", status="PASS" if drift <= 0.02 else "FAIL", figures=figures)


def _mfu() -> Part:
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
    figures = {
        "hand-timed matmul": f"{measured / 1e12:.1f} TFLOP/s",
        "table peak": f"{peak.flops / 1e12:.1f} TFLOP/s ({peak.source})" if peak.flops else peak.reason,
    }
    if peak.flops is None:
        return Part(name="mfu", status="SKIP", detail=peak.reason, figures=figures)
    share = measured / peak.flops
    figures["matmul / table peak"] = f"{share:.2f}"
    return Part(name="mfu", status="PASS" if 0.3 <= share <= 1.05 else "FAIL",
                detail="the table's peak against a hand-timed matmul (expected 0.6-0.9)", figures=figures)  # fmt: skip


def _doctor() -> Part:
    done = subprocess.run([sys.executable, "-m", "lightning_accel.doctor", "--json"], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    figures: dict[str, object] = {}
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


def _one_step(strategy: object) -> Part:
    _need_cuda()
    import lightning.pytorch as pl

    model = _gpt_class()(block_size=64, n_layer=2, n_head=4, n_embd=128)
    data = torch.randint(0, 256, (8, 65))
    loader = torch.utils.data.DataLoader(list(zip(data[:, :-1], data[:, 1:], strict=True)), batch_size=8)
    trainer = pl.Trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=1,  # type: ignore[arg-type]
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    trainer.fit(model, loader)
    return Part(name="", status="PASS", detail=f"1 step, global_step={trainer.global_step}")


def _fsdp() -> Part:
    _need_cuda()
    from lightning.pytorch.strategies import FSDPStrategy

    part = _one_step(FSDPStrategy())
    part.name = "fsdp"
    return part


def _model_parallel() -> Part:
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


def _fp8() -> Part:
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


def _micro_batch() -> Part:
    _need_cuda()
    import lightning.pytorch as pl

    from lightning_accel.callbacks import MicroBatchFinder

    cap = 3 * 2**30
    total = torch.cuda.get_device_properties(0).total_memory
    gpt = _gpt_class()

    class _SGD(gpt):  # type: ignore[misc, valid-type]
        """Plain SGD: the weights then differ by what the gradients differ (Adam's first steps amplify rounding)."""

        def configure_optimizers(self) -> object:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class _OOMOnce(_SGD):
        """A real CUDA out-of-memory error from the allocator, once, in the first piece of optimizer step 3."""

        oom_at = 3

        def training_step(self, batch: object, batch_idx: int) -> object:
            if self.global_step == self.oom_at:
                self.oom_at = -1
                torch.empty(total, dtype=torch.uint8, device="cuda")  # more than the cap: raises OutOfMemoryError
            return super().training_step(batch, batch_idx)

    data = torch.randint(0, 256, (6 * 128, 257), generator=torch.Generator().manual_seed(0))
    pairs = list(zip(data[:, :-1], data[:, 1:], strict=True))
    runs = {}
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    try:
        for name, finder in (("auto", MicroBatchFinder(grow_after=None)), ("fixed 8", MicroBatchFinder(8))):
            pl.seed_everything(0)
            model = (_OOMOnce if name == "auto" else _SGD)(block_size=256, n_layer=4, n_head=8, n_embd=512)
            trainer = pl.Trainer(accelerator="cuda", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, callbacks=[finder])  # fmt: skip
            started = time.perf_counter()
            trainer.fit(model, torch.utils.data.DataLoader(pairs, batch_size=128))
            runs[name] = (finder, time.perf_counter() - started, [p.detach().float().cpu() for p in model.parameters()])
            del model, trainer
            torch.cuda.empty_cache()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    finder, seconds, weights = runs["auto"]
    drift = max(float((a - b).abs().max()) for a, b in zip(weights, runs["fixed 8"][2], strict=True))
    trials = ", ".join(f"{t.size}: {'fits' if t.fits else 'no'}" + (f" ({t.peak_bytes / 2**30:.2f} GiB)"
                       if t.peak_bytes else "") for t in (finder.search.trials if finder.search else ()))  # fmt: skip
    # >= 1: a real OOM of its own during training (the cap limits reserved memory, fragmentation included) is fine
    ok = finder.found is not None and finder.found < 128 and finder.oom_recoveries >= 1 and drift <= 1e-3
    ok = ok and finder.size is not None and finder.size <= finder.found // 2
    return Part(name="micro_batch", status="PASS" if ok else "FAIL",
                detail=f"cap {cap / 2**30:.0f} GiB, GPT 4x512, block 256, batch 128, 6 steps",
                figures={"micro-batch found": str(finder.found), "trials": trials,
                         "after the injected OOM": f"{finder.size} ({finder.oom_recoveries} recoveries)",
                         "max |w_auto - w_fixed8|": f"{drift:.2e}", "fit s (auto, fixed 8)":
                         f"{seconds:.1f}, {runs['fixed 8'][1]:.1f}"})  # fmt: skip


PARTS: dict[str, Callable[[], Part]] = {
    "nvml_vs_torch": _nvml_vs_torch, "gpu_monitor_overhead": _gpu_monitor_overhead, "gpt_precision": _gpt_precision,
    "mfu": _mfu, "doctor": _doctor, "fsdp": _fsdp, "model_parallel": _model_parallel, "fp8": _fp8,
    "micro_batch": _micro_batch,
}  # fmt: skip


def run_checks(names: Sequence[str] | None = None) -> list[Part]:
    """Run the named parts (all by default); a part that cannot run is SKIP with the reason, one that breaks FAIL."""
    parts = []
    for name in names or PARTS:
        try:
            part = PARTS[name]()
            part.name = name
        except _Skip as why:
            part = Part(name=name, status="SKIP", detail=str(why))
        except Exception as err:  # one broken part must not hide the others
            part = Part(name=name, status="FAIL", detail=f"{type(err).__name__}: {err}",
                        figures={"traceback": traceback.format_exc().strip().splitlines()[-1]})  # fmt: skip
        parts.append(part)
    return parts


def render(parts: Sequence[Part]) -> str:
    """The Markdown report: the machine, then one row per part and its figures."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    lines = ["# lightning_accel GPU check", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
             f"- device: {device}", f"- torch: {torch.__version__} (CUDA {torch.version.cuda})",
             f"- python: {platform.python_version()} on {platform.platform()}", "",
             "| part | status | detail |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {p.name} | {p.status} | {p.detail.replace('|', '/')} |" for p in parts]
    for part in parts:
        if part.figures:
            lines += ["", f"## {part.name}", ""] + [f"- {k}: {v}" for k, v in part.figures.items()]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_accel.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.md", help="the Markdown report to write (default: gpu_check.md)")
    parser.add_argument("--parts", nargs="*", choices=list(PARTS), help="run only these parts (default: all)")
    args = parser.parse_args(argv)
    root = str(Path(__file__).resolve().parent.parent)  # `examples` sits beside the package in a checkout
    if root not in sys.path:
        sys.path.insert(0, root)
    os.environ.setdefault("TMPDIR", tempfile.gettempdir())
    parts = run_checks(args.parts)
    Path(args.out).write_text(render(parts))
    for part in parts:
        print(f"{part.status:4}  {part.name}: {part.detail}")
    print(f"report: {args.out}")
    return 1 if any(p.status == "FAIL" for p in parts) else 0


if __name__ == "__main__":
    sys.exit(main())
