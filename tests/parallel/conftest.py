"""A one-rank device mesh for the in-process tests of lightning_accel.parallel."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@pytest.fixture(scope="module")
def one_rank_mesh() -> Iterator[DeviceMesh]:
    """A (data_parallel=1, tensor_parallel=1) mesh over a 1-rank gloo group, as ModelParallelStrategy builds it."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    finally:
        dist.destroy_process_group()
