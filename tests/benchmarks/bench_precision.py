"""Step time of the GPT example under each precision preset against fp32; a benchmark: it measures, asserts nothing.

Every option of the `precision` config group (as Hydra lists it) is composed with the packaged GPT example, resolved
for the device exactly as `accel-train` does, and trained for `--warmup` + `--steps` optimizer steps; the steps after
the warm-up are timed (data loading between them included), and the fastest of `--repeats` runs is reported.
Presets that cannot run on the device (fp8 without a CUDA GPU of compute capability 8.9+ and transformer-engine or
torchao) are listed with the reason.

Run:
    python tests/benchmarks/bench_precision.py [--steps N] [--warmup N] [--repeats N] [--device cpu|cuda] [OVERRIDE ...]
    e.g.  python tests/benchmarks/bench_precision.py --device cuda --steps 200 model.n_embd=512 model.n_layer=8
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from dataclasses import dataclass
from importlib import resources
from tempfile import TemporaryDirectory

import lightning.pytorch as pl
import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from lightning_accel.checks import check_config
from lightning_accel.compose import apply_precision, precision_callbacks
from lightning_accel.errors import ConfigError
from lightning_accel.system import read_cpu_info


@dataclass
class Row:
    preset: str
    precision: str
    ms_per_step: float
    samples_per_s: float
    final_loss: float


class StepTimer(pl.Callback):
    """Wall time from the start of training batch `warmup` to the end of the last batch."""

    def __init__(self, warmup: int, cuda: bool) -> None:
        self.warmup = warmup
        self.cuda = cuda
        self.started = self.ended = 0.0
        self.timed_steps = 0

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step == self.warmup and not self.started:
            self.started = self._now()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        if self.started:
            self.ended = self._now()
            self.timed_steps += 1


def precision_presets() -> list[str]:
    """The `precision` options this package ships, as Hydra lists them (fp32 first)."""
    conf = resources.files("lightning_accel.conf")
    loader = GlobalHydra.instance().config_loader()
    options = [o for o in loader.get_group_options("precision") if conf.joinpath("precision", f"{o}.yaml").is_file()]
    return sorted(options, key=lambda option: option != "fp32")


def bench(preset: str, device: str, steps: int, warmup: int, root_dir: str, overrides: list[str]) -> Row:
    """Train the GPT example for `warmup + steps` steps under `preset`; ConfigError when it cannot run here."""
    cfg = compose(
        "train",
        overrides=[
            f"precision={preset}",
            f"trainer.accelerator={device}",
            "trainer.devices=1",
            "strategy=auto",
            "accumulation=none",
            "logger=none",
            "callbacks=none",
            f"trainer.max_steps={warmup + steps}",
            "trainer.max_epochs=-1",
            "trainer.limit_val_batches=0",
            "++trainer.enable_checkpointing=false",
            "++trainer.enable_model_summary=false",
            "trainer.enable_progress_bar=false",
            f"trainer.default_root_dir={root_dir}",
            *overrides,
        ],
    )
    check_config(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16_mixed on CPU warns that it runs bf16: the table says so
        resolved = apply_precision(cfg)
    pl.seed_everything(cfg.seed, verbose=False)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    timer = StepTimer(warmup, cuda=device == "cuda")
    trainer = instantiate(cfg.trainer, callbacks=[*precision_callbacks(resolved), timer], logger=False)
    trainer.fit(model, datamodule=datamodule)
    seconds = (timer.ended - timer.started) / max(timer.timed_steps, 1)
    loss = float(trainer.callback_metrics["train/loss"])
    return Row(preset, resolved.value, 1000 * seconds, datamodule.batch_size / seconds, loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="timed training steps per preset")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (allocator, autocast caches)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per preset; the fastest is reported")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the GPT example, e.g. model.n_embd=256")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="lightning")
    matmul = torch.get_float32_matmul_precision()

    GlobalHydra.instance().clear()
    rows: list[Row] = []
    skipped: list[tuple[str, str]] = []
    config_module = "lightning_accel.conf"
    with initialize_config_module(config_module=config_module, version_base="1.3"), TemporaryDirectory() as tmp:
        for preset in precision_presets():
            try:
                runs = [
                    bench(preset, args.device, args.steps, args.warmup, tmp, args.overrides)
                    for _ in range(args.repeats)
                ]
                rows.append(min(runs, key=lambda row: row.ms_per_step))
            except ConfigError as err:
                skipped.append((preset, str(err)))
            finally:
                torch.set_float32_matmul_precision(matmul)
    if args.device == "cuda":
        major, minor = torch.cuda.get_device_capability(0)
        where = f"{torch.cuda.get_device_name(0)} (compute capability {major}.{minor})"
    else:
        cpu = read_cpu_info()
        where = f"{cpu.model_name or 'CPU'}, {torch.get_num_threads()} threads; {cpu.describe_bf16()}"
    print(f"\nGPT example, best of {args.repeats} runs of {args.steps} timed steps after {args.warmup} warm-up")
    print(f"{where}; torch {torch.__version__}; overrides: {' '.join(args.overrides) or 'none'}")
    print(f"{'preset':<12} {'precision':<20} {'ms/step':>9} {'samples/s':>10} {'vs fp32':>8} {'final loss':>11}")
    fp32 = next((row.ms_per_step for row in rows if row.preset == "fp32"), None)
    for row in rows:
        speedup = f"{fp32 / row.ms_per_step:.2f}x" if fp32 else "-"
        print(
            f"{row.preset:<12} {row.precision:<20} {row.ms_per_step:>9.1f} {row.samples_per_s:>10.1f} "
            f"{speedup:>8} {row.final_loss:>11.4f}"
        )
    for preset, reason in skipped:
        print(f"{preset:<12} skipped: {reason}")


if __name__ == "__main__":
    main()
