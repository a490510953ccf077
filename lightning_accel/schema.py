"""The types of this package's config groups: Hydra Structured Configs, registered in Hydra's ConfigStore.

Each option of a group (`conf/threads/auto.yaml`, `conf/micro_batch/auto.yaml`, ...) names its schema first in its
defaults list (`- /accel_schema/threads`, or `- /accel_schema/micro_batch_finder@callbacks.micro_batch` where the
option writes a callback), so OmegaConf checks every value the YAML or the command line gives it while Hydra composes
the config, and refuses a wrong type naming the key (`threads.pin=maybe`: not a bool). What a type cannot say (finite,
positive, divides, within a range) is `checks.check_config`'s, the one validation step before launch; a callback's
own constructor checks its arguments again, for Python scripts that use it without Hydra.

`register_schemas()` stores the dataclasses under the group `accel_schema`. It runs when Hydra opens this package's
config tree (`lightning_accel/conf/__init__.py`) and when Hydra loads the search-path plugin, so accel-train and any
Hydra app that selects these groups get the types. Importing this module has no side effects and loads no torch.

`composition_error(err)` turns what Hydra raises for a config that does not compose (a wrong type, an override it
cannot parse, an unknown option) into one `ConfigError` line naming the setting, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from lightning_accel.errors import ConfigError, ConfigTypeError

__all__ = [
    "SCHEMA_GROUP",
    "SCHEMAS",
    "AccumulationSchedulerConfig",
    "CompileConfig",
    "CosineScheduleConfig",
    "DataLoaderTunerConfig",
    "GPUMonitorConfig",
    "LRScalingConfig",
    "LinearWarmupScheduleConfig",
    "MatmulPrecisionConfig",
    "MicroBatchFinderConfig",
    "NcclConfig",
    "NonFiniteGuardConfig",
    "OneCycleScheduleConfig",
    "ParallelizeConfig",
    "PlateauScheduleConfig",
    "PreflightConfig",
    "StopOnSignalConfig",
    "ThreadsConfig",
    "composition_error",
    "describe_type",
    "register_schemas",
]

SCHEMA_GROUP = "accel_schema"
"""The ConfigStore group the schemas live in: `- /accel_schema/NAME` in an option's defaults list."""


# --- groups of their own: `threads`, `nccl` ---------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class ThreadsConfig:
    """The `threads` group: the thread plan of each rank (README "Sharing a machine")."""

    mode: str = "auto"
    """auto: the plan from the CPU budget; torch: torch's own pools (no plan)."""
    intra_op: int | None = None
    """torch's intra-op threads per rank (>= 1); null: the plan's."""
    wait_policy: str | None = None
    """OMP_WAIT_POLICY: PASSIVE or ACTIVE; null: PASSIVE."""
    worker_cpu: float = 1.0
    """CPUs one DataLoader worker is counted for, within [0, the CPUs this process may use]."""
    pin: bool = False
    """Each rank and its workers on their own CPUs."""


@dataclass(kw_only=True, slots=True)
class NcclConfig:
    """The `nccl` group: the NCCL variables of a CUDA run (`lightning_accel.strategies.nccl`)."""

    preset: str = "auto"
    """none, auto, ib, socket, nvls_off or debug."""
    socket_ifname: str | None = None
    """NCCL_SOCKET_IFNAME (e.g. eth0, or ^lo,docker); null: the default route's interface."""


# --- callbacks that group options add (their constructors' arguments; each class documents its own) -------------


@dataclass(kw_only=True, slots=True)
class MicroBatchFinderConfig:
    """`callbacks.micro_batch` (`micro_batch=auto`): `lightning_accel.callbacks.MicroBatchFinder`'s arguments."""

    _target_: str = "lightning_accel.callbacks.MicroBatchFinder"
    micro_batch_size: int | str = "auto"
    memory_fraction: float = 0.9
    grow_after: int | None = 100


@dataclass(kw_only=True, slots=True)
class CompileConfig:
    """`callbacks.compile` (`compile=default`, ...): `lightning_accel.callbacks.Compile`'s arguments."""

    _target_: str = "lightning_accel.callbacks.Compile"
    mode: str | None = "default"
    fullgraph: bool = False
    dynamic: bool | None = None
    backend: str = "inductor"


