"""How many samples a batch holds, and how many ranks load batches of their own: the helpers every sample counter
uses (run summary, BenchMonitor, the tuner, AccumulationScheduler)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["data_parallel_replicas", "loader_batch_size", "samples_in"]


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


def data_parallel_replicas(trainer: Any) -> int:
    """Ranks that each load their own batches in a running fit: the distributed sampler's replicas (the
    data-parallel size under ModelParallelStrategy and PipelineStrategy, whose other ranks share batches), else the
    world size. Samples seen by one rank times this is the samples of the step."""
    try:
        replicas = trainer.strategy.distributed_sampler_kwargs.get("num_replicas")
    except Exception:  # a strategy without the property, or one not set up
        replicas = None
    return int(replicas) if isinstance(replicas, int) and replicas > 0 else int(trainer.world_size)


def loader_batch_size(loader: Any) -> int | None:
    """The samples per batch a DataLoader was built for: its `batch_size`, else its batch sampler's; None when
    neither says (a sampler that yields batches of varying size, an iterable that batches itself)."""
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None
