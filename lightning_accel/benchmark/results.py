"""The table's arithmetic: medians and intervals over a stage's runs, speedup over the reference stage with its
interval, the noise-aware quality verdict, MFU, energy and the bottleneck verdict."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_accel.benchmark.moves import Bottleneck, advised
from lightning_accel.measure import Interval, ratio, summarize, verdict
from lightning_accel.telemetry.peak_flops import compute_dtype, lookup_peak_flops

__all__ = [
    "Quality",
    "RunStatus",
    "StageResult",
    "StageRun",
    "StageStatus",
    "counted_runs",
    "bottleneck",
    "finalize",
    "higher_is_better",
    "model_flops_utilization",
    "next_step",
    "quality_verdict",
    "speedups",
]

StageStatus = Literal["ok", "skipped", "failed"]
RunStatus = Literal["ok", "failed"]
Quality = Literal["pass", "FAIL", "n/a"]
INPUT_SHARE = 0.20
"""A stage is input-bound when at least this share of its step time waits for data ..."""
INPUT_SHARE_LOW_UTIL = 0.10
"""... or this share while the GPU is busy less than `LOW_GPU_UTIL_PCT` of the time."""
LOW_GPU_UTIL_PCT = 60.0
COMMUNICATION_SHARE = 0.25
"""Communication-bound: the estimated all-reduce wait is at least this share of the step."""
MEMORY_FRACTION = 0.90
"""Memory-bound: the peak memory is at least this fraction of the device's (the host's on a CPU)."""
_HIGHER_IS_BETTER = (
    "acc",
    "accuracy",
    "f1",
    "auc",
    "auroc",
    "precision",
    "recall",
    "iou",
    "miou",
    "map",
    "bleu",
    "rouge",
    "score",
    "r2",
    "dice",
    "psnr",
    "ssim",
)
_LOWER_IS_BETTER = (
    "loss",
    "error",
    "err",
    "mae",
    "mse",
    "rmse",
    "mape",
    "smape",
    "ppl",
    "perplexity",
    "bpc",
    "wer",
    "cer",
    "nll",
)


@dataclass(kw_only=True)
class StageRun:
    """One run of a stage: one fresh `accel-train` process, in one round, from one seed."""

    round: int
    seed: int | None = None
    status: RunStatus = "ok"
    reason: str = ""
    process_s: float | None = None
    measurement: dict[str, Any] = field(default_factory=dict)
    """The run's `BenchMonitor` record."""
    interference: dict[str, Any] | None = None
    """What else ran meanwhile (`lightning_accel.system.interference.Interference.as_dict()`)."""
    flagged: bool = False
    """Measured under interference (others took more than the threshold of the CPUs, steal, or GPU processes)."""
    replaced: bool = False
    """A flagged run that a rerun of the same round replaced: kept for the record, not counted."""

    @property
    def time_s(self) -> float | None:
        value = self.measurement.get("train_s")
        return float(value) if self.status == "ok" and value else None

    @property
    def samples_per_s(self) -> float | None:
        steady = float(self.measurement.get("steady_s", 0.0) or 0.0)
        return self.measurement.get("steady_samples", 0) / steady if self.status == "ok" and steady > 0 else None

    @property
    def metric(self) -> float | None:
        value = self.measurement.get("final_metric") if self.status == "ok" else None
        return float(value) if value is not None and math.isfinite(value) else None


