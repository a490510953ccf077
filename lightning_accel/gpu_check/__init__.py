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
  halving, and the weights after 6 steps equal a run at a fixed micro-batch of 8 (1e-3);
- `health`: card health through NVML (XID event sets, ECC, remapped rows, a lost card) polled three times, no
  reading failing but for "not supported", and `accel-dash agent` publishing every card while this process holds
  memory on one.

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

The package holds one module per part (`<part>_part.py`, whose `check_<part>` returns a `Part`), what they share
(`context.py`: `Part`, `CheckContext`, `Skip`; `gpt_fits.py`: the GPT example's timed CUDA fits), the report
(`check_report.py`) and the table of parts with `run_checks` and `main` (`check_runner.py`).
"""

from __future__ import annotations

from lightning_accel.gpu_check.check_report import plot, render, to_json, write_report
from lightning_accel.gpu_check.check_runner import FULL_PARTS, PARTS, main, run_checks
from lightning_accel.gpu_check.context import CheckContext, Part
from lightning_accel.gpu_check.gpu_monitor_part import OVERHEAD_LIMIT
from lightning_accel.gpu_check.ladder_part import ARTICLE_SPEEDUP, MFU_TARGET, QUALITY_TOLERANCE, ladder_verdict

__all__ = [
    "ARTICLE_SPEEDUP",
    "FULL_PARTS",
    "MFU_TARGET",
    "OVERHEAD_LIMIT",
    "PARTS",
    "QUALITY_TOLERANCE",
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
