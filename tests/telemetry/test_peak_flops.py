"""Peak FLOP/s: real NVML names match their own product's row, MIG slices scale by their share of SMs."""

from __future__ import annotations

import pytest

from lightning_accel.telemetry.peak_flops import lookup_peak_flops

# Names as NVML (nvidia-smi) and torch.cuda.get_device_name spell them.
NAMES = [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5),
    ("NVIDIA H200", "H200 SXM", 989.4),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5),
    ("NVIDIA GH200 480GB", "GH200", 989.4),
    ("NVIDIA H800", "H800 SXM", 989.4),
    ("NVIDIA H800 PCIe", "H800 PCIe", 756.0),
    ("NVIDIA A100-SXM4-40GB", "A100", 312.0),
    ("NVIDIA A100-SXM4-80GB", "A100", 312.0),
    ("NVIDIA A100-PCIE-40GB", "A100", 312.0),
    ("NVIDIA A100 80GB PCIe", "A100", 312.0),
    ("NVIDIA A10", "A10", 125.0),
    ("NVIDIA A10G", "A10G", 125.0),
    ("NVIDIA L4", "L4", 121.0),
    ("NVIDIA L40", "L40", 181.0),
    ("NVIDIA L40S", "L40S", 362.1),
    ("NVIDIA B200", "B200", 2250.0),
    ("NVIDIA GB200", "GB200", 2500.0),
    ("NVIDIA GeForce RTX 4090", "RTX 4090", 165.2),
    ("NVIDIA RTX A1000", "RTX A1000", 26.9),
    ("NVIDIA RTX A4000", "RTX A4000", 76.7),
    ("NVIDIA RTX A6000", "RTX A6000", 154.8),
]


@pytest.mark.parametrize(("name", "row", "bf16_tflops"), NAMES)
def test_real_nvml_names_match_their_own_row(name: str, row: str, bf16_tflops: float) -> None:
    peak = lookup_peak_flops(name, "bf16")
    assert (peak.source, peak.flops) == (row, pytest.approx(bf16_tflops * 1e12))


@pytest.mark.parametrize(
    ("name", "row"), [("Tesla V100-SXM2-16GB", "V100 SXM2"), ("Tesla V100-PCIE-32GB", "V100 PCIe"), ("Tesla T4", "T4")]
)
def test_gpus_without_bf16_name_the_row_and_say_why(name: str, row: str) -> None:
    assert lookup_peak_flops(name, "fp16").source == row
    peak = lookup_peak_flops(name, "bf16")
    assert peak.flops is None and peak.source == row and "no bf16" in peak.reason


@pytest.mark.parametrize("name", ["NVIDIA RTX A2000", "NVIDIA A16", "NVIDIA A40X", "NVIDIA B2000"])
def test_a_name_of_another_product_matches_no_row(name: str) -> None:
    peak = lookup_peak_flops(name, "bf16")
    assert peak.flops is None and "not in the peak table" in peak.reason and "--peak-tflops" in peak.reason


def test_a_mig_slice_scales_by_its_share_of_sms() -> None:
    whole = lookup_peak_flops("NVIDIA H100 80GB HBM3", "bf16").flops
    assert whole is not None
    exact = lookup_peak_flops("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "bf16", sm_count=16)
    assert exact.flops == pytest.approx(whole * 16 / 132) and "16 of 132 SMs" in exact.source
    by_name = lookup_peak_flops("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "bf16")
    assert by_name.flops == pytest.approx(312e12 * 3 / 7) and "3 of 7 slices" in by_name.source


def test_fp8_peak_for_both_fp8_paths() -> None:
    from lightning_accel.telemetry.peak_flops import compute_dtype

    assert compute_dtype("transformer-engine") == "fp8"
    assert compute_dtype("bf16-mixed", fp8=True) == "fp8"  # torchao's Float8Training runs the matmuls in fp8
