"""Pipeline stages without a tracer: split a model's block list by module names and place the stages on ranks.

Functions of sizes and modules, with no Trainer and no process group (only `shard_stages` takes a device mesh), used by
`PipelineStrategy` and testable on their own; the one warning goes through Lightning's `rank_zero_warn`. A model is
split the way torchtitan splits its models: every stage holds the whole module tree, with the blocks it does not run
replaced by `nn.Identity` and the top-level modules it does not run set to None, so parameter names stay those of the
plain model (a stage's state dict is a slice of the plain model's, and checkpoints consolidate by name). The model's
`forward` must skip the top-level modules that are None (see `lightning_accel.examples.GPTLanguageModel.forward`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_accel.errors import ConfigError
from lightning_accel.strategies.pipeline.spec import Placement

__all__ = [
    "PipelineStagePlan",
    "check_microbatches",
    "microbatches_for",
    "plan_pipeline_stages",
    "prune_to_stages",
    "shard_stages",
    "stage_count",
    "stage_ranks",
]


@dataclass(kw_only=True, slots=True)
class PipelineStagePlan:
    """Which blocks each pipeline stage runs."""

    block_list: str
    """Attribute name of the model's `nn.ModuleList` of blocks."""
    blocks: list[list[int]]
    """`blocks[s]`: indices into the block list that stage `s` runs, in order; together they cover the list."""

    @property
    def n_stages(self) -> int:
        return len(self.blocks)

    def split_points(self) -> list[str]:
        """The module names where stages 1.. begin (`blocks.2`), the form `split_points` takes."""
        return [f"{self.block_list}.{stage[0]}" for stage in self.blocks[1:]]


def stage_count(n_stages: int | None, split_points: Sequence[str] | None, default: int) -> int:
    """The number of stages: one more than the split points, else `n_stages`, else `default`.

    Raises:
        ConfigError: when both `n_stages` and `split_points` are set and disagree.
    """
    if split_points:
        if n_stages is not None and n_stages != len(split_points) + 1:
            raise ConfigError(
                f"`n_stages={n_stages}` disagrees with the {len(split_points)} split point(s) {list(split_points)} "
                f"({len(split_points) + 1} stages); leave `n_stages` unset or match them.",
                setting="n_stages",
            )
        return len(split_points) + 1
    return default if n_stages is None else n_stages


