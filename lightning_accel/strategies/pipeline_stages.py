"""Pipeline stages without a tracer: split a model's block list by module names, place stages, pick a schedule.

Pure functions (no Trainer, no process group), used by `PipelineStrategy` and testable on their own. A model is
split the way torchtitan splits its models: every stage holds the whole module tree, with the blocks it does not run
replaced by `nn.Identity` and the top-level modules it does not run set to None, so parameter names stay those of the
plain model (a stage's state dict is a slice of the plain model's, and checkpoints consolidate by name). The model's
`forward` must skip the top-level modules that are None (see `lightning_accel.examples.GPTLanguageModel.forward`).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from lightning_accel.errors import ConfigError
from lightning_accel.strategies.checkpoint_io import atomic_torch_save

__all__ = [
    "SCHEDULES",
    "check_torch_pipelining",
    "StagePlan",
    "check_dcp_metadata",
    "consolidate_checkpoint",
    "load_metadata",
    "microbatches_for",
    "plan_stages",
    "prune_to_stages",
    "schedule_class",
    "stage_ranks",
]

# name in config -> (class name in torch.distributed.pipelining.schedules, stages per rank, placement)
SCHEDULES: dict[str, tuple[str, int, Literal["loop", "v"]]] = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", 2, "loop"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}


@dataclass(kw_only=True, slots=True)
class StagePlan:
    """Which blocks each pipeline stage runs."""

    block_list: str
    """Attribute name of the model's `nn.ModuleList` of blocks."""
    blocks: list[list[int]]
    """`blocks[s]`: indices into the block list that stage `s` runs, in order; together they cover the list."""

    @property
    def n_stages(self) -> int:
        return len(self.blocks)

    def split_points(self) -> list[str]:
        """The module names where stages 1.. begin (`blocks.2`), the form `split_points` takes in config."""
        return [f"{self.block_list}.{stage[0]}" for stage in self.blocks[1:]]


def schedule_class(name: str) -> tuple[type, int, Literal["loop", "v"]]:
    """The torch schedule class for a config name, its stages per rank and its placement ("loop" or "v").

    Raises:
        ConfigError: for an unknown name, or one this torch does not ship (naming the installed version).
    """
    if name not in SCHEDULES:
        raise ConfigError(
            f"`trainer.strategy.schedule={name!r}` is not a pipeline schedule; use one of {list(SCHEDULES)}."
        )
    class_name, per_rank, placement = SCHEDULES[name]
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, class_name, None)
    if cls is None:
        available = [n for n, (c, _, _) in SCHEDULES.items() if hasattr(schedules, c)]
        raise ConfigError(
            f"`trainer.strategy.schedule={name}` needs torch.distributed.pipelining.{class_name}, which torch "
            f"{torch.__version__} does not have; use one of {available}, or upgrade torch."
        )
    return cls, per_rank, placement


def check_torch_pipelining() -> None:
    """The installed torch's pipelining must infer stage shapes at run time and take `scale_grads`.

    Raises:
        ConfigError: naming the installed torch version and what it lacks.
    """
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    missing = []
    input_args = inspect.signature(PipelineStage.__init__).parameters.get("input_args")
    if input_args is not None and input_args.default is inspect.Parameter.empty:
        missing.append("stages that infer their shapes at run time (PipelineStage without input_args)")
    if "scale_grads" not in inspect.signature(PipelineScheduleSingle.__init__).parameters:
        missing.append("schedules that leave gradient scaling to the loss (scale_grads=False)")
    if missing:
        raise ConfigError(
            f"`strategy=pipeline` needs {' and '.join(missing)}, which torch {torch.__version__} lacks; upgrade "
            "torch (2.7 or newer has both), or use `strategy=model_parallel` or `strategy=ddp`."
        )


