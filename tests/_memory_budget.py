"""A memory budget for CPU tests: out-of-memory errors where a GPU would run out, raised as torch's own
`OutOfMemoryError` so the code under test takes the path a real CUDA OOM takes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class MemoryBudget:
    """Raises `torch.OutOfMemoryError` when a forward's "activation bytes" exceed `limit_bytes`.

    The cost of a batch is `samples x length x bytes_per_token`: with variable-length sequences, a long batch runs
    out where short ones fit (the data-dependent case). `calls` counts the checks, `ooms` the errors raised.
    """

    def __init__(self, limit_bytes: int, bytes_per_token: int = 1) -> None:
        self.limit_bytes, self.bytes_per_token = limit_bytes, bytes_per_token
        self.calls = self.ooms = 0

    def cost(self, x: torch.Tensor) -> int:
        length = x.shape[1] if x.dim() > 1 else 1
        return int(x.shape[0]) * int(length) * self.bytes_per_token

    def check(self, x: torch.Tensor) -> int:
        self.calls += 1
        needed = self.cost(x)
        if needed > self.limit_bytes:
            self.ooms += 1
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (test budget): tried to allocate {needed} B with {self.limit_bytes} B free"
            )
        return needed


class BudgetedMLP(nn.Module):
    """A 2-layer MLP whose forward first asks the budget for room."""

    def __init__(self, budget: MemoryBudget, features: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.budget = budget
        self.net = nn.Sequential(nn.Linear(features, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> Any:
        self.budget.check(x)
        return self.net(x)
