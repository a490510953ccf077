"""Dense peak FLOP/s of the usual data-centre and workstation GPUs by compute dtype, for model FLOPs utilisation."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["DTYPES", "PEAK_TFLOPS", "PeakFlops", "compute_dtype", "lookup_peak_flops"]

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8", "fp64")  # fp64 has no peak in the table: MFU n/a unless given
"""Compute dtypes of the table: fp32 on CUDA cores, tf32/bf16/fp16/fp8 on tensor cores (fp32 accumulation)."""

# Dense (no 2:4 sparsity) TFLOP/s per GPU from NVIDIA's datasheets and architecture whitepapers. A missing dtype is
# one the GPU has no fast path for (V100/T4: no bf16 or tf32 tensor cores). Ordered: the first pattern that matches
# the lower-cased device name wins, so the specific names come before the general ones.
PEAK_TFLOPS: tuple[tuple[str, str, dict[str, float]], ...] = (
    (r"gh200", "GH200", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}),
    (r"h200.*nvl", "H200 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5}),
    (r"h200", "H200 SXM", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}),
    (r"h100.*nvl", "H100 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5}),
    (r"h100.*pcie", "H100 PCIe", {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0}),
    (r"h100", "H100 SXM", {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}),
    (r"h800", "H800 SXM", {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}),
    (r"b200", "B200", {"fp32": 75.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0}),
    (r"a100|a800", "A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"l40s", "L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.1, "fp16": 362.1, "fp8": 733.0}),
    (r"l40\b", "L40", {"fp32": 90.5, "tf32": 90.5, "bf16": 181.0, "fp16": 181.0, "fp8": 362.0}),
    (r"\bl4\b", "L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.0}),
    (r"a10g?\b", "A10/A10G", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),  # A10 datasheet
    (r"a6000", "RTX A6000", {"fp32": 38.7, "tf32": 77.4, "bf16": 154.8, "fp16": 154.8}),
    (r"v100s", "V100S", {"fp32": 16.4, "fp16": 130.0}),
    (r"v100.*pcie", "V100 PCIe", {"fp32": 14.0, "fp16": 112.0}),
    (r"v100", "V100 SXM2", {"fp32": 15.7, "fp16": 125.0}),
    (r"\bt4\b", "T4", {"fp32": 8.1, "fp16": 65.0}),
    (r"rtx 4090", "RTX 4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3}),
    (r"rtx 3090", "RTX 3090", {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0}),
)


@dataclass(frozen=True, slots=True)
class PeakFlops:
    """The peak a device reaches in a dtype, or why there is none."""

    flops: float | None
    """FLOP/s per device; None when unknown (then `reason` says why)."""
    dtype: str
    source: str
    """The table row that matched, `--peak-tflops` for an override, or empty."""
    reason: str = ""


def compute_dtype(precision: str, float32_matmul_precision: str | None = None, tf32_capable: bool = True) -> str:
    """The dtype the matmuls of a Lightning precision run in: fp32 under `32-true` becomes tf32 when matmul precision
    is `high`/`medium` on a GPU with TF32 (compute capability 8.0+)."""
    text = str(precision)
    if text.startswith("64"):
        return "fp64"  # no tensor-core peak in the table: MFU is n/a
    if text.startswith("bf16"):
        return "bf16"
    if text.startswith("16") or text == "transformer-engine-float16":
        return "fp16"
    if text.startswith("transformer-engine") or text == "fp8":
        return "fp8"
    if float32_matmul_precision in ("high", "medium") and tf32_capable:
        return "tf32"
    return "fp32"


def lookup_peak_flops(device_name: str, dtype: str, override_tflops: float | None = None) -> PeakFlops:
    """The dense peak FLOP/s of `device_name` (as NVML or `torch.cuda.get_device_name` spell it) in `dtype`.

    Example::

        lookup_peak_flops("NVIDIA H200", "bf16").flops  # 9.894e14
    """
    if override_tflops is not None:
        return PeakFlops(flops=override_tflops * 1e12, dtype=dtype, source="--peak-tflops")
    if dtype not in DTYPES:
        raise ValueError(f"`dtype={dtype!r}` is not one of {DTYPES}.")
    name = device_name.lower()
    if not name or name == "cpu" or name.startswith("cpu"):
        return PeakFlops(None, dtype, "", "no peak FLOP/s for CPUs; give one with `--peak-tflops`")
    for pattern, label, peaks in PEAK_TFLOPS:
        if re.search(pattern, name):
            if dtype not in peaks:
                return PeakFlops(None, dtype, label, f"{label} has no {dtype} tensor-core path in the table")
            return PeakFlops(peaks[dtype] * 1e12, dtype, label)
    return PeakFlops(None, dtype, "", f"{device_name!r} is not in the peak table; give one with `--peak-tflops`")
