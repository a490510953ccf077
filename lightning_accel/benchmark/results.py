"""The table's arithmetic: speedup over the reference stage, the quality verdict, MFU and the bottleneck verdict."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_accel.telemetry.peak_flops import compute_dtype, lookup_peak_flops

__all__ = [
    "StageResult",
    "bottleneck",
    "finalize",
    "higher_is_better",
    "model_flops_utilization",
    "quality_verdict",
    "speedups",
]

STATUSES = ("ok", "skipped", "failed")
INPUT_SHARE = 0.20
"""A stage is input-bound when at least this share of its step time waits for data ..."""
INPUT_SHARE_LOW_UTIL = 0.10
"""... or this share while the GPU is busy less than `LOW_GPU_UTIL_PCT` of the time."""
LOW_GPU_UTIL_PCT = 60.0
COMMUNICATION_SHARE = 0.25
"""Communication-bound: the estimated all-reduce wait is at least this share of the step."""
MEMORY_FRACTION = 0.90
"""Memory-bound: the peak memory is at least this fraction of the device's (the host's on a CPU)."""
_HIGHER_IS_BETTER = ("acc", "accuracy", "f1", "auc", "auroc", "precision", "recall", "iou", "miou", "map", "bleu",
                     "rouge", "score", "r2", "dice", "psnr", "ssim")
_LOWER_IS_BETTER = ("loss", "error", "err", "mae", "mse", "rmse", "mape", "smape", "ppl", "perplexity", "bpc", "wer",
                    "cer", "nll")


@dataclass(kw_only=True)
class StageResult:
    """One row of the table: the stage, its status and what was measured (`time_s` and the rest are None unless ok)."""

    name: str
    changes: str = ""
    """What the stage changes, in words ("bf16-mixed, num_workers=2")."""
    status: str = "ok"
    reason: str = ""
    """Why the stage was skipped or failed."""
    overrides: list[str] = field(default_factory=list)
    world_size: int = 1
    steps: int | None = None
    time_s: float | None = None
    """Training time of the stage (validation passes excluded): the time column, and the speedup's input."""
    process_s: float | None = None
    """Wall time of the stage's process, start-up and data loading included."""
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    time_to_target_s: float | None = None
    peak_memory_bytes: int | None = None
    memory_total_bytes: int | None = None
    memory_kind: str = ""
    device: str = ""
    dtype: str = ""
    mfu: float | None = None
    mfu_note: str = ""
    gpu_utilization_pct: float | None = None
    metric_value: float | None = None
    split: dict[str, float] = field(default_factory=dict)
    """Shares of the steady step time: data, forward, backward, optimizer (and communication when estimated)."""
    speedup: float | None = None
    quality: str = "n/a"
    """"pass", "FAIL" (worse than the reference by more than the tolerance) or "n/a"."""
    quality_delta_pct: float | None = None
    bottleneck: str = ""
    bottleneck_why: str = ""
    next_step: str = ""
    measurement: dict[str, Any] = field(default_factory=dict)
    """The stage's raw `BenchMonitor` record."""


def higher_is_better(metric: str) -> bool:
    """Whether a metric's name says higher is better (accuracy, F1, AUC, ...); losses, errors, perplexity, bpc are
    lower. Whole words of the name's last part count (`val/top1_acc`, `map_50`), and an error word wins
    (`val/mape`, `acc_error`)."""
    words = [w for w in re.split(r"[^a-z0-9]+", metric.rsplit("/", 1)[-1].lower()) if w]
    if any(w in _LOWER_IS_BETTER for w in words):
        return False
    return any(w in _HIGHER_IS_BETTER or w.startswith(("acc", "top")) for w in words)


def speedups(results: Sequence[StageResult]) -> StageResult | None:
    """Set `speedup = reference time / stage time` on every measured stage; the reference is the first stage that
    ran (the baseline, unless it was skipped or failed). Returns the reference."""
    reference = next((r for r in results if r.status == "ok" and r.time_s), None)
    for result in results:
        ok = reference is not None and result.status == "ok" and result.time_s
        result.speedup = reference.time_s / result.time_s if ok else None  # type: ignore[operator,union-attr]
    return reference


