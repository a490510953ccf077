"""Dense peak FLOP/s of the usual data-centre and workstation GPUs by compute dtype, for model FLOPs utilisation."""

from __future__ import annotations

import re
from dataclasses import dataclass

from lightning_accel.errors import ConfigError

__all__ = ["DTYPES", "PEAK_TFLOPS", "PeakFlops", "compute_dtype", "lookup_peak_flops"]

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8", "fp64")  # fp64 has no peak in the table: MFU n/a unless given
"""Compute dtypes of the table: fp32 on CUDA cores, tf32/bf16/fp16/fp8 on tensor cores (fp32 accumulation)."""

# Dense (no 2:4 sparsity) TFLOP/s per GPU from NVIDIA's datasheets and architecture whitepapers (A10G, which has no
# NVIDIA datasheet, has its own row with the A10's figures until `python -m lightning_accel.gpu_check` measures one).
# A missing dtype is one the GPU has no fast path for (V100/T4: no bf16 or tf32 tensor cores). Each pattern matches
# one product's NVML names in full (lower-cased, "nvidia "/"tesla " and a MIG suffix removed), so "RTX A1000" is not
# an A100 and "GB200" not a B200. The SM count of the whole GPU scales the peak of a MIG slice.
_H100 = {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}
_H_PCIE = {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0}
_H_NVL = {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5}
_A100 = {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}
PEAK_TFLOPS: tuple[tuple[str, str, dict[str, float], int | None], ...] = (
    (r"gh200( \d+gb)?", "GH200", _H100, 132),
    (r"h200 nvl", "H200 NVL", _H_NVL, 132),
    (r"h200( \d+gb hbm3e)?", "H200 SXM", _H100, 132),
    (r"h100 nvl", "H100 NVL", _H_NVL, 132),
    (r"h100 pcie", "H100 PCIe", _H_PCIE, 114),
    (r"h100( 80gb hbm3| sxm5 80gb)?", "H100 SXM", _H100, 132),
    (r"h800 pcie", "H800 PCIe", _H_PCIE, 114),
    (r"h800( 80gb hbm3)?", "H800 SXM", _H100, 132),
    (r"gb200", "GB200", {"fp32": 80.0, "tf32": 1250.0, "bf16": 2500.0, "fp16": 2500.0, "fp8": 5000.0}, None),
    (r"b200", "B200", {"fp32": 75.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0}, 148),
    (r"a100[- ](sxm4|pcie)[- ](40|80)gb|a100 (40|80)gb pcie|a100", "A100", _A100, 108),
    (r"a800[- ](sxm4|pcie)[- ](40|80)gb|a800 (40|80)gb pcie|a800", "A800", _A100, 108),
    (r"l40s", "L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.1, "fp16": 362.1, "fp8": 733.0}, None),
    (r"l40", "L40", {"fp32": 90.5, "tf32": 90.5, "bf16": 181.0, "fp16": 181.0, "fp8": 362.0}, None),
    (r"l4", "L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.0}, None),
    (r"a10", "A10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}, None),
    (r"a10g", "A10G", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}, None),  # A10's until measured
    (r"rtx a1000( 6gb laptop gpu)?", "RTX A1000", {"fp32": 6.7, "tf32": 13.5, "bf16": 26.9, "fp16": 26.9}, None),
    (r"rtx a4000", "RTX A4000", {"fp32": 19.2, "tf32": 38.4, "bf16": 76.7, "fp16": 76.7}, None),
    (r"rtx a6000", "RTX A6000", {"fp32": 38.7, "tf32": 77.4, "bf16": 154.8, "fp16": 154.8}, None),
    (r"v100s[- ]pcie[- ]32gb", "V100S", {"fp32": 16.4, "fp16": 130.0}, None),
    (r"v100[- ]pcie[- ](16|32)gb", "V100 PCIe", {"fp32": 14.0, "fp16": 112.0}, None),
    (r"v100[- ]sxm2[- ](16|32)gb|v100[- ]sxm3[- ]32gb|v100", "V100 SXM2", {"fp32": 15.7, "fp16": 125.0}, None),
    (r"t4", "T4", {"fp32": 8.1, "fp16": 65.0}, None),
    (
        r"(geforce )?rtx 4090",
        "RTX 4090",
        {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3},
        None,
    ),
    (r"(geforce )?rtx 3090", "RTX 3090", {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0}, None),
)
_MIG = re.compile(r"\s+mig\s+(\d+)g\.\S+$")
_VENDOR = re.compile(r"^(nvidia|tesla)\s+")
_MIG_SLICES = 7  # GPU-instance slices of an A100/H100/H200/B200


@dataclass(frozen=True, slots=True)
class PeakFlops:
    """The peak a device reaches in a dtype, or why there is none."""

    flops: float | None
    """FLOP/s per device; None when unknown (then `reason` says why)."""
    dtype: str
    source: str
    """The table row that matched, `--peak-tflops` for an override, or empty."""
    reason: str = ""


def compute_dtype(
    precision: str, float32_matmul_precision: str | None = None, tf32_capable: bool = True, *, fp8: bool = False
) -> str:
    """The dtype the matmuls of a Lightning precision run in: fp32 under `32-true` becomes tf32 when matmul precision
    is `high`/`medium` on a GPU with TF32 (compute capability 8.0+); `fp8=True` (torchao's `Float8Training` under
    `bf16-mixed`) runs them in fp8, as Transformer Engine's precision does."""
    text = str(precision)
    if fp8:
        return "fp8"
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


def lookup_peak_flops(
    device_name: str, dtype: str, override_tflops: float | None = None, *, sm_count: int | None = None
) -> PeakFlops:
    """The dense peak FLOP/s of `device_name` (as NVML or `torch.cuda.get_device_name` spell it) in `dtype`.

    Args:
        device_name: the device's name; a MIG slice's (`... MIG 1g.10gb`) gets its share of the whole GPU's peak.
        dtype: one of DTYPES.
        override_tflops: a per-device peak that replaces the table.
        sm_count: a MIG slice's SMs (`nvml.mig_sm_count`, `torch.cuda.get_device_properties(i).multi_processor_count`);
            without it the slice's share is its GPU-instance slices out of 7, read from the name.

    Example::

        lookup_peak_flops("NVIDIA H200", "bf16").flops  # 9.894e14
    """
    if override_tflops is not None:
        return PeakFlops(flops=override_tflops * 1e12, dtype=dtype, source="--peak-tflops")
    if dtype not in DTYPES:
        raise ConfigError(f"`dtype={dtype!r}` is not one of {DTYPES}.")
    name = " ".join(device_name.lower().split())
    if not name or name == "cpu" or name.startswith("cpu"):
        return PeakFlops(None, dtype, "", "no peak FLOP/s for CPUs; give one with `--peak-tflops`")
    mig = _MIG.search(name)
    product = _VENDOR.sub("", name[: mig.start()] if mig else name)
    for pattern, label, peaks, sms in PEAK_TFLOPS:
        if not re.fullmatch(pattern, product):
            continue
        if dtype not in peaks:
            return PeakFlops(None, dtype, label, f"{label} has no {dtype} tensor-core path in the table")
        flops = peaks[dtype] * 1e12
        if mig is None:
            return PeakFlops(flops, dtype, label)
        if sm_count and sms:
            return PeakFlops(flops * sm_count / sms, dtype, f"{label} MIG, {sm_count} of {sms} SMs")
        slices = int(mig.group(1))
        return PeakFlops(flops * slices / _MIG_SLICES, dtype, f"{label} MIG, {slices} of {_MIG_SLICES} slices")
    return PeakFlops(None, dtype, "", f"{device_name!r} is not in the peak table; give one with `--peak-tflops`")