@dataclass(kw_only=True)
class StageResult:
    """One row of the table: the stage, its status, its runs and what they measured (medians over the counted runs;
    `time_s` and the rest are None unless ok)."""

    name: str
    changes: str = ""
    """What the stage changes, in words ("bf16-mixed, num_workers=2")."""
    status: StageStatus = "ok"
    reason: str = ""
    """Why the stage was skipped or failed."""
    overrides: list[str] = field(default_factory=list)
    world_size: int = 1
    steps: int | None = None
    runs: list[StageRun] = field(default_factory=list)
    time_s: float | None = None
    """Median training time of the counted runs (validation passes excluded): the time column."""
    time_interval: dict[str, Any] | None = None
    """`Interval.as_dict()` of the training times: median, low, high, n, method."""
    process_s: float | None = None
    """Wall time of the stage's process, start-up and data loading included."""
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    time_to_target_s: float | None = None
    peak_memory_bytes: int | None = None
    memory_total_bytes: int | None = None
    memory_kind: str = ""
    micro_batch: int | None = None
    """Samples per forward on one device (MicroBatchFinder's size, else the loader's batch), of the middle run."""
    micro_batch_auto: bool = False
    micro_batch_recoveries: int = 0
    loader: dict[str, Any] | None = None
    """The train DataLoader settings a DataLoaderTuner applied, of the middle run (None without one)."""
    device: str = ""
    dtype: str = ""
    mfu: float | None = None
    mfu_note: str = ""
    gpu_utilization_pct: float | None = None
    metric_value: float | None = None
    split: dict[str, float] = field(default_factory=dict)
    """Shares of the steady step time: data, forward, backward, optimizer (and communication when estimated)."""
    samples_interval: dict[str, Any] | None = None
    metric_interval: dict[str, Any] | None = None
    """Over the runs' seeds: the metric's own spread."""
    speedup: float | None = None
    """Median of the rounds' speedups over the reference stage (paired by round)."""
    speedup_interval: dict[str, Any] | None = None
    speedup_verdict: str = ""
    """"faster", "slower" or "no clear difference" (the interval holds 1.0)."""
    interference: bool = False
    """Every counted run of this stage (or of the reference, for its speedup) was measured under interference."""
    interference_note: str = ""
    energy_j: float | None = None
    """Median energy of a run's training (all GPUs of the stage, or the CPU package by RAPL), in joules."""
    energy_j_per_sample: float | None = None
    energy_note: str = ""
    """How the energy was read, or why it is n/a."""
    reference_steps: int | None = None
    """Optimizer steps of the reference stage, when this stage ran another number."""
    quality: Quality = "n/a"
    """"pass", "FAIL" (worse than the reference by more than both the tolerance and the reference's seed-to-seed
    noise) or "n/a"."""
    quality_delta_pct: float | None = None
    quality_noise: float | None = None
    """The reference's seed-to-seed spread of the metric (max - min over its runs); 0 with one run."""
    bottleneck: Bottleneck = ""
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


def counted_runs(result: StageResult) -> tuple[list[StageRun], bool]:
    """(the runs a stage's figures come from, whether they were measured under interference): its finished runs
    that no rerun replaced, the unflagged ones when there are any."""
    runs = result.runs
    if not runs and result.time_s:  # a row given its figures directly counts as one run of them
        runs = [
            StageRun(
                round=0,
                measurement={"train_s": result.time_s, "steady_s": 1.0, "steady_samples": result.samples_per_s or 0.0},
            )
        ]
    finished = [r for r in runs if r.status == "ok" and not r.replaced and r.time_s]
    quiet = [r for r in finished if not r.flagged]
    return (quiet, False) if quiet else (finished, bool(finished))


def _by_round(runs: Sequence[StageRun], value: str, rounds: Sequence[int]) -> list[float | None]:
    found = {r.round: getattr(r, value) for r in runs}
    return [found.get(k) for k in rounds]