def plan_stages(
    n_blocks: int, *, block_list: str, split_points: Sequence[str] | None = None, n_stages: int | None = None
) -> StagePlan:
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
                    f"`trainer.strategy.split_points` names {point!r}, which is not a block of the model; split "
                    f"points are module names from `{block_list}.1` to `{block_list}.{n_blocks - 1}`."
                )
            starts.append(names[point])
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise ConfigError(
                f"`trainer.strategy.split_points={list(split_points)}` must be distinct, in increasing order and "
                f"after `{block_list}.0` (each names the first block of a stage after the first)."
            )
        if n_stages is not None and n_stages != len(starts) + 1:
            raise ConfigError(
                f"`trainer.strategy.n_stages={n_stages}` disagrees with the {len(starts)} split point(s) "
                f"{list(split_points)} ({len(starts) + 1} stages); set `n_stages=null` or match them."
            )
        bounds = [0, *starts, n_blocks]
        stages = [list(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]
        return StagePlan(block_list=block_list, blocks=stages)
    if n_stages is None or n_stages < 1:
        raise ConfigError(f"`trainer.strategy.n_stages={n_stages!r}` must be a positive integer.")
    if n_stages > n_blocks:
        raise ConfigError(
            f"`trainer.strategy.n_stages={n_stages}` is more stages than the model's {n_blocks} blocks "
            f"(`{block_list}`); use at most {n_blocks} stages, a schedule with fewer stages per rank, or a deeper "
            "model."
        )
    size, extra = divmod(n_blocks, n_stages)
    blocks, start = [], 0
    for stage in range(n_stages):
        stop = start + size + (1 if stage < extra else 0)
        blocks.append(list(range(start, stop)))
        start = stop
    return StagePlan(block_list=block_list, blocks=blocks)


def stage_ranks(n_stages: int, pp_size: int, placement: Literal["loop", "v"]) -> list[int]:
    """`ranks[s]`: the pipeline rank that runs stage `s`.

    "loop" deals stages round robin (stage s on rank s mod pp); "v" runs stages 0..pp-1 down the ranks and
    pp..2pp-1 back up, so rank 0 holds the first and the last stage (ZBV, DualPipeV).
    """
    if n_stages % pp_size:
        raise ConfigError(
            f"{n_stages} pipeline stages cannot be shared evenly by {pp_size} pipeline ranks; set "
            f"`trainer.strategy.n_stages` (or the number of split points + 1) to a multiple of {pp_size}."
        )
    if placement == "v":
        if n_stages != 2 * pp_size:
            raise ConfigError(
                f"V-shaped schedules run exactly 2 stages per rank: `n_stages` must be {2 * pp_size}, not {n_stages}."
            )
        return [s if s < pp_size else 2 * pp_size - 1 - s for s in range(n_stages)]
    return [s % pp_size for s in range(n_stages)]


def check_microbatches(schedule: str, n_microbatches: int, n_stages: int, pp_size: int) -> None:
    """The installed torch's rules for a schedule's micro-batches, as a ConfigError naming the setting.

    1F1B and DualPipeV need at least one micro-batch per stage; the interleaved schedules (interleaved_1f1b,
    interleaved_zero_bubble) run in rounds of `max(1, n // pipeline ranks)` and need `n` to be a multiple of them.
    """
    from lightning_accel.errors import ConfigError

    if schedule in ("1f1b", "dualpipev") and n_microbatches < n_stages:
        raise ConfigError(
            f"`trainer.strategy.n_microbatches={n_microbatches}` is fewer than the {n_stages} pipeline stages, which "
            f"`schedule={schedule}` does not run; use `n_microbatches={n_stages}` or more (a multiple is best), or "
            "`schedule=gpipe`."
        )
    rounds = max(1, n_microbatches // max(1, pp_size))
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble") and n_microbatches % rounds:
        raise ConfigError(
            f"`trainer.strategy.n_microbatches={n_microbatches}` is not a multiple of its {rounds} rounds of "
            f"{pp_size} pipeline ranks, which `schedule={schedule}` needs; use a multiple of {pp_size}."
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
            f"`trainer.strategy.n_microbatches={n_micro}` is fewer than the {n_stages} pipeline stages: some stage "
            f"idles through most of every step; use at least {n_stages} micro-batches (a multiple is better).",
            category=LightningAccelWarning,
        )
    return n_micro


def _top_level_split(model: nn.Module, block_list: str) -> tuple[list[str], list[str]]:
    """Top-level child names registered before the block list (first stage) and after it (last stage)."""
    names = [name for name, _ in model.named_children()]
    if block_list not in names or not isinstance(getattr(model, block_list), nn.ModuleList):
        raise ConfigError(
            f"`trainer.strategy.block_list={block_list!r}` is not an `nn.ModuleList` child of "
            f"{type(model).__name__} (its children: {names}); name the list of blocks to split."
        )
    at = names.index(block_list)
    return names[:at], names[at + 1 :]


def prune_to_stages(model: nn.Module, plan: StagePlan, stages: Sequence[int]) -> list[nn.Module]:
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
        setattr(target, plan.block_list, nn.ModuleList(
            [block if i in owned else nn.Identity() for i, block in enumerate(blocks)]
        ))  # fmt: skip

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


def load_metadata(path: str | Path, weights_only: bool | None = None, mmap: bool = False) -> dict[str, Any]:
    """A checkpoint's pickled metadata (`meta.pt`: loops, callbacks, hyper-parameters), loaded with
    `weights_only=True` unless the caller passes `weights_only=False` for a file it trusts: a file that needs more than
    tensors and plain types is refused before anything in it runs.

    Raises:
        ConfigError: naming the file and what it holds that is not allowed, with the way out.
    """
    import pickle

    try:
        # on the CPU: checked before launch, every rank would otherwise put the state on cuda:0
        return torch.load(path, map_location="cpu", weights_only=True if weights_only is None else weights_only,
                          mmap=mmap)  # fmt: skip
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()
        found = next((line.strip() for line in first if "GLOBAL" in line or "Unsupported" in line), first[0] if first
                     else "an object that is not a tensor or a plain type")  # fmt: skip
        raise ConfigError(
            f"the checkpoint file {str(path)!r} holds more than tensors and plain types ({found}), so it is not "
            "loaded: loading it could run code. If you made this checkpoint and trust it, resume with "
            "`trainer.fit(..., weights_only=False)` (or register the class with "
            "`torch.serialization.add_safe_globals`)."
        ) from None


_DCP_MODULES = ("torch.distributed.checkpoint.",)
_PATH_CLASSES = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path")


def _allowed_in_dcp_metadata(module: str, name: str) -> bool:
    """What a distributed checkpoint's `.metadata` pickle may name: torch's checkpoint metadata classes, dtypes,
    layouts, memory formats, `torch.Size` and paths; nothing that runs code."""
    if module.startswith(_DCP_MODULES):
        import importlib

        value = getattr(importlib.import_module(module), name, None)
        return isinstance(value, type)  # classes (dataclasses, enums), not functions
    if module == "torch":
        value = getattr(torch, name, None)
        return value is torch.Size or isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
    return (module, name) == ("torch.serialization", "_get_layout") or (
        module == "pathlib" and name in _PATH_CLASSES)  # fmt: skip


def check_dcp_metadata(path: str | Path) -> None:
    """Unpickle every `*.metadata` file of a distributed checkpoint directory with an allowlist
    (`_allowed_in_dcp_metadata`): torch reads them with plain `pickle.load`, which would run a planted payload.

    Raises:
        ConfigError: naming the file and the global it refused.
    """
    import pickle

    class Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if not _allowed_in_dcp_metadata(module, name):
                raise pickle.UnpicklingError(f"Unsupported global: {module}.{name}")
            return super().find_class(module, name)

    for file in sorted(Path(path).glob("*.metadata")) + sorted(Path(path).glob(".metadata")):
        try:
            with file.open("rb") as handle:
                Restricted(handle).load()
        except pickle.UnpicklingError as err:
            raise ConfigError(f"the distributed checkpoint index {str(file)!r} names `{err}`, which torch's "
                              "checkpoint metadata never holds, so the checkpoint is not loaded: loading it could "
                              "run code.") from None  # fmt: skip


def consolidate_checkpoint(path: str | Path, out: str | Path | None = None) -> dict[str, torch.Tensor]:
    """The plain model's state dict from a `PipelineStrategy` checkpoint directory (every stage's slice joined).

    Args:
        path: the checkpoint directory a `PipelineStrategy` run saved (e.g. `.../checkpoints/last.ckpt`).
        out: when given, also write `{"state_dict": ...}` there with `torch.save`, loadable by
            `LightningModule.load_from_checkpoint`'s weights or `model.load_state_dict(torch.load(out)["state_dict"])`.

    Returns:
        Parameter name -> full tensor, the names of the plain (unsplit) model.

    Raises:
        ConfigError: for a path that is no distributed checkpoint, or metadata that holds more than tensors and plain
            types (`load_metadata`).
    """
    from lightning.fabric.utilities.load import _METADATA_FILENAME, _load_distributed_checkpoint

    path = Path(path)
    if not (path / ".metadata").is_file():
        raise ConfigError(f"{str(path)!r} is not a distributed checkpoint directory (no .metadata); pass the "
                          "directory a PipelineStrategy run saved.")  # fmt: skip
    check_dcp_metadata(path)  # before torch unpickles the index, and the metadata before Lightning loads it
    meta = load_metadata(path / _METADATA_FILENAME) if (path / _METADATA_FILENAME).is_file() else {}
    state: dict[str, Any] = _load_distributed_checkpoint(path)
    model_state = {k: v for k, v in state["state_dict"].items() if isinstance(v, torch.Tensor)}
    if out is not None:
        extra = {k: meta[k] for k in ("hyper_parameters", "epoch", "global_step") if k in meta}
        atomic_torch_save({"state_dict": model_state, **extra}, out)
    return model_state