@dataclass(kw_only=True, slots=True)
class LRScalingConfig:
    """`callbacks.lr_scaling` (`lr_scaling=linear`, `sqrt`): `lightning_accel.callbacks.LRScaling`'s arguments."""

    _target_: str = "lightning_accel.callbacks.LRScaling"
    rule: str = "linear"
    reference_global_batch: int = 32


@dataclass(kw_only=True, slots=True)
class AccumulationSchedulerConfig:
    """`callbacks.accumulation` (`accumulation=schedule`, `global_batch`): `AccumulationScheduler`'s arguments."""

    _target_: str = "lightning_accel.callbacks.AccumulationScheduler"
    scheduling: list[list[int]] | None = None
    unit: str = "epoch"
    global_batch_size: int | None = None
    micro_batch_size: int | None = None


@dataclass(kw_only=True, slots=True)
class MatmulPrecisionConfig:
    """`callbacks.matmul_precision` (every `precision` option): `MatmulPrecision`'s arguments."""

    _target_: str = "lightning_accel.callbacks.MatmulPrecision"
    float32_matmul_precision: str | None = "highest"
    requested: str | None = None


@dataclass(kw_only=True, slots=True)
class GPUMonitorConfig:
    """`callbacks.gpu_monitor` (`callbacks/monitor.yaml`, `callbacks/gpu_monitor.yaml`): `GPUMonitor`'s arguments."""

    _target_: str = "lightning_accel.callbacks.GPUMonitor"
    interval_s: float = 0.5
    device_indices: list[int] | None = None
    readings: list[str] | None = None
    log_min_max: bool = True
    low_utilization_pct: float | None = 50.0
    min_memory_headroom_pct: float | None = 5.0
    max_throttle_pct: float | None = 25.0
    max_rank_skew_pct: float | None = 20.0
    hung_after_steps: float | None = 10.0
    warmup_steps: int = 50
    report_dir: str | None = None
    report_name: str = "gpu_report"
    plot: bool = True
    print_report: bool = True
    log_metrics: bool = True
    publish: bool = True
    runs_dir: str | None = None
    publish_interval_s: float = 2.0
    run_name: str | None = None
    prometheus_port: int | None = None
    prometheus_addr: str = "127.0.0.1"
    prometheus_textfile_dir: str | None = None
    prometheus_file_sd_dir: str | None = None


@dataclass(kw_only=True, slots=True)
class DataLoaderTunerConfig:
    """`callbacks.dataloader_tuner` (`preset=amp`, `ddp`; `callbacks/dataloader_tuner.yaml`): its arguments."""

    _target_: str = "lightning_accel.callbacks.dataloader_tuner.DataLoaderTuner"
    max_tuning_time_s: float = 60.0
    steps_per_trial: int = 16
    warmup_steps: int = 2
    tolerance: float = 0.05
    max_workers: int | None = None
    prefetch_factors: list[int] = field(default_factory=lambda: [2, 4])
    tune_pin_memory: bool = True
    apply_to_val: bool = True
    force: bool = False
    cache_dir: str | None = None
    use_cache: bool = True
    print_table: bool = True
    verify_steps: int = 20


@dataclass(kw_only=True, slots=True)
class NonFiniteGuardConfig:
    """`callbacks.nonfinite` (`callbacks/nonfinite.yaml`): `NonFiniteGuard`'s arguments."""

    _target_: str = "lightning_accel.callbacks.NonFiniteGuard"
    action: str = "warn"
    dirpath: str | None = None
    filename: str = "nonfinite-step{step}"


@dataclass(kw_only=True, slots=True)
class StopOnSignalConfig:
    """`callbacks.stop_on_signal` (`callbacks/stop_on_signal.yaml`): `StopOnSignal`'s arguments."""

    _target_: str = "lightning_accel.callbacks.StopOnSignal"
    signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT"])
    """Names or numbers (`[SIGTERM, 10]` reads as strings; OmegaConf 2.3 hands a list of unions on as its nodes)."""
    grace_s: float = 20.0
    save_checkpoint: bool = True
    requeue_on_slurm: bool = True


@dataclass(kw_only=True, slots=True)
class PreflightConfig:
    """`callbacks.preflight` (`callbacks/preflight.yaml`): `Preflight`'s arguments."""

    _target_: str = "lightning_accel.callbacks.Preflight"
    fail_on: str = "FAIL"
    checks: list[str] | None = None
    num_workers: int | None = None
    interference_s: float = 0.5