def speedups(results: Sequence[StageResult], by: Literal["time", "throughput"] = "time") -> StageResult | None:
    """Set each measured stage's speedup over the reference, the first stage that ran (the baseline, unless it was
    skipped or failed), with its interval and verdict. Returns the reference.

    `by="time"`: reference time / stage time (every stage trained the same samples); `"throughput"`: stage samples/s
    over the reference's (the stages trained different amounts: `--match steps`, a time budget). Each round's pair
    gives one speedup (`lightning_accel.measure.ratio`); a stage whose counted runs, or the reference's, were all
    measured under interference is flagged.
    """
    reference = next((r for r in results if r.status == "ok" and r.time_s), None)
    ref_runs, ref_flagged = counted_runs(reference) if reference is not None else ([], False)
    for result in results:
        result.speedup = result.speedup_interval = None
        result.speedup_verdict = ""
        if reference is None or result.status != "ok" or not result.time_s:
            continue
        runs, flagged = counted_runs(result)
        rounds = sorted({r.round for r in runs} | {r.round for r in ref_runs})
        if by == "time":
            tops, bottoms = _by_round(ref_runs, "time_s", rounds), _by_round(runs, "time_s", rounds)
        else:
            tops, bottoms = _by_round(runs, "samples_per_s", rounds), _by_round(ref_runs, "samples_per_s", rounds)
        try:
            interval = ratio(tops, bottoms)
        except ValueError:
            continue
        result.speedup, result.speedup_interval = interval.median, interval.as_dict()
        result.speedup_verdict = "" if result is reference else verdict(interval)
        if (flagged or ref_flagged) and result is not reference:
            result.interference = True
            whose = "this stage's runs" if flagged else f"the reference `{reference.name}`'s runs"
            result.interference_note = result.interference_note or f"{whose} were measured under interference"
    return reference


def quality_verdict(
    value: float | None, reference: float | None, mode: str, tolerance: float, noise: float = 0.0
) -> tuple[Quality, float | None]:
    """("pass" | "FAIL" | "n/a", signed % change) of a stage's metric against the reference stage's.

    The stage fails when it is worse than the reference by more than both `tolerance` (a fraction of the
    reference's magnitude) and `noise` (the reference's own seed-to-seed spread, in the metric's units): above
    `reference + max(tolerance * |reference|, noise)` when lower is better (`mode="min"`), below `reference -
    max(...)` when higher is better. Exactly at the boundary passes.
    """
    if value is None or reference is None or not math.isfinite(reference):
        return "n/a", None
    if not math.isfinite(value):  # the stage diverged (NaN/inf) where the reference did not
        return "FAIL", None
    delta_pct = 100.0 * (value - reference) / abs(reference) if reference else 0.0
    worse = (value - reference) if mode == "min" else (reference - value)
    limit = max(tolerance * abs(reference), noise if math.isfinite(noise) else 0.0)
    return ("FAIL" if worse > limit + 1e-12 * max(1.0, abs(reference)) else "pass"), delta_pct


def model_flops_utilization(
    flops_per_batch: float | None, batches: int, seconds: float, peak_flops: float | None, model_parallel_size: int = 1
) -> float | None:
    """Achieved FLOP/s of one device over its peak; None when unknown.

    `flops_per_batch` is the whole model's over one data-parallel rank's batch; the `model_parallel_size` devices
    (tensor-parallel ranks, pipeline stages) that share that batch each do their part of it.
    """
    if not flops_per_batch or not peak_flops or seconds <= 0 or batches <= 0:
        return None
    return flops_per_batch * batches / seconds / peak_flops / max(1, model_parallel_size)