def plan_pipeline_stages(
    n_blocks: int, *, block_list: str, split_points: Sequence[str] | None = None, n_stages: int | None = None
) -> PipelineStagePlan:
    """Split `n_blocks` blocks into stages at `split_points` (module names such as `blocks.2`), or evenly.

    Args:
        n_blocks: length of the model's block list.
        block_list: its attribute name, e.g. "blocks".
        split_points: the first block of every stage after the first, in increasing order; None splits evenly.
        n_stages: number of stages for an even split (earlier stages get the extra blocks); ignored with
            `split_points`, which must then give `n_stages - 1` points when both are set.

    Raises:
        ConfigError: for a split point that is not a block of the list, points out of order, more stages than
            blocks, or `n_stages` that disagrees with the points.
    """
    if split_points:
        names = {f"{block_list}.{i}": i for i in range(n_blocks)}
        starts = []
        for point in split_points:
            if point not in names:
                raise ConfigError(
                    f"`split_points` names {point!r}, which is not a block of the model; split points are module "
                    f"names from `{block_list}.1` to `{block_list}.{n_blocks - 1}`.",
                    setting="split_points",
                )
            starts.append(names[point])
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise ConfigError(
                f"`split_points={list(split_points)}` must be distinct, in increasing order and after "
                f"`{block_list}.0` (each names the first block of a stage after the first).",
                setting="split_points",
            )
        stage_count(n_stages, split_points, default=len(starts) + 1)  # `n_stages`, when set, must agree
        bounds = [0, *starts, n_blocks]
        stages = [list(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]
        return PipelineStagePlan(block_list=block_list, blocks=stages)
    if n_stages is None or n_stages < 1:
        raise ConfigError(f"`n_stages={n_stages!r}` must be a positive integer.", setting="n_stages")
    if n_stages > n_blocks:
        raise ConfigError(
            f"`n_stages={n_stages}` is more stages than the model's {n_blocks} blocks (`{block_list}`); use at most "
            f"{n_blocks} stages, a schedule with fewer stages per rank, or a deeper model.",
            setting="n_stages",
        )
    size, extra = divmod(n_blocks, n_stages)
    blocks, start = [], 0
    for stage in range(n_stages):
        stop = start + size + (1 if stage < extra else 0)
        blocks.append(list(range(start, stop)))
        start = stop
    return PipelineStagePlan(block_list=block_list, blocks=blocks)


def stage_ranks(n_stages: int, pp_size: int, placement: Placement) -> list[int]:
    """`ranks[s]`: the pipeline rank that runs stage `s`.

    "loop" deals stages round robin (stage s on rank s mod pp); "v" runs stages 0..pp-1 down the ranks and
    pp..2pp-1 back up, so rank 0 holds the first and the last stage (ZBV, DualPipeV).

    Raises:
        ConfigError: when the stages do not share evenly over the ranks, or a V placement has not 2 per rank.
    """
    if n_stages % pp_size:
        raise ConfigError(
            f"{n_stages} pipeline stages cannot be shared evenly by {pp_size} pipeline ranks; set `n_stages` (or the "
            f"number of split points + 1) to a multiple of {pp_size}.",
            setting="n_stages",
        )
    if placement == "v":
        if n_stages != 2 * pp_size:
            raise ConfigError(
                f"V-shaped schedules run exactly 2 stages per rank: `n_stages` must be {2 * pp_size}, not {n_stages}.",
                setting="n_stages",
            )
        return [s if s < pp_size else 2 * pp_size - 1 - s for s in range(n_stages)]
    return [s % pp_size for s in range(n_stages)]


def check_microbatches(schedule: str, n_microbatches: int, n_stages: int, pp_size: int) -> None:
    """The installed torch's rules for a schedule's micro-batches.

    1F1B and DualPipeV need at least one micro-batch per stage; the interleaved schedules (interleaved_1f1b,
    interleaved_zero_bubble) run in rounds of `max(1, n // pipeline ranks)` and need `n` to be a multiple of them.

    Raises:
        ConfigError: naming `n_microbatches` and the fix.
    """
    if schedule in ("1f1b", "dualpipev") and n_microbatches < n_stages:
        raise ConfigError(
            f"`n_microbatches={n_microbatches}` is fewer than the {n_stages} pipeline stages, which "
            f"`schedule={schedule}` does not run; use `n_microbatches={n_stages}` or more (a multiple is best), or "
            "`schedule=gpipe`.",
            setting="n_microbatches",
        )
    rounds = max(1, n_microbatches // max(1, pp_size))
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble") and n_microbatches % rounds:
        raise ConfigError(
            f"`n_microbatches={n_microbatches}` is not a multiple of its {rounds} rounds of {pp_size} pipeline ranks, "
            f"which `schedule={schedule}` needs; use a multiple of {pp_size}.",
            setting="n_microbatches",
        )


def microbatches_for(n_microbatches: int | None, n_stages: int) -> int:
    """The micro-batches per batch (None: one per stage); warns (rank zero) when fewer than the stages.

    With fewer micro-batches than stages some stage has nothing to do at every moment of a step: the bubble is
    `(stages - 1) / (micro-batches + stages - 1)` of the step for GPipe and 1F1B, so 4 stages x 1 micro-batch idle 75%.
    """
    from lightning.pytorch.utilities import rank_zero_warn

    from lightning_accel.errors import LightningAccelWarning

    n_micro = n_stages if n_microbatches is None else n_microbatches
    if n_micro < n_stages:
        rank_zero_warn(
            f"`n_microbatches={n_micro}` is fewer than the {n_stages} pipeline stages: some stage idles through most "
            f"of every step; use at least {n_stages} micro-batches (a multiple is better).",
            category=LightningAccelWarning,
        )
    return n_micro


def _top_level_split(model: nn.Module, block_list: str) -> tuple[list[str], list[str]]:
    """Top-level child names registered before the block list (first stage) and after it (last stage)."""
    names = [name for name, _ in model.named_children()]
    if block_list not in names or not isinstance(getattr(model, block_list), nn.ModuleList):
        raise ConfigError(
            f"`block_list={block_list!r}` is not an `nn.ModuleList` child of {type(model).__name__} (its children: "
            f"{names}); name the list of blocks to split.",
            setting="block_list",
        )
    at = names.index(block_list)
    return names[:at], names[at + 1 :]


def prune_to_stages(model: nn.Module, plan: PipelineStagePlan, stages: Sequence[int]) -> list[nn.Module]:
    """Keep in `model` only what `stages` run, and return one module per stage that runs just that stage.

    `model` itself is pruned in place (its parameters are then those of `stages`, for the optimizer and the
    checkpoint); each returned stage module is a shallow copy sharing those parameters, with the modules of the
    other stages removed. Children registered before the block list belong to stage 0, after it to the last stage.
    """
    before, after = _top_level_split(model, plan.block_list)
    last = plan.n_stages - 1
    blocks: nn.ModuleList = getattr(model, plan.block_list)

    def keep(stage_set: set[int]) -> tuple[set[str], set[int]]:
        top = set(before) if 0 in stage_set else set()
        top |= set(after) if last in stage_set else set()
        return top, {b for s in stage_set for b in plan.blocks[s]}

    def apply(target: nn.Module, top: set[str], owned: set[int]) -> None:
        for name in (*before, *after):
            if name not in top:
                setattr(target, name, None)
        setattr(
            target,
            plan.block_list,
            nn.ModuleList([block if i in owned else nn.Identity() for i, block in enumerate(blocks)]),
        )

    views = []
    for stage in stages:
        view = copy.copy(model)
        for attr, value in model.__dict__.items():  # own registries and hook tables (FSDP2 hooks a stage's root)
            if attr.startswith("_") and isinstance(value, (dict, set)):
                object.__setattr__(view, attr, copy.copy(value))
        apply(view, *keep({stage}))
        views.append(view)
    apply(model, *keep(set(stages)))
    return views


def shard_stages(plan: PipelineStagePlan, stages: Sequence[int], views: Sequence[nn.Module], mesh: Any) -> None:
    """FSDP2 over the data-parallel `mesh`: each block, then each stage module as the root of what is left.

    `reshard_after_forward=False`: a stage's parameters stay gathered between the forward and the backward of its
    micro-batches, so each is all-gathered once per step rather than once per micro-batch.
    """
    from torch.distributed.fsdp import fully_shard

    for stage, view in zip(stages, views, strict=True):
        blocks = getattr(view, plan.block_list)
        for index in plan.blocks[stage]:
            fully_shard(blocks[index], mesh=mesh, reshard_after_forward=False)
        fully_shard(view, mesh=mesh, reshard_after_forward=False)