def quality_verdict(
    value: float | None, reference: float | None, mode: str, tolerance: float
) -> tuple[str, float | None]:
    """("pass" | "FAIL" | "n/a", signed % change) of a stage's metric against the reference stage's.

    The stage fails when it is worse than the reference by more than `tolerance` (a fraction of the reference's
    magnitude): above `reference * (1 + tolerance)` when lower is better (`mode="min"`), below `reference *
    (1 - tolerance)` when higher is better. Exactly at the boundary passes.
    """
    if value is None or reference is None or not math.isfinite(value) or not math.isfinite(reference):
        return "n/a", None
    delta_pct = 100.0 * (value - reference) / abs(reference) if reference else 0.0
    worse = (value - reference) if mode == "min" else (reference - value)
    limit = tolerance * abs(reference)
    return ("FAIL" if worse > limit + 1e-12 * max(1.0, abs(reference)) else "pass"), delta_pct


def model_flops_utilization(
    flops_per_batch: float | None, batches: int, seconds: float, peak_flops: float | None
) -> float | None:
    """Achieved FLOP/s of one device (`flops_per_batch * batches / seconds`) over its peak; None when unknown."""
    if not flops_per_batch or not peak_flops or seconds <= 0 or batches <= 0:
        return None
    return flops_per_batch * batches / seconds / peak_flops


def bottleneck(
    split: dict[str, float], gpu_utilization_pct: float | None, memory_fraction: float | None, world_size: int
) -> tuple[str, str]:
    """(verdict, why): input-bound, communication-bound, memory-bound or compute-bound, checked in that order.

    Args:
        split: shares of the steady step time: `data`, `forward`, `backward`, `optimizer`, and `communication` (the
            estimated all-reduce wait, for multi-process stages).
        gpu_utilization_pct: mean GPU utilisation; None on a CPU.
        memory_fraction: peak memory over the device's (the host's on a CPU); None when unknown.
        world_size: processes of the stage.
    """
    data = split.get("data", 0.0)
    if data >= INPUT_SHARE:
        return "input-bound", f"{data:.0%} of the step waits for data"
    if gpu_utilization_pct is not None and gpu_utilization_pct < LOW_GPU_UTIL_PCT and data >= INPUT_SHARE_LOW_UTIL:
        return "input-bound", f"GPU busy {gpu_utilization_pct:.0f}%, {data:.0%} of the step waits for data"
    communication = split.get("communication")
    if world_size > 1 and communication is not None and communication >= COMMUNICATION_SHARE:
        return "communication-bound", f"~{communication:.0%} of the step waits for gradient communication (est.)"
    if memory_fraction is not None and memory_fraction >= MEMORY_FRACTION:
        return "memory-bound", f"peak memory {memory_fraction:.0%} of the device's"
    compute = split.get("forward", 0.0) + split.get("backward", 0.0) + split.get("optimizer", 0.0)
    compute -= communication or 0.0
    util = f", GPU busy {gpu_utilization_pct:.0f}%" if gpu_utilization_pct is not None else ""
    return "compute-bound", f"{compute:.0%} of the step computes{util}"


# The ladder's next rung for each stage, when the stage is compute-bound.
_NEXT_RUNG = {"baseline": "amp", "amp": "ddp", "ddp": "model_parallel", "fsdp": "model_parallel"}


def next_step(result: StageResult, verdict: str, num_workers: int | None, precision: str, accumulate: int = 1,
              family: str = "") -> str:  # fmt: skip
    """What to try after a stage with this verdict, as a preset or a setting; none the stage already has."""
    if verdict == "input-bound":
        if not num_workers:
            return "preset=amp (DataLoader workers), or raise `data.num_workers`"
        return f"raise `data.num_workers` (now {num_workers}), `data.pin_memory=true`"
    if verdict == "communication-bound":
        options = [] if accumulate > 1 else ["accumulation=fixed (4x fewer gradient reductions)"]
        if family == "ddp":
            options.append("`ddp_grad_compression=bf16` on CUDA")
        if family not in ("model_parallel", "fsdp"):
            options.append("strategy=model_parallel")
        options.append("a faster interconnect (`nccl=ib`) or fewer, larger processes")
        return ", or ".join(options)
    if verdict == "memory-bound":
        return "strategy=model_parallel (shards the model), or `callbacks.parallelize.activation_checkpointing=true`"
    if precision.startswith("32") or precision.startswith("64"):
        return "preset=amp (mixed precision)"
    rung = _NEXT_RUNG.get(result.name)
    if rung:
        return f"preset={rung}" if rung != "model_parallel" else "strategy=model_parallel with accumulation"
    return "more devices (`trainer.devices`, `trainer.num_nodes`) or a larger batch"


