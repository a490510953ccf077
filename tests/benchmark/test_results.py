"""accel-bench results: model FLOPs utilisation per device under model parallelism."""

from __future__ import annotations

import pytest

from lightning_accel.benchmark.results import StageResult, _derive, model_flops_utilization


def test_mfu_is_divided_by_the_model_parallel_degree() -> None:
    assert model_flops_utilization(1e15, 10, 10.0, 1e15) == pytest.approx(1.0)
    assert model_flops_utilization(1e15, 10, 10.0, 1e15, model_parallel_size=4) == pytest.approx(0.25)
    measurement = {"world_size": 4, "data_parallel_size": 2, "device": "NVIDIA H100 80GB HBM3",
                   "precision": "bf16-mixed", "flops_per_batch": 989.4e12, "steady_batches": 10, "steady_s": 20.0}
    result = StageResult(name="model_parallel", measurement=measurement)  # type: ignore[call-arg]
    _derive(result, None)
    assert result.mfu == pytest.approx(0.25)  # 2 model-parallel ranks share each batch's FLOPs
    assert "model-parallel degree 2" in result.mfu_note
