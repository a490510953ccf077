"""RunStats: the samples of a whole run count each batch once per data-parallel replica."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_accel.batches import data_parallel_replicas
from lightning_accel.callbacks import RunStats


def _trainer(world_size: int, replicas: int | None) -> SimpleNamespace:
    kwargs = {} if replicas is None else {"num_replicas": replicas}
    return SimpleNamespace(world_size=world_size, strategy=SimpleNamespace(distributed_sampler_kwargs=kwargs))


@pytest.mark.parametrize(
    ("world_size", "replicas", "expected"),
    [(1, None, 8), (4, 4, 32), (4, 2, 16), (4, 1, 8)],  # single, DDP, pipeline x 2 replicas, one pipeline / TP
)
def test_samples_count_each_batch_once_per_replica(world_size: int, replicas: int | None, expected: int) -> None:
    trainer, stats = _trainer(world_size, replicas), RunStats()
    for _ in range(2):
        stats.on_train_batch_end(trainer, None, None, (torch.zeros(4, 3), torch.zeros(4)), 0)  # type: ignore[arg-type]
    assert stats.samples == expected


def test_a_strategy_without_a_sampler_counts_the_world() -> None:
    class NotSetUp:
        @property
        def distributed_sampler_kwargs(self) -> dict[str, int]:
            raise RuntimeError("not set up")

    assert data_parallel_replicas(SimpleNamespace(world_size=3, strategy=NotSetUp())) == 3
