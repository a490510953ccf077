"""The `strategy=ddp` preset on 2 CPU ranks: the weights equal one process stepping on the concatenated batches."""

from __future__ import annotations

from typing import Any

import _ddp_case as case
import pytest
import torch
from _torchrun import rank_results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return rank_results(case.__file__, tmp_path_factory.mktemp("ddp"), timeout=300)


def _single_process(initial: dict[str, Any]) -> dict[str, torch.Tensor]:
    net = case.MLP().net
    net.load_state_dict({k: torch.tensor(v) for k, v in initial.items()})
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    x, y = case.data(2).tensors
    global_batch = 2 * case.PER_RANK_BATCH  # rank r holds rows r, r+2, ...: one step covers a contiguous block
    for step in range(case.STEPS):
        rows = slice(step * global_batch, (step + 1) * global_batch)
        optimizer.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(net(x[rows]), y[rows]).backward()
        optimizer.step()
    return net.state_dict()


@pytest.mark.parametrize("static_graph", ["False", "True"])
def test_ddp_preset_matches_one_process_on_the_concatenated_batch(two_ranks, static_graph: str) -> None:
    rank0, rank1 = (r[static_graph] for r in two_ranks)
    assert rank0["strategy"] == "DDPStrategy" and rank0["gradient_as_bucket_view"] is True
    assert rank0["steps"] == case.STEPS
    assert rank0["final"] == rank1["final"]
    expected = _single_process(rank0["initial"])
    for name, value in expected.items():
        torch.testing.assert_close(torch.tensor(rank0["final"][name]), value, atol=1e-5, rtol=0)
    assert any(torch.tensor(rank0["final"][k]).ne(torch.tensor(rank0["initial"][k])).any() for k in expected)