@dataclass(kw_only=True, slots=True)
class ParallelizeConfig:
    """`callbacks.parallelize` (`strategy=model_parallel`): `Parallelize`'s arguments."""

    _target_: str = "lightning_accel.callbacks.parallelize.Parallelize"
    block_classes: list[str] | None = None
    tp_plan: dict[str, str] | None = None
    activation_checkpointing: bool = False
    compile: bool = False
    compile_mode: str | None = None
    reshard_after_forward: bool = True
    sync_grads_every_micro_batch: bool = False
    param_dtype: str | None = None
    reduce_dtype: str | None = None


# --- the `scheduler` group: partials of a schedule (model.lr_scheduler / model.scheduler read it) -----------------


@dataclass(kw_only=True, slots=True)
class CosineScheduleConfig:
    """`scheduler=cosine`, `cosine_warmup`: `lightning_accel.schedules.cosine_schedule`'s arguments."""

    _target_: str = "lightning_accel.schedules.cosine_schedule"
    _partial_: bool = True
    warmup_steps: int | float = 0
    min_lr_ratio: float = 0.0


@dataclass(kw_only=True, slots=True)
class LinearWarmupScheduleConfig:
    """`scheduler=linear_warmup`: `lightning_accel.schedules.linear_warmup_schedule`'s arguments."""

    _target_: str = "lightning_accel.schedules.linear_warmup_schedule"
    _partial_: bool = True
    warmup_steps: int | float = 0.05
    min_lr_ratio: float = 0.0


@dataclass(kw_only=True, slots=True)
class OneCycleScheduleConfig:
    """`scheduler=onecycle`: `lightning_accel.schedules.onecycle_schedule`'s arguments."""

    _target_: str = "lightning_accel.schedules.onecycle_schedule"
    _partial_: bool = True
    max_lr: float | None = None
    pct_start: float = 0.3
    div_factor: float = 25.0
    final_div_factor: float = 10000.0
    anneal_strategy: str = "cos"


@dataclass(kw_only=True, slots=True)
class PlateauScheduleConfig:
    """`scheduler=plateau`: the arguments of torch's `ReduceLROnPlateau` that the option sets."""

    _target_: str = "torch.optim.lr_scheduler.ReduceLROnPlateau"
    _partial_: bool = True
    mode: str = "min"
    factor: float = 0.1
    patience: int = 10


SCHEMAS: dict[str, type] = {
    "threads": ThreadsConfig,
    "nccl": NcclConfig,
    "micro_batch_finder": MicroBatchFinderConfig,
    "compile": CompileConfig,
    "lr_scaling": LRScalingConfig,
    "accumulation_scheduler": AccumulationSchedulerConfig,
    "matmul_precision": MatmulPrecisionConfig,
    "gpu_monitor": GPUMonitorConfig,
    "dataloader_tuner": DataLoaderTunerConfig,
    "nonfinite_guard": NonFiniteGuardConfig,
    "stop_on_signal": StopOnSignalConfig,
    "preflight": PreflightConfig,
    "parallelize": ParallelizeConfig,
    "cosine_schedule": CosineScheduleConfig,
    "linear_warmup_schedule": LinearWarmupScheduleConfig,
    "onecycle_schedule": OneCycleScheduleConfig,
    "plateau_schedule": PlateauScheduleConfig,
}
"""Name in the `accel_schema` group -> its dataclass."""


def register_schemas() -> None:
    """Store every schema in Hydra's ConfigStore under `accel_schema/<name>` (idempotent)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    try:
        stored = set(store.list(SCHEMA_GROUP))
    except OSError:  # the group is not in the store yet
        stored = set()
    for name, node in SCHEMAS.items():
        if f"{name}.yaml" not in stored:  # a structured config costs milliseconds to store: each once per process
            store.store(group=SCHEMA_GROUP, name=name, node=node, provider="lightning_accel")


# --- errors of composition ----------------------------------------------------------------------------------------


def describe_type(hint: Any) -> str:
    """What a schema's type hint accepts, in words for an error's fix: `int | None` -> "an integer, or null"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        kinds = [describe_type(a) for a in args if a is not type(None)]
        words = " or ".join(kinds)
        return f"{words}, or null" if type(None) in args else words
    if origin is list:
        return f"a list of {_plural(args[0])}" if args else "a list"
    if origin is dict:
        return "a mapping of names to strings" if args and args[1] is str else "a mapping"
    return {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
    }.get(hint, getattr(hint, "__name__", str(hint)))


