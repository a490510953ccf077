"""The pipeline schedules by name: torch's class, the stages each rank runs and how stages are placed on ranks."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Literal

import torch

from lightning_accel.errors import ConfigError

__all__ = ["SCHEDULES", "Placement", "ScheduleSpec", "check_torch_pipelining", "schedule_spec"]

Placement = Literal["loop", "v"]

# name in config -> (class name in torch.distributed.pipelining.schedules, stages per rank, placement)
SCHEDULES: dict[str, tuple[str, int, Placement]] = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", 2, "loop"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleSpec:
    """One pipeline schedule of the installed torch, as `schedule_spec` finds it."""

    name: str
    """The name `PipelineStrategy(schedule=...)` takes, e.g. "1f1b"."""
    schedule_class: type
    """Its class in `torch.distributed.pipelining.schedules`."""
    stages_per_rank: int
    """1 for the single-stage schedules (gpipe, 1f1b), 2 for the interleaved and V-shaped ones."""
    placement: Placement
    """"loop": stage s on rank s mod pp; "v": stages 0..pp-1 down the ranks and back up (ZBV, DualPipeV)."""

    @property
    def single_stage(self) -> bool:
        """Each rank runs one stage, and torch's class takes that stage rather than a list."""
        return self.stages_per_rank == 1


def schedule_spec(name: str) -> ScheduleSpec:
    """The spec of the schedule called `name`.

    Raises:
        ConfigError: for an unknown name, or one this torch does not ship (naming the installed version).
    """
    if name not in SCHEDULES:
        raise ConfigError(
            f"`schedule={name!r}` is not a pipeline schedule; use one of {list(SCHEDULES)}.", setting="schedule"
        )
    class_name, per_rank, placement = SCHEDULES[name]
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, class_name, None)
    if cls is None:
        available = [n for n, (c, _, _) in SCHEDULES.items() if hasattr(schedules, c)]
        raise ConfigError(
            f"`schedule={name}` needs torch.distributed.pipelining.{class_name}, which torch {torch.__version__} does "
            f"not have; use one of {available}, or upgrade torch.",
            setting="schedule",
        )
    return ScheduleSpec(name=name, schedule_class=cls, stages_per_rank=per_rank, placement=placement)


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
            f"PipelineStrategy needs {' and '.join(missing)}, which torch {torch.__version__} lacks; upgrade torch "
            "(2.7 or newer has both), or use ModelParallelStrategy or DDPStrategy."
        )
