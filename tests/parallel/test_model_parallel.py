"""ModelParallelStrategy + Parallelize on 2 CPU ranks (gloo): FSDP2 and tensor parallel match one process, sharded
checkpoints resume the same loss curve, and the micro-batch sync switch cuts reduce-scatters under accumulation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _model_parallel_cases as cases
import pytest
from _torchrun import rank_results

STEPS = cases.EPOCHS * cases.BATCHES_PER_EPOCH
N_PARAMS = 37  # tensors in GPT-tiny (2 blocks): every one a DTensor once parallelized
FSDP_UNITS = 3  # 2 blocks + the root


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], int]:
    return cases.reference_losses()


def _torchrun(out: Path, ranks: int, *args: str) -> list[dict[str, Any]]:
    return rank_results(cases.__file__, out, *args, ranks=ranks)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every case of _model_parallel_cases.py, in one torchrun launch of 2 CPU processes."""
    return _torchrun(tmp_path_factory.mktemp("model_parallel"), 2)


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_reference_learns_and_clips(reference: tuple[list[float], int]) -> None:
    losses, clipped = reference
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.5
    assert clipped > STEPS // 2  # gradient clipping acts, so it is checked across shards too


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dp2", "tp2"])
def test_two_ranks_match_one_process_after_20_steps(two_ranks: list[dict[str, Any]], reference: Any, case: str) -> None:
    rank0, rank1 = (r[case] for r in two_ranks)
    losses = rank0["losses"]
    print(
        f"{case}: step-20 loss {losses[-1]:.6f} vs single process {reference[0][-1]:.6f} "
        f"(max relative difference over 20 steps {_relative(losses, reference[0]):.2e})"
    )
    assert rank0["global_step"] == STEPS
    assert abs(losses[-1] - reference[0][-1]) / reference[0][-1] < 2e-3
    assert _relative(losses, reference[0]) < 2e-3
    assert rank1["losses"] == losses
    assert len(rank0["dtensor_params"]) == N_PARAMS
    assert rank0["fsdp_units"] == (FSDP_UNITS if case == "dp2" else 0)


@pytest.mark.slow
def test_activation_checkpointing_keeps_the_curve(two_ranks: list[dict[str, Any]]) -> None:
    assert _relative(two_ranks[0]["dp2_ac"]["losses"], two_ranks[0]["dp2"]["losses"]) < 1e-6


@pytest.mark.slow
def test_sharded_checkpoint_resumes_the_same_curve(two_ranks: list[dict[str, Any]]) -> None:
    for results in two_ranks:
        assert results["dp2_checkpoint_is_sharded"]  # a directory of per-rank shards
        full, resumed = results["dp2"], results["dp2_resumed"]
        assert resumed["global_step"] == STEPS and len(resumed["losses"]) == STEPS // 2
        print(
            f"resume from step 10: max relative difference over steps 11-20 "
            f"{_relative(resumed['losses'], full['losses'][STEPS // 2 :]):.2e}"
        )
        assert _relative(resumed["losses"], full["losses"][STEPS // 2 :]) < 1e-5


@pytest.mark.slow
def test_sync_switch_cuts_reduce_scatters_under_accumulation(two_ranks: list[dict[str, Any]]) -> None:
    for results in two_ranks:
        every, boundary = results["accumulate4_syncTrue"], results["accumulate4_syncFalse"]
        assert every["micro_batches"] == boundary["micro_batches"] == 4 * every["global_step"]
        print(
            f"reduce-scatters over {every['micro_batches']} micro-batches, {every['global_step']} steps: "
            f"{every['reduce_scatters']} syncing every micro-batch, {boundary['reduce_scatters']} at window ends"
        )
        assert every["reduce_scatters"] == FSDP_UNITS * every["micro_batches"]
        assert boundary["reduce_scatters"] == FSDP_UNITS * boundary["global_step"]
        assert _relative(boundary["losses"], every["losses"]) < 1e-5  # the same training, less communication


@pytest.mark.slow
def test_fsdp2_times_tensor_parallel_on_four_ranks(tmp_path: Path, reference: tuple[list[float], int]) -> None:
    """dp=2 x tp=2 with activation checkpointing: 4 CPU processes (~25 s on 2 cores), so `-m slow` only."""
    ranks = _torchrun(tmp_path, 4, "2d")
    for results in ranks:
        full, resumed = results["2d"], results["2d_resumed"]
        assert _relative(full["losses"], reference[0]) < 2e-3
        assert len(full["dtensor_params"]) == N_PARAMS and full["fsdp_units"] == FSDP_UNITS
        assert _relative(resumed["losses"], full["losses"][STEPS // 2 :]) < 1e-5
