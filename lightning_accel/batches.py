"""How many samples a batch holds: the one helper every counter uses (run summary, BenchMonitor, the tuner,
AccumulationScheduler)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["samples_in"]


def samples_in(batch: Any, default: int = 0) -> int:
    """The leading size of the batch's first tensor (looking into tuples, lists and dicts, in order); a 0-d tensor is
    one sample; `default` when the batch holds no tensor (0 for sample counters, 1 where a batch counts as one).
    """
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    if isinstance(batch, dict):
        return samples_in(next(iter(batch.values())), default) if batch else default
    if isinstance(batch, (list, tuple)):
        return samples_in(batch[0], default) if batch else default
    return default
