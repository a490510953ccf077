"""`PipelineStrategy`'s settings, their defaults, and the one set of checks run both before launch and in `setup`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_accel.errors import ConfigError, ConfigTypeError, LightningAccelWarning
from lightning_accel.precision import PIPELINE_PRECISIONS  # one home for precision names
from lightning_accel.strategies.pipeline.spec import ScheduleSpec, schedule_spec
from lightning_accel.strategies.pipeline.stages import check_microbatches, stage_count, stage_ranks

__all__ = ["DEFAULTS", "PipelineSettings", "check_pipeline_settings", "check_precision"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineSettings:
    """What `PipelineStrategy(...)` is constructed with; each field is the constructor argument of the same name."""

    schedule: str = "1f1b"
    """gpipe, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zero_bubble, zbv_zero_bubble or dualpipev (the last
    four where the installed torch has them)."""
    n_microbatches: int | None = None
    """Micro-batches per batch; the batch size must divide by it. None: the number of stages."""
    split_points: tuple[str, ...] | None = None
    """Module names where stages 2.. begin (e.g. `("blocks.2",)`); None splits the block list evenly."""
    n_stages: int | None = None
    """Number of stages for an even split; None: pipeline ranks x the schedule's stages per rank."""
    data_parallel_size: int = 1
    """Pipeline replicas; the pipeline size is the world size divided by it."""
    data_parallel: Literal["replicate", "fsdp"] = "replicate"
    """"replicate" (all-reduce gradients) or "fsdp" (FSDP2 per stage)."""
    block_list: str | None = None
    """Attribute name of the model's block list; None reads the module's `pipeline_blocks`."""
    process_group_backend: str | None = None
    """None picks NCCL on CUDA and gloo on CPU."""
    timeout: timedelta | None = default_pg_timeout
    """Of collective operations."""

    def __post_init__(self) -> None:
        points = self.split_points
        if isinstance(points, Sequence) and not isinstance(points, str):  # a list from a config, or empty
            object.__setattr__(self, "split_points", tuple(points) or None)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> PipelineSettings:
        """The settings from a plain dict of constructor arguments (a config's `trainer.strategy`, resolved); keys
        that start with `_` (`_target_`) are Hydra's and ignored.

        Raises:
            ConfigTypeError: for a key that is no argument of `PipelineStrategy`.
        """
        names = [field.name for field in dataclasses.fields(cls)]
        arguments = {key: value for key, value in values.items() if not str(key).startswith("_")}
        for key in arguments:
            if key not in names:
                raise ConfigTypeError(
                    f"`{key}` is not an argument of PipelineStrategy; it takes {names}.", setting=str(key)
                )
        return cls(**arguments)

    @property
    def spec(self) -> ScheduleSpec:
        """The schedule's spec (class, stages per rank, placement); raises as `validate` does for a bad name."""
        return schedule_spec(self.schedule)

    def pipeline_size(self, world: int) -> int:
        """Pipeline ranks among `world` processes."""
        return world // self.data_parallel_size

    def stages_for(self, pp_size: int) -> int:
        """The number of stages on `pp_size` pipeline ranks: from the split points, `n_stages`, or the schedule's."""
        return stage_count(self.n_stages, self.split_points, default=pp_size * self.spec.stages_per_rank)

    def validate(self, *, world: int | None = None, precision: str | None = None) -> None:
        """Every check the settings allow without the model: alone, and against the world size and the Trainer's
        precision when they are given. `PipelineStrategy` runs it when constructed and again when the Trainer sets it
        up; `check_pipeline_settings` before anything is launched.

        Raises:
            ConfigError: naming the argument (`setting`), the value and the fix; a `ConfigTypeError` for a value of
                the wrong type.
        """
        if not isinstance(self.schedule, str):
            raise ConfigTypeError(f"`schedule={self.schedule!r}` must be a schedule's name.", setting="schedule")
        spec = schedule_spec(self.schedule)  # an unknown name or one this torch lacks fails here
        for name in ("n_microbatches", "n_stages", "data_parallel_size"):
            _check_positive(name, getattr(self, name))
        if self.data_parallel not in ("replicate", "fsdp"):
            raise ConfigError(
                f"`data_parallel={self.data_parallel!r}` must be 'replicate' or 'fsdp'.", setting="data_parallel"
            )
        points = self.split_points
        if points is not None and (isinstance(points, str) or any(not isinstance(p, str) for p in points)):
            raise ConfigTypeError(
                f"`split_points={points!r}` must be a list of module names such as 'blocks.2'.", setting="split_points"
            )
        stage_count(self.n_stages, points, default=1)
        if precision is not None:
            check_precision(precision)
        if world is not None:
            self._validate_world(world, spec)

    def _validate_world(self, world: int, spec: ScheduleSpec) -> None:
        dp = self.data_parallel_size
        if world % dp:
            raise ConfigError(
                f"`data_parallel_size={dp}` does not divide the world size {world} (devices x nodes); use a divisor "
                f"of {world}.",
                setting="data_parallel_size",
            )
        pp = self.pipeline_size(world)
        n_stages = self.stages_for(pp)
        stage_ranks(n_stages, pp, spec.placement)  # the stages share evenly over the ranks
        if spec.single_stage and n_stages != pp:
            raise ConfigError(
                f"`schedule={spec.name}` runs one stage per pipeline rank, but there are {n_stages} stages for {pp} "
                f"ranks; use `n_stages={pp}` or an interleaved schedule (interleaved_1f1b).",
                setting="schedule",
            )
        if not spec.single_stage and n_stages < 2 * pp:
            raise ConfigError(
                f"`schedule={spec.name}` needs at least 2 stages per pipeline rank ({2 * pp}), got {n_stages}; raise "
                "`n_stages` or use gpipe/1f1b.",
                setting="schedule",
            )
        if self.n_microbatches is not None:
            check_microbatches(spec.name, self.n_microbatches, n_stages, pp)


