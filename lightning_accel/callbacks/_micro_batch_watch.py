"""What MicroBatchFinder watches on the module while it splits batches: batch-sized state the module keeps on itself
(refused), layers with batch statistics and state `training_step` changes from call to call (warned of)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_accel.errors import ConfigError, LightningAccelWarning
from lightning_accel.tuning import module_state
from lightning_accel.tuning.micro_batch_search import batch_sized_state, batch_statistics_layers, held_tensors

__all__ = ["ModuleWatch", "state_error", "state_names"]


class ModuleWatch:
    """What a fit's first pieces show about the module: batch-sized state it keeps on itself, checked after its first
    `training_step` and after the first piece of a split batch; and the layers with batch statistics, named at the
    first split batch."""

    def __init__(self) -> None:
        self.state: dict[str, tuple[int, ...]] = {}
        """Batch-sized tensors the first whole batch left on the module (name -> shape)."""
        self.whole_checked = self.split_checked = False
        self._carried: dict[str, Any] | None = None  # the fingerprint after the first split piece
        self._carried_checked = False

    def before_step(
        self, micro_batch_size: int | str, module: torch.nn.Module, k: int, n: int
    ) -> dict[str, torch.Tensor] | None:
        """Before a piece of k of a batch of n: refuse a split the module's state cannot take, warn of batch
        statistics; the module's tensors when this piece is to be checked."""
        if k >= n:
            return None if self.whole_checked else held_tensors(module)
        if self.state:
            raise state_error(micro_batch_size, self.state, k, n)
        if self.split_checked:
            return None
        layers = batch_statistics_layers(module)
        if layers:
            rank_zero_warn(
                f"MicroBatchFinder: each batch of {n} runs as micro-batches of {k}, and these layers take statistics "
                f"over the batch in train mode: {', '.join(f'`{name}` ({kind})' for name, kind in layers.items())}. "
                "Each piece is normalised by its own statistics (and running statistics are updated once per "
                "piece), so the update is not the whole batch's: it is what gradient accumulation over these pieces "
                "gives. For the whole batch's update use GroupNorm or LayerNorm, or a `micro_batch_size` >= the "
                "batch; or accept per-piece statistics, as gradient accumulation does.",
                category=LightningAccelWarning,
            )
        return held_tensors(module)

    def after_step(
        self, micro_batch_size: int | str, module: torch.nn.Module, before: dict[str, torch.Tensor], k: int, n: int
    ) -> None:
        found = batch_sized_state(before, held_tensors(module), k)
        if k >= n:
            self.whole_checked, self.state = True, found
            return
        self.split_checked = True
        if found:
            raise state_error(micro_batch_size, found, k, n)

    def after_piece(self, module: torch.nn.Module, k: int, n: int) -> None:
        """After the first two pieces of the first split batch: warn of any other state `training_step` changes from
        call to call (a counter, an RL agent's environment and replay buffer), which now changes once per piece. Two
        pieces, not one: a cache built at the fit's first call (a mask, a positional table) changes only once."""
        if k >= n or self._carried_checked:
            return
        now = module_state.fingerprint(module)
        if self._carried is None:
            self._carried = now
            return
        self._carried_checked = True
        carried = [name for name in module_state.changed(self._carried, now) if name not in self.state]
        self._carried = None  # compared once: the fingerprint holds nothing past it
        if carried:
            rank_zero_warn(
                f"MicroBatchFinder: each batch of {n} runs as micro-batches of {k}, so `training_step` runs once per "
                f"piece, and it changes the module's own state from call to call: "
                f"{', '.join(f'`{name}`' for name in carried)}. Whatever it does there besides its loss (an "
                "environment step, a replay-buffer append, a counter) now happens once per piece, not once per batch. "
                f"Use `micro_batch_size` >= {n} to keep one call per batch, or move that work out of `training_step` "
                "(`on_train_batch_start`).",
                category=LightningAccelWarning,
            )


def state_error(micro_batch_size: int | str, state: dict[str, tuple[int, ...]], k: int, n: int) -> ConfigError:
    why = (
        f"`micro_batch_size={micro_batch_size}`"
        if micro_batch_size != "auto"
        else "the whole batch ran out of memory or over `memory_fraction`"
    )
    return ConfigError(
        f"MicroBatchFinder would run each batch of {n} as micro-batches of {k} ({why}), but `training_step` keeps "
        f"state sized by its batch on the module: {state_names(state)}. The next piece would take one piece's state as "
        f"its own (or fail on the size). Use `micro_batch_size` >= {n} (the batch runs whole, the module as it is), "
        "or keep per-sample state off the module (return it from `training_step`, or carry it in the batch).",
        setting="micro_batch_size",
    )


def state_names(state: dict[str, tuple[int, ...]]) -> str:
    return ", ".join(f"`{name}` (shape {tuple(shape)})" for name, shape in state.items())