def _plural(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_plural(a) for a in args if a is not type(None))
    return {bool: "booleans", int: "integers", float: "numbers", str: "strings"}.get(hint, describe_type(hint))


def _expected_type(cause: Any) -> Any:
    """The type hint an OmegaConf error was about: the schema field's, else the node's reference type; or None."""
    object_type, key = getattr(cause, "object_type", None), getattr(cause, "key", None)
    if isinstance(object_type, type) and dataclasses.is_dataclass(object_type):
        try:
            return typing.get_type_hints(object_type).get(str(key))
        except (NameError, TypeError):
            return None
    ref_type = getattr(cause, "ref_type", None)
    return ref_type if typing.get_origin(ref_type) is not None or ref_type in (bool, int, float, str) else None


def _schema_keys(cause: Any) -> list[str]:
    object_type = getattr(cause, "object_type", None)
    if isinstance(object_type, type) and dataclasses.is_dataclass(object_type):
        return [f.name for f in dataclasses.fields(object_type) if not f.name.startswith("_")]
    return []


def _one_line(text: str) -> str:
    """The first line of a message of Hydra's or OmegaConf's (the rest is `full_key:` & co)."""
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "").rstrip(".")


_MERGING = re.compile(r"^Error merging override (?P<override>.+)$")
_NOT_THERE = re.compile(r"^Could not (?:override|append to config|delete from config)\.? ?'(?P<key>[^']*)'")
_HYDRA_GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"


def composition_error(err: BaseException) -> ConfigError | None:
    """The `ConfigError` for a config Hydra could not compose, or None when `err` is not one of Hydra's or
    OmegaConf's errors.

    Covers an override Hydra cannot parse (`trainer.max_steps=[`), a value of the wrong type for a typed key
    (`threads.pin=maybe`: a `ConfigTypeError`), a key the config does not have, and an unknown group option
    (`preset=nope`, with the options there are). The message is one line: the override, what is wrong, the fix.
    """
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

    if isinstance(err, OverrideParseException):
        return ConfigError(
            f"the override `{err.override}` cannot be read: {_one_line(err.message)}; write KEY=VALUE, and quote a "
            f"value holding brackets, commas or spaces (`'key=\"a b\"'`) ({_HYDRA_GRAMMAR})."
        )
    if isinstance(err, MissingConfigException):
        options = ", ".join(err.options or ())
        found = f"; the options there are: {options}" if options else ""
        group, _, option = str(err.missing_cfg_file or "").rpartition("/")
        head = f"`{group}={option}` is not an option of `{group}`: " if group and option else ""
        return ConfigError(f"{head}{_one_line(str(err))}{found}.", setting=group or None)
    if not isinstance(err, (ConfigCompositionException, OmegaConfBaseException)):
        return None
    cause = err if isinstance(err, OmegaConfBaseException) else err.__cause__
    if not isinstance(cause, OmegaConfBaseException):
        return ConfigError(f"{_one_line(str(err))}.")
    first = _one_line(str(err))
    merging, missing = _MERGING.match(first), _NOT_THERE.match(first)
    key = str(getattr(cause, "full_key", None) or "")
    if merging:
        override = merging.group("override")
        setting = override.split("=", 1)[0].lstrip("+~")
        head = f"`{override}`"
    else:
        setting = missing.group("key") if missing and missing.group("key") else key
        head = f"`{setting}`" if setting else first
    what = _one_line(getattr(cause, "msg", None) or str(cause))
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and _schema_keys(cause):
        parent = setting.rsplit(".", 1)[0] if "." in setting else "it"
        fix = f"; `{parent}` takes {', '.join(_schema_keys(cause))}"
    else:
        hint = _expected_type(cause)
        fix = f"; `{setting}` takes {describe_type(hint)}" if hint is not None and setting else ""
    kind = ConfigTypeError if isinstance(cause, ValidationError) else ConfigError
    return kind(f"{head}: {what}{fix}.", setting=setting or None)
