"""accel-bench results: model FLOPs utilisation per device under model parallelism."""

from __future__ import annotations

import pytest

from lightning_accel.benchmark.results import StageResult, _derive, model_flops_utilization


def test_mfu_is_divided_by_the_model_parallel_degree() -> None:
    assert model_flops_utilization(1e15, 10, 10.0, 1e15) == pytest.approx(1.0)
    assert model_flops_utilization(1e15, 10, 10.0, 1e15, model_parallel_size=4) == pytest.approx(0.25)
    measurement = {
        "world_size": 4,
        "data_parallel_size": 2,
        "device": "NVIDIA H100 80GB HBM3",
        "precision": "bf16-mixed",
        "flops_per_batch": 989.4e12,
        "steady_batches": 10,
        "steady_s": 20.0,
    }
    result = StageResult(name="model_parallel", measurement=measurement)  # type: ignore[call-arg]
    _derive(result, None)
    assert result.mfu == pytest.approx(0.25)  # 2 model-parallel ranks share each batch's FLOPs
    assert "model-parallel degree 2" in result.mfu_note


def test_a_mig_slice_is_measured_against_its_share_of_the_gpu() -> None:
    """stage.json's `sm_count` (torch's multi_processor_count of the slice) scales the GPU's peak."""
    base = {
        "world_size": 1,
        "device": "NVIDIA A100-SXM4-80GB MIG 3g.40gb",
        "precision": "bf16-mixed",
        "flops_per_batch": 1e12,
        "steady_batches": 10,
        "steady_s": 1.0,
    }
    by_sms = StageResult(name="amp", measurement={**base, "sm_count": 42})  # type: ignore[call-arg]
    by_name = StageResult(name="amp", measurement=base)  # type: ignore[call-arg]
    _derive(by_sms, None)
    _derive(by_name, None)
    assert by_sms.mfu == pytest.approx(1e13 / (312e12 * 42 / 108))
    assert "42 of 108 SMs" in by_sms.mfu_note and "3 of 7 slices" in by_name.mfu_note
