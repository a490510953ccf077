"""Lightning's ModelParallelStrategy with a data-parallel size that fills the world the tensor-parallel size leaves."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy as _LightningModelParallelStrategy
from typing_extensions import override

from lightning_accel import _lightning
from lightning_accel.errors import ConfigError

__all__ = ["ModelParallelStrategy"]


class ModelParallelStrategy(_LightningModelParallelStrategy):
    """Lightning's `ModelParallelStrategy` (FSDP2 x tensor parallel over a 2-D device mesh), sized for one flag.

    Lightning's `data_parallel_size="auto"` means the number of nodes, so with `tensor_parallel_size=1` on one node
    of N devices its mesh does not add up to the world size. Here `"auto"` means the world size divided by the
    tensor-parallel size, so `trainer.devices=N` alone gives N-way FSDP2, and `tensor_parallel_size=2` gives N/2-way
    FSDP2 x 2-way tensor parallelism. With both sizes `"auto"` it behaves like Lightning's (all devices of a node in
    tensor parallel, data parallel across nodes). Everything else is Lightning's: apply the parallelism in
    `configure_model` or with `lightning_accel.callbacks.parallelize.Parallelize`.

    Args:
        data_parallel_size: FSDP2 ranks; "auto": world size / `tensor_parallel_size`.
        tensor_parallel_size: tensor-parallel ranks (within a node, as they communicate every layer).
        save_distributed_checkpoint: each rank saves its shard (a checkpoint directory); False gathers a single file
            on rank 0.
        process_group_backend: None picks NCCL on CUDA and gloo on CPU.
        timeout: of collective operations.

    Raises:
        ConfigError: for a size that is not a positive integer or "auto", or a world size the tensor-parallel size
            does not divide.

    Example::

        trainer = Trainer(devices=4, strategy=ModelParallelStrategy(tensor_parallel_size=2),
                          callbacks=[Parallelize(block_classes=["Block"], tp_plan={...})])
    """

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        for name, value in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
            if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"`{name}={value!r}` must be a positive integer or 'auto'.", setting=name)
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's load, after `check_distributed_checkpoint` on a checkpoint directory (unless the caller trusts
        it with `weights_only=False`): torch would unpickle its index and its shards' non-tensor items unchecked."""
        from pathlib import Path

        from lightning_accel.strategies.dcp_checks import check_distributed_checkpoint

        path = Path(self.broadcast(checkpoint_path))
        if weights_only is not False and path.is_dir():
            check_distributed_checkpoint(path)
        return super().load_checkpoint(path, weights_only=weights_only)

    @override
    def setup_environment(self) -> None:
        _lightning.set_data_parallel_size(self, self._resolved_data_parallel_size())
        super().setup_environment()

    def _resolved_data_parallel_size(self) -> Any:
        data, tensor = _lightning.model_parallel_sizes(self)
        if data != "auto" or tensor == "auto":
            return data
        world = self.num_nodes * self.num_processes
        if world % tensor:
            raise ConfigError(
                f"`tensor_parallel_size={tensor}` does not divide the world size {world} "
                f"({self.num_nodes} node(s) x {self.num_processes} device(s)); use a divisor of {world}.",
                setting="tensor_parallel_size",
            )
        return world // tensor