def _model_parallel_size(measurement: dict[str, Any]) -> int:
    """Devices sharing one batch: `model_parallel_size` when recorded, else the world over the data-parallel size."""
    if measurement.get("model_parallel_size"):
        return max(1, int(measurement["model_parallel_size"]))
    data_parallel = int(measurement.get("data_parallel_size") or 0)
    return max(1, int(measurement.get("world_size", 1)) // data_parallel) if data_parallel > 0 else 1


def bottleneck(
    split: dict[str, float], gpu_utilization_pct: float | None, memory_fraction: float | None, world_size: int
) -> tuple[Bottleneck, str]:
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


def next_step(
    result: StageResult, verdict: str, num_workers: int | None, precision: str, accumulate: int = 1, family: str = ""
) -> str:
    """What to try after a stage with this verdict, as a preset or a setting; none the stage already has. For an
    input-, communication- or memory-bound stage: the moves of `moves.MOVES` that address it (the table accel-tune's
    search reads); otherwise the next rung of the ladder."""
    if verdict in ("input-bound", "communication-bound", "memory-bound"):
        have = {"precision": "32-true" if precision.startswith(("32", "64")) else "amp"}
        if family not in ("", "auto", "single_device"):
            have["strategy"] = "model_parallel" if family == "fsdp" else family  # both shard the model
        if accumulate > 1:
            have["accumulation"] = "fixed"
        if num_workers:
            have["data.num_workers"] = str(num_workers)
        return ", or ".join(advised(verdict, have))
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
    speedup_by: Literal["time", "throughput"] = "time",
) -> StageResult | None:
    """Fill the derived columns of every measured stage from its runs: medians and intervals, rates, MFU, split,
    energy, speedup, quality, bottleneck and next step. Returns the reference stage (None when no stage ran).

    A stage's figures come from its counted runs (`counted_runs`); the split, memory and MFU from the run whose time
    is the median's (the lower middle one for an even count).

    Args:
        results: the stages in ladder order.
        mode: `min` or `max` for the quality metric.
        tolerance: the quality tolerance, a fraction (0.02 = 2%).
        peak_tflops: a per-device peak that overrides the table (for MFU).
        settings: per stage name, `{"num_workers": int, "precision": str}` for the next-step advice.
        speedup_by: see `speedups`.
    """
    settings = settings or {}
    for result in results:
        if result.status == "ok":
            _aggregate(result, peak_tflops)
    _estimate_communication(results)
    reference = speedups(results, by=speedup_by)
    ref_metrics = [r.metric for r in (reference.runs if reference else []) if r.metric is not None and not r.replaced]
    noise = (max(ref_metrics) - min(ref_metrics)) if len(ref_metrics) > 1 else 0.0
    for result in results:
        if result.status != "ok":
            continue
        ref_value = reference.metric_value if reference is not None else None
        result.quality, result.quality_delta_pct = quality_verdict(
            result.metric_value, ref_value, mode, tolerance, noise
        )
        result.quality_noise = noise if reference is not None else None
        if reference is not None and result.steps is not None and reference.steps is not None:
            result.reference_steps = reference.steps if result.steps != reference.steps else None
        memory_fraction = None
        if result.peak_memory_bytes and result.memory_total_bytes:
            memory_fraction = result.peak_memory_bytes / result.memory_total_bytes
        result.bottleneck, result.bottleneck_why = bottleneck(
            result.split, result.gpu_utilization_pct, memory_fraction, result.world_size
        )
        stage = settings.get(result.name, {})
        precision = str(stage.get("precision") or result.measurement.get("precision", ""))
        accumulate, family = int(stage.get("accumulate") or 1), str(stage.get("family") or "")
        result.next_step = next_step(
            result, result.bottleneck, stage.get("num_workers"), precision, accumulate=accumulate, family=family
        )
    return reference


def _summary(values: Sequence[float | None]) -> Interval | None:
    try:
        return summarize([v for v in values if v is not None])
    except ValueError:
        return None


