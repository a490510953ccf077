"""The one table of bottleneck moves: what to change for an input-, compute-, communication- or memory-bound run.

accel-bench's advice (`results.next_step`, the table's "next step" column) and accel-tune's search
(`autotune.search`) both read `MOVES`: the search tries the moves marked `searched`, in order, on top of its
incumbent; the advice names every move that addresses the stage's bottleneck and that the stage does not have yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = ["MOVES", "Bottleneck", "Move", "advised"]

Bottleneck = Literal["input-bound", "compute-bound", "communication-bound", "memory-bound", ""]


@dataclass(frozen=True)
class Move:
    """One change: the choices it sets, when it applies, which bottleneck it addresses, and how advice words it."""

    name: str
    sets: tuple[tuple[str, str], ...]
    addresses: tuple[str, ...]
    """Bottlenecks it is tried for, in the order of `MOVES` within each."""
    needs: tuple[str, ...] = ()
    """Conditions on the space: `multi` (2+ devices), `cuda`, `cpu` (a CPU run), `no_thread_plan` (the config sets
    `threads=torch`), `bf16`, `compile`, `blocks`, `model_parallel`
    (the candidate runs strategy=model_parallel); for advice also `ddp` (the run is DDP) and `workers` /
    `no_workers` (the stage has DataLoader workers or not). A condition a reader cannot tell holds for it."""
    excludes: tuple[str, ...] = ()
    """Keys the search must not have set already (no strategy move on top of another strategy); advice may name a
    switch."""
    advice: str = ""
    """What accel-bench's "next step" says for it (default: the choices it sets, with its name)."""
    searched: bool = True
    """Whether accel-tune tries it (False: advice only, e.g. hardware or settings the search leaves to the user)."""

    def words(self) -> str:
        """The move as accel-bench advises it."""
        return self.advice or f"{' '.join(f'{k}={v}' for k, v in self.sets)} ({self.name})"


MOVES: tuple[Move, ...] = (
    Move(
        "DataLoader workers by experiment",
        (("callbacks.dataloader_tuner._target_", "lightning_accel.callbacks.DataLoaderTuner"),),
        ("input-bound",),
        needs=("no_workers",),
        advice="preset=amp (DataLoader workers found by timing), or raise `data.num_workers`",
    ),
    Move(
        "more DataLoader workers, pinned memory",
        (("data.pin_memory", "true"),),
        ("input-bound",),
        needs=("workers",),
        advice="raise `data.num_workers` (now {workers}), `data.pin_memory=true`",
        searched=False,
    ),
    Move(
        "the thread plan",
        (("threads", "auto"),),
        ("compute-bound", "input-bound", ""),
        needs=("cpu", "no_thread_plan"),
        advice='threads=auto (the thread plan: README "Sharing a machine")',
    ),
    Move("micro-batches sized to memory", (("micro_batch", "auto"),), ("memory-bound",)),
    Move(
        "mixed precision",
        (("precision", "amp"),),
        ("compute-bound", "memory-bound", ""),
        advice="precision=amp (mixed precision)",
    ),
    Move("torch.compile", (("compile", "default"),), ("compute-bound", ""), needs=("compile",)),
    Move("torch.compile max-autotune", (("compile", "max-autotune"),), ("compute-bound",), needs=("compile",)),
    Move(
        "DDP over the devices",
        (("strategy", "ddp"), ("trainer.devices", "{devices}")),
        ("compute-bound", "input-bound", ""),
        needs=("multi",),
        excludes=("strategy",),
        advice="strategy=ddp over more devices",
    ),
    Move(
        "fewer gradient reductions (accumulation)",
        (("accumulation", "fixed"),),
        ("communication-bound",),
        advice="accumulation=fixed (4x fewer gradient reductions)",
    ),
    Move(
        "gradient compression (bf16)",
        (("ddp_grad_compression", "bf16"),),
        ("communication-bound",),
        needs=("cuda", "ddp"),
        advice="`ddp_grad_compression=bf16` on CUDA",
    ),
    Move(
        "model parallel (FSDP2 per block)",
        (("strategy", "model_parallel"), ("trainer.devices", "{devices}")),
        ("memory-bound", "compute-bound"),
        needs=("multi", "blocks"),
        excludes=("strategy",),
        advice="strategy=model_parallel (shards the model)",
    ),
    Move(
        "activation checkpointing",
        (("callbacks.parallelize.activation_checkpointing", "true"),),
        ("memory-bound",),
        needs=("model_parallel",),
        advice="`callbacks.parallelize.activation_checkpointing=true` (under strategy=model_parallel)",
    ),
    Move(
        "bf16 weights (bf16-true)",
        (("precision", "bf16_true"),),
        ("memory-bound",),
        needs=("bf16",),
        advice="precision=bf16_true (bf16 weights)",
    ),
    Move(
        "pipeline parallel",
        (("strategy", "pipeline"), ("trainer.devices", "{devices}")),
        ("communication-bound", "memory-bound"),
        needs=("multi", "blocks"),
        excludes=("strategy",),
        advice="strategy=pipeline (sends activations, not gradients)",
    ),
    Move(
        "a faster interconnect",
        (("nccl", "ib"),),
        ("communication-bound",),
        advice="a faster interconnect (`nccl=ib`) or fewer, larger processes",
        searched=False,
    ),
)
"""Every move, in the order tried (and advised) within a bottleneck: cheapest and safest first."""


def advised(bottleneck: str, have: Mapping[str, str]) -> list[str]:
    """accel-bench's advice for a stage with this bottleneck: the words of each move that addresses it, that sets
    something the stage does not have, and whose conditions the stage meets. `have` holds the stage's choices as the
    moves name them: `strategy` (absent for one process), `precision` (`amp` for any mixed or bf16 precision),
    `accumulation` (`fixed` when it accumulates), `data.num_workers` (absent for none). Conditions the stage cannot
    tell (a GPU for `cuda`, block classes, a compiler) are left to the words."""
    workers = have.get("data.num_workers", "")
    known = {
        "ddp": have.get("strategy") == "ddp",
        "model_parallel": have.get("strategy") == "model_parallel",
        "workers": bool(workers),
        "no_workers": not workers,
        "no_thread_plan": have.get("threads", "auto") != "auto",  # accel-train's default applies the plan
    }
    words = []
    for move in MOVES:
        if bottleneck not in move.addresses or not all(known.get(need, True) for need in move.needs):
            continue
        if all(have.get(key) == value for key, value in move.sets if "{" not in value):
            continue  # the stage has it already
        words.append(move.words().format_map(_Defaulted(workers=workers)))
    return words


class _Defaulted(dict):
    """`str.format_map` that leaves an unknown `{name}` as it is."""

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"
