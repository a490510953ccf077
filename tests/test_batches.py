"""samples_in: the one batch-size helper (it replaced two identical copies and Lightning's extract_batch_size)."""

from __future__ import annotations

import torch

from lightning_accel.batches import samples_in


def test_samples_in_reads_the_first_tensor_in_order() -> None:
    x = torch.zeros(6, 3)
    assert samples_in(x) == 6
    assert samples_in((x, torch.zeros(2))) == 6
    assert samples_in({"ids": torch.zeros(4, 8), "mask": x}) == 4
    assert samples_in([[torch.zeros(5)]]) == 5
    assert samples_in(torch.tensor(3.0)) == 1


def test_a_batch_without_tensors_gets_the_default() -> None:
    assert samples_in({}) == 0 and samples_in([]) == 0 and samples_in("text") == 0
    assert samples_in(["a", "b"], default=1) == 1
