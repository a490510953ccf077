"""Learnable byte sequences for the GPT example's distributed tests (imported by torchrun case scripts too)."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def byte_sequences(n: int, block_size: int, seed: int) -> TensorDataset:
    """`n` (input, target) pairs of `block_size` tokens: each token follows from the previous one by a fixed rule,
    with 10% noise."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.empty(n, block_size + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, 64, (n,), generator=gen)
    for t in range(1, block_size + 1):
        noise = torch.rand(n, generator=gen) < 0.1
        tokens[:, t] = torch.where(noise, torch.randint(0, 64, (n,), generator=gen), (tokens[:, t - 1] * 5 + 3) % 64)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])