def finalize(
    results: Sequence[StageResult],
    *,
    mode: str,
    tolerance: float,
    peak_tflops: float | None = None,
    settings: dict[str, dict[str, Any]] | None = None,
) -> StageResult | None:
    """Fill the derived columns of every measured stage from its `measurement`: rates, MFU, split, speedup, quality,
    bottleneck and next step. Returns the reference stage (None when no stage ran).

    Args:
        results: the stages in ladder order.
        mode: `min` or `max` for the quality metric.
        tolerance: the quality tolerance, a fraction (0.02 = 2%).
        peak_tflops: a per-device peak that overrides the table (for MFU).
        settings: per stage name, `{"num_workers": int, "precision": str}` for the next-step advice.
    """
    settings = settings or {}
    for result in results:
        if result.status == "ok":
            _derive(result, peak_tflops)
    _estimate_communication(results)
    reference = speedups(results)
    for result in results:
        if result.status != "ok":
            continue
        ref_value = reference.metric_value if reference is not None else None
        result.quality, result.quality_delta_pct = quality_verdict(result.metric_value, ref_value, mode, tolerance)
        memory_fraction = None
        if result.peak_memory_bytes and result.memory_total_bytes:
            memory_fraction = result.peak_memory_bytes / result.memory_total_bytes
        result.bottleneck, result.bottleneck_why = bottleneck(
            result.split, result.gpu_utilization_pct, memory_fraction, result.world_size
        )
        stage = settings.get(result.name, {})
        precision = str(stage.get("precision") or result.measurement.get("precision", ""))
        accumulate, family = int(stage.get("accumulate") or 1), str(stage.get("family") or "")
        result.next_step = next_step(result, result.bottleneck, stage.get("num_workers"), precision,
                                     accumulate=accumulate, family=family)  # fmt: skip
    return reference


def _derive(result: StageResult, peak_tflops: float | None) -> None:
    m = result.measurement
    result.world_size = int(m.get("world_size", 1))
    result.time_s = float(m.get("train_s", 0.0)) or None
    steady_s = float(m.get("steady_s", 0.0))
    if steady_s > 0:
        result.samples_per_s = m.get("steady_samples", 0) / steady_s
        result.tokens_per_s = (m.get("steady_tokens", 0) / steady_s) or None
        result.split = {key: float(m.get(f"{key}_s", 0.0)) / steady_s for key in ("data", "forward", "backward",
                                                                                  "optimizer")}  # fmt: skip
    result.time_to_target_s = m.get("time_to_target_s")
    result.peak_memory_bytes = m.get("peak_memory_bytes")
    result.memory_total_bytes = m.get("memory_total_bytes")
    result.memory_kind = m.get("memory_kind", "")
    result.device = m.get("device", "")
    result.gpu_utilization_pct = m.get("gpu_utilization_pct")
    result.metric_value = m.get("final_metric")
    capability = m.get("compute_capability")  # TF32 from Ampere (8.0) on; a record without it: assume a GPU has it
    tf32 = result.device != "cpu" and (not capability or tuple(capability) >= (8, 0))
    result.dtype = compute_dtype(m.get("precision", ""), m.get("float32_matmul_precision"), tf32_capable=tf32)
    peak = lookup_peak_flops(result.device, result.dtype, peak_tflops)
    result.mfu = model_flops_utilization(
        m.get("flops_per_batch"), int(m.get("steady_batches", 0)), steady_s, peak.flops
    )
    if result.mfu is not None:
        result.mfu_note = f"{result.dtype} peak {peak.flops / 1e12:g} TFLOP/s ({peak.source})"  # type: ignore[operator]
    elif peak.flops is None:
        result.mfu_note = peak.reason
    else:
        result.mfu_note = "the model declares no FLOPs and none were counted"


def _estimate_communication(results: Sequence[StageResult]) -> None:
    """For a multi-process stage: the all-reduce wait, estimated as its backward time per batch beyond that of the
    latest earlier single-process stage of the same precision (same per-process batch), over its step time."""
    for index, result in enumerate(results):
        if result.status != "ok" or result.world_size < 2:
            continue
        single = [r for r in results[:index] if r.status == "ok" and r.world_size == 1 and r.dtype == result.dtype]
        if not single or not result.split:
            continue
        ref = single[-1]
        per_batch = _backward_per_batch(result)
        ref_per_batch = _backward_per_batch(ref)
        step = _step_per_batch(result)
        if per_batch is None or ref_per_batch is None or not step:
            continue
        result.split["communication"] = max(0.0, per_batch - ref_per_batch) / step


def _backward_per_batch(result: StageResult) -> float | None:
    m = result.measurement
    batches = m.get("steady_batches", 0)
    return float(m.get("backward_s", 0.0)) / batches if batches else None


def _step_per_batch(result: StageResult) -> float | None:
    m = result.measurement
    batches = m.get("steady_batches", 0)
    return float(m.get("steady_s", 0.0)) / batches if batches else None