DEFAULTS = PipelineSettings()
"""The constructor's defaults, in one place: `PipelineStrategy`'s signature reads them from here."""


def _check_positive(name: str, value: Any) -> None:
    if value is None and name != "data_parallel_size":  # None: derived from the stages
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(f"`{name}={value!r}` must be a positive integer.", setting=name)
    if value < 1:
        raise ConfigError(f"`{name}={value!r}` must be a positive integer.", setting=name)


def check_precision(precision: str) -> None:
    """The Trainer's precision must be one the pipeline runs (`PIPELINE_PRECISIONS`).

    Raises:
        ConfigError: with `setting="precision"`, the Trainer's argument (under `trainer.` in a config).
    """
    if precision not in PIPELINE_PRECISIONS:
        raise ConfigError(
            f"`precision={precision}` is not supported by `PipelineStrategy` (it takes "
            f"{', '.join(PIPELINE_PRECISIONS[:4])}); use `precision=bf16-mixed` or `precision=32-true`.",
            setting="precision",
        )


def check_pipeline_settings(
    values: Mapping[str, Any] | None = None,
    /,
    *,
    precision: str | None = None,
    world: int | None = None,
    **arguments: Any,
) -> PipelineSettings:
    """The checks of `PipelineStrategy`'s arguments that need no model, before anything is launched.

    Args:
        values: the constructor's arguments as a plain dict (a config's `trainer.strategy`, resolved: keys starting
            with `_` are ignored); `arguments` add to them.
        precision: the Trainer's precision, if known.
        world: the number of processes (devices x nodes), if known; warns (rank zero) when it leaves a single
            pipeline rank.

    Returns:
        The settings, validated.

    Raises:
        ConfigError: naming the constructor argument (`setting`); the composition layer moves it under the config
            path with `err.at("trainer.strategy")` (`err.at("trainer")` for `precision`).
    """
    settings = PipelineSettings.from_dict({**(values or {}), **arguments})
    settings.validate(world=world, precision=precision)
    if world is not None and settings.pipeline_size(world) < 2:
        from lightning.pytorch.utilities import rank_zero_warn

        dp = settings.data_parallel_size
        rank_zero_warn(
            f"PipelineStrategy on {world} process(es) with `data_parallel_size={dp}` has a single pipeline rank: "
            "every stage runs on one process; set the Trainer's `devices` to a multiple of 2 x data_parallel_size.",
            category=LightningAccelWarning,
        )
    return settings