def _aggregate(result: StageResult, peak_tflops: float | None) -> None:
    """The stage's figures from its runs; a stage whose runs all failed becomes `failed` with the last reason."""
    if not result.runs and result.measurement:  # a row made from one measurement (older callers, tests)
        result.runs = [StageRun(round=0, measurement=result.measurement, process_s=result.process_s)]
    runs, flagged = counted_runs(result)
    if not runs:
        failed_runs = [r for r in result.runs if r.status == "failed"]
        result.status = "failed"
        result.reason = failed_runs[-1].reason if failed_runs else "no run finished with a measurement"
        return
    ordered = sorted(runs, key=lambda r: r.time_s or 0.0)
    middle = ordered[(len(ordered) - 1) // 2]
    result.measurement = middle.measurement
    _derive(result, peak_tflops)
    times = _summary([r.time_s for r in runs])
    rates = _summary([r.samples_per_s for r in runs])
    metrics = _summary([r.metric for r in result.runs if not r.replaced])
    result.time_s = times.median if times else result.time_s
    result.time_interval = times.as_dict() if times else None
    result.samples_per_s = rates.median if rates else result.samples_per_s
    result.samples_interval = rates.as_dict() if rates else None
    result.metric_value = metrics.median if metrics else result.metric_value
    result.metric_interval = metrics.as_dict() if metrics else None
    result.process_s = _median_or_none([r.process_s for r in runs])
    energies = [r.measurement.get("energy_j") for r in runs]
    result.energy_j = _median_or_none(energies)
    samples = result.measurement.get("samples") or 0
    result.energy_j_per_sample = result.energy_j / samples if result.energy_j is not None and samples else None
    result.energy_note = str(middle.measurement.get("energy_note", "") or "")
    counted = len(runs)
    failed = sum(r.status == "failed" for r in result.runs)
    flagged_runs = sum(r.flagged for r in result.runs)
    reruns = sum(r.replaced for r in result.runs)
    notes = []
    if flagged:
        result.interference = True
        reasons = next((r.interference or {} for r in runs if r.flagged), {}).get("reasons") or []
        notes.append(f"all {counted} counted run(s) under interference" + (f": {reasons[0]}" if reasons else ""))
    elif flagged_runs:
        notes.append(f"{flagged_runs} run(s) under interference, rerun or left out")
    if reruns:
        notes.append(f"{reruns} rerun(s)")
    if failed:
        notes.append(f"{failed} run(s) failed")
    result.interference_note = "; ".join(notes)


def _median_or_none(values: Sequence[Any]) -> float | None:
    found = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return summarize(found).median if found else None


def _derive(result: StageResult, peak_tflops: float | None) -> None:
    m = result.measurement
    result.world_size = int(m.get("world_size", 1))
    result.time_s = float(m.get("train_s", 0.0)) or None
    steady_s = float(m.get("steady_s", 0.0))
    if steady_s > 0:
        result.samples_per_s = m.get("steady_samples", 0) / steady_s
        result.tokens_per_s = (m.get("steady_tokens", 0) / steady_s) or None
        result.split = {
            key: float(m.get(f"{key}_s", 0.0)) / steady_s for key in ("data", "forward", "backward", "optimizer")
        }
    result.time_to_target_s = m.get("time_to_target_s")
    result.peak_memory_bytes = m.get("peak_memory_bytes")
    result.memory_total_bytes = m.get("memory_total_bytes")
    result.memory_kind = m.get("memory_kind", "")
    result.micro_batch = m.get("micro_batch")
    result.micro_batch_auto = bool(m.get("micro_batch_auto", False))
    result.micro_batch_recoveries = int(m.get("micro_batch_recoveries") or 0)
    result.loader = m.get("loader")
    result.device = m.get("device", "")
    result.gpu_utilization_pct = m.get("gpu_utilization_pct")
    result.metric_value = m.get("final_metric")
    capability = m.get("compute_capability")  # TF32 from Ampere (8.0) on; a record without it: assume a GPU has it
    tf32 = result.device != "cpu" and (not capability or tuple(capability) >= (8, 0))
    result.dtype = compute_dtype(m.get("precision", ""), m.get("float32_matmul_precision"), tf32_capable=tf32)
    peak = lookup_peak_flops(result.device, result.dtype, peak_tflops, sm_count=m.get("sm_count"))
    model_parallel = _model_parallel_size(m)
    result.mfu = model_flops_utilization(
        m.get("flops_per_batch"), int(m.get("steady_batches", 0)), steady_s, peak.flops, model_parallel
    )
    if result.mfu is not None and peak.flops:  # an MFU implies a known peak
        result.mfu_note = f"{result.dtype} peak {peak.flops / 1e12:g} TFLOP/s ({peak.source})"
        if model_parallel > 1:
            result.mfu_note += f", per device of model-parallel degree {model_parallel}"
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
