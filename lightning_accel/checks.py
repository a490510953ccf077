"""The checks made before anything is built or spawned: a config's settings, one by one and together, and the
checkpoint a run would load. Each names the setting, the value and the fix (`ConfigError`, exit 2).
"""

from __future__ import annotations

import datetime
import logging
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_accel.errors import ConfigError, RunFailedError
from lightning_accel.precision import FLOAT32_MATMUL_PRECISIONS, MODEL_PARALLEL_REFUSED, PRECISION_CHOICES
from lightning_accel.run_plan import RunShape, accumulation_callbacks, count_devices, run_shape, target_class

__all__ = [
    "OUTPUT_DIR_KEYS",
    "check_checkpoint_dir",
    "check_checkpoint_fits",
    "check_ckpt_path",
    "check_combinations",
    "check_config",
    "check_hpc_checkpoint",
    "check_loader_memory",
    "check_output_dirs",
    "check_master_port",
    "oom_kills",
    "trainer_setting_error",
    "training_step_error",
    "worker_killed_error",
]

if TYPE_CHECKING:
    from lightning_accel.errors import WorkerKilledError
    from lightning_accel.system.loader_memory import LoaderMemory

log = logging.getLogger(__name__)


_ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")


_DEVICES_STR = re.compile(r"^\s*(auto|-1|\d+|\d+\s*(,\s*\d+\s*)*,?)\s*$")


def check_config(cfg: DictConfig, *, visible_cuda: int | None = None) -> None:
    """Fail fast, before any Trainer or process exists, on settings that cannot work.

    Args:
        cfg: the composed config.
        visible_cuda: CUDA devices visible; None counts them (without creating a CUDA context).

    Raises:
        ConfigError: naming the setting, the value received and the fix.
    """
    for node in ("trainer", "model", "data"):
        section = cfg.get(node)
        if not isinstance(section, DictConfig) or "_target_" not in section:
            raise ConfigError(
                f"`{node}` must be a config with a `_target_`; got {_show(section)}. Pick one with `{node}=NAME`."
            )
    trainer = cfg.trainer
    _check_devices(trainer.get("devices", "auto"))
    _check_choice("trainer.accelerator", trainer.get("accelerator", "auto"), _ACCELERATORS)
    _check_choice(
        "trainer.precision", trainer.get("precision", "32-true"), PRECISION_CHOICES, hint="or pick `precision=NAME`"
    )
    _check_strategy(trainer.get("strategy", "auto"))
    if cfg.get("float32_matmul_precision") is not None:
        _check_choice(
            "float32_matmul_precision",
            cfg.float32_matmul_precision,
            FLOAT32_MATMUL_PRECISIONS,
            hint="or null to leave it alone",
        )
    _check_int("trainer.num_nodes", trainer.get("num_nodes", 1), minimum=1)
    _check_int("trainer.accumulate_grad_batches", trainer.get("accumulate_grad_batches", 1), minimum=1)
    _check_int("trainer.max_steps", trainer.get("max_steps", -1), minimum=-1)
    if trainer.get("max_steps", -1) == 0 and cfg.get("fit", True):
        raise ConfigError(
            "`trainer.max_steps=0` trains nothing; use -1 (no step limit, `max_epochs` decides) or a "
            "number of optimizer steps >= 1 (or `fit=false` to skip training)."
        )
    _check_val_check_interval(trainer.get("val_check_interval"))
    _check_duration("trainer.max_time", trainer.get("max_time"))
    _check_gradient_clipping(trainer.get("gradient_clip_val"), trainer.get("gradient_clip_algorithm"))
    _check_fractions(cfg.get("data"))
    _check_nccl(cfg.get("nccl"))
    if trainer.get("max_epochs") is not None:
        _check_int("trainer.max_epochs", trainer.max_epochs, minimum=-1)
        if trainer.max_epochs == 0 and cfg.get("fit", True) and trainer.get("max_steps", -1) in (-1, None):
            raise ConfigError(
                "`trainer.max_epochs=0` trains nothing; use -1 (no epoch limit, `max_steps` decides) or "
                "a number of epochs >= 1 (or `fit=false` to skip training)."
            )
    _check_limit("trainer.limit_train_batches", trainer.get("limit_train_batches"), cfg.get("fit", True))
    seed = cfg.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED):
        raise ConfigError(
            f"`seed={seed!r}` must be an integer within [0, {_MAX_SEED}] (what `seed_everything` "
            "takes), or null to leave the random generators alone."
        )
    _check_loader_numbers(cfg.get("data"))
    _check_optimizer(cfg.model.get("optimizer"))
    _check_scheduler(cfg.get("scheduler"))
    shape = run_shape(cfg, visible_cuda=visible_cuda)
    _check_threads(cfg.get("threads"), shape)
    _check_accumulation(cfg, shape)
    _check_micro_batch(cfg)
    _check_example_data(cfg.model, cfg.data)
    check_combinations(cfg, shape=shape)


# The example models and the data they train on (conf/model/*.yaml pick it); a user's own model is not checked.
_EXAMPLE_DATA = {
    "GPTLanguageModel": ("StdlibTextDataModule", "stdlib_text", "gpt"),
    "DigitsClassifier": ("DigitsDataModule", "digits", "classifier"),
}


def _check_example_data(model: DictConfig, data: DictConfig) -> None:
    model_class = str(model.get("_target_", "")).rsplit(".", 1)[-1]
    data_class = str(data.get("_target_", "")).rsplit(".", 1)[-1]
    vocab = model.get("vocab_size")
    if data_class == "StdlibTextDataModule" and isinstance(vocab, int) and not isinstance(vocab, bool) and vocab < 256:
        raise ConfigError(
            f"`model.vocab_size={vocab}` is smaller than the 256 byte values `data=stdlib_text` "
            "produces; use `model.vocab_size=256`."
        )
    if model_class in _EXAMPLE_DATA and data_class.endswith("DataModule"):
        wanted, name, model_name = _EXAMPLE_DATA[model_class]
        mine = next((n for c, n, _ in _EXAMPLE_DATA.values() if c == data_class), None)
        if data_class != wanted and mine is not None:
            raise ConfigError(
                f"`model={model_name}` ({model_class}) trains on `data={name}`, but `data={mine}` ({data_class}) was "
                f"chosen; drop the `data=` override (each example model brings its data) or use `data={name}`."
            )


def _show(value: Any) -> str:
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    return repr(value)


def _check_devices(devices: Any) -> None:
    if isinstance(devices, bool):
        pass
    elif isinstance(devices, int):
        if devices == -1 or devices >= 1:
            return
    elif isinstance(devices, str):
        if _DEVICES_STR.match(devices):
            return
    elif isinstance(devices, (ListConfig, Sequence)):
        if len(devices) > 0 and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices):
            if len(set(devices)) == len(devices):
                return
            raise ConfigError(
                f"`trainer.devices={_show(devices)}` names a device twice; list each index once, e.g. "
                "`trainer.devices=[0,1]`."
            )
    raise ConfigError(
        f"`trainer.devices={_show(devices)}` is not a device count or list of device indices; use a count "
        "(`trainer.devices=2`), indices (`trainer.devices=[0,1]`), -1 for all devices, or `auto`."
    )


def _check_val_check_interval(value: Any) -> None:
    """Lightning's `val_check_interval`: a fraction of the epoch in (0, 1], a number of batches >= 1, or (Lightning
    >= 2.6) a time between validations, "DD:HH:MM:SS" or a mapping of `timedelta` arguments."""
    if value is None:
        return
    if isinstance(value, (str, DictConfig, Mapping)) and _time_based_validation():
        _check_duration("trainer.val_check_interval", value)
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        timed = ", or a time (`'00:00:10:00'`)" if _time_based_validation() else ""
        raise ConfigError(
            f"`trainer.val_check_interval={_show(value)}` must be a fraction of the epoch (0 < x <= 1.0) "
            f"or a number of batches (an integer >= 1){timed}."
        )
    if (isinstance(value, int) and value < 1) or (isinstance(value, float) and not 0.0 < value <= 1.0):
        raise ConfigError(
            f"`trainer.val_check_interval={value}` validates never or always; use a fraction of the "
            "epoch (0 < x <= 1.0, e.g. 0.25) or a number of batches (an integer >= 1, e.g. 200)."
        )


def _time_based_validation() -> bool:
    """Whether the installed Lightning takes a time as `val_check_interval` (2.6 and later)."""
    import inspect

    from lightning.pytorch import Trainer

    return "timedelta" in str(inspect.signature(Trainer.__init__).parameters["val_check_interval"].annotation)


_DURATION = re.compile(r"^(\d+):(\d\d):(\d\d):(\d\d)$")
_DURATION_KEYS = ("weeks", "days", "hours", "minutes", "seconds", "milliseconds", "microseconds")


def _check_duration(setting: str, value: Any) -> None:
    """A Lightning duration (`max_time`, a time-based `val_check_interval`): "DD:HH:MM:SS" or a mapping of
    `datetime.timedelta` arguments (`{hours: 12}`), finite, not negative, and not zero."""
    if value is None:
        return
    fix = "write it as DD:HH:MM:SS (`'00:12:00:00'`: 12 hours) or as a mapping (`{hours: 12}`)"
    if isinstance(value, str):
        match = _DURATION.match(value.strip())
        if match is None:
            raise ConfigError(f"`{setting}={value!r}` is not a duration Lightning reads; {fix}.")
        days, hours, minutes, seconds = (int(part) for part in match.groups())
        total = float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)
    elif isinstance(value, (DictConfig, Mapping)):
        parts = dict(value.items())
        unknown = sorted(str(k) for k in parts if k not in _DURATION_KEYS)
        bad = [k for k, v in parts.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
        bad += [k for k, v in parts.items() if k not in bad and (not math.isfinite(v) or v < 0)]
        if unknown or bad or not parts:
            what = f"takes only {', '.join(_DURATION_KEYS)}" if unknown else "needs numbers >= 0"
            raise ConfigError(f"`{setting}={_show(value)}` is not a duration: a mapping {what}; {fix}.")
        try:
            total = datetime.timedelta(**{str(k): v for k, v in parts.items()}).total_seconds()
        except OverflowError:
            total = math.inf
    else:
        raise ConfigError(f"`{setting}={_show(value)}` is not a duration; {fix}.")
    if total > datetime.timedelta.max.total_seconds():
        raise ConfigError(f"`{setting}={_show(value)}` is longer than Python's `timedelta` can hold; {fix}.")
    if total <= 0:
        raise ConfigError(f"`{setting}={_show(value)}` is no time at all; {fix}, or null for no limit.")


def _check_gradient_clipping(value: Any, algorithm: Any) -> None:
    """`gradient_clip_val`: null or 0 (no clipping), or a finite number > 0 (a negative one flips the gradients'
    sign under norm clipping); `gradient_clip_algorithm`: null, norm or value."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
    ):
        raise ConfigError(
            f"`trainer.gradient_clip_val={_show(value)}` must be a finite number >= 0 (the largest gradient norm, "
            "e.g. 1.0), or 0 or null for no clipping."
        )
    if algorithm is not None and str(algorithm) not in ("norm", "value"):
        raise ConfigError(f"`trainer.gradient_clip_algorithm={_show(algorithm)}` must be `norm`, `value` or null.")


def _check_fractions(data: Any) -> None:
    """`data.val_fraction` and `data.test_fraction` (the examples' splits) are fractions that leave training data."""
    if not isinstance(data, (DictConfig, Mapping)):
        return
    total = 0.0
    for key in ("val_fraction", "test_fraction"):
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
            raise ConfigError(f"`data.{key}={_show(value)}` must be a fraction within [0, 1), e.g. 0.05.")
        total += float(value)
    if total >= 1.0:
        raise ConfigError(
            f"`data.val_fraction` + `data.test_fraction` = {total:g} leaves no training data; keep "
            "their sum below 1, e.g. 0.05 each."
        )


def _check_nccl(nccl: Any) -> None:
    if isinstance(nccl, (DictConfig, Mapping)) and nccl.get("preset") is not None:
        from lightning_accel.strategies.nccl import NCCL_PRESETS

        _check_choice("nccl.preset", nccl.get("preset"), NCCL_PRESETS, hint="or pick `nccl=NAME`")


def _check_choice(setting: str, value: Any, choices: Sequence[str], hint: str = "") -> None:
    if isinstance(value, (DictConfig, Mapping)) and "_target_" in value:
        return
    if str(value) not in choices:
        options = ", ".join(f"`{c}`" for c in choices)
        hint = f" {hint}" if hint else ""
        raise ConfigError(f"`{setting}={_show(value)}` is not supported; use one of {options}{hint}.")


def _check_strategy(strategy: Any) -> None:
    if isinstance(strategy, (DictConfig, Mapping)):
        if "_target_" not in strategy:
            raise ConfigError(
                f"`trainer.strategy={_show(strategy)}` needs a `_target_` naming a Lightning Strategy class; "
                "or pick one with `strategy=NAME`."
            )
        return
    from lightning.pytorch.strategies import StrategyRegistry

    _check_choice("trainer.strategy", strategy, ("auto", *StrategyRegistry.keys()), hint="or pick `strategy=NAME`")


_MAX_SEED = 2**32 - 1  # numpy's seed range, which `lightning.seed_everything` enforces


def _check_limit(setting: str, value: Any, fit: bool) -> None:
    """`trainer.limit_*_batches`: a fraction in [0, 1] or a count >= 0; none at all for training that should train."""
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (isinstance(value, float) and value > 1.0)
    ):
        raise ConfigError(f"`{setting}={_show(value)}` must be a fraction within [0, 1] or a number of batches >= 0.")
    if value == 0 and fit and setting.endswith("train_batches"):
        raise ConfigError(
            f"`{setting}={_show(value)}` trains on no batch at all; use a count >= 1 or a fraction "
            "above 0 (or `fit=false` to skip training)."
        )


def _check_loader_numbers(data: Any) -> None:
    """`data.batch_size` (an integer >= 1) and `data.num_workers` (an integer >= 0), whatever the datamodule."""
    if not isinstance(data, (DictConfig, Mapping)):
        return
    if data.get("batch_size") is not None:
        _check_int("data.batch_size", data.get("batch_size"), minimum=1)
    if data.get("num_workers") is not None:
        _check_int("data.num_workers", data.get("num_workers"), minimum=0)


# An optimizer partial's numeric settings: (smallest, largest) allowed, both inclusive; None: unbounded.
_OPTIMIZER_NUMBERS = {"lr": (0.0, None), "weight_decay": (0.0, None), "eps": (0.0, None), "momentum": (0.0, 1.0)}


def _check_optimizer(optimizer: Any) -> None:
    """`model.optimizer.lr` & co: finite numbers in range, before anything is built (torch would raise inside
    `configure_optimizers`, after the processes are launched); `betas` a pair within [0, 1)."""
    if not isinstance(optimizer, (DictConfig, Mapping)):
        return
    for key, (low, high) in _OPTIMIZER_NUMBERS.items():
        value = optimizer.get(key)
        if value is None:
            continue
        bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
        if bad or value < low or (high is not None and value > high):
            bounds = f">= {low:g}" if high is None else f"within [{low:g}, {high:g}]"
            raise ConfigError(f"`model.optimizer.{key}={_show(value)}` must be a finite number {bounds}.")
    betas = optimizer.get("betas")
    if betas is not None:
        values = list(betas) if isinstance(betas, (ListConfig, list, tuple)) else []
        if len(values) != 2 or any(
            isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 <= b < 1.0 for b in values
        ):
            raise ConfigError(
                f"`model.optimizer.betas={_show(betas)}` must be two numbers within [0, 1), e.g. [0.9, 0.95]."
            )


def _check_int(setting: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"`{setting}={_show(value)}` must be an integer >= {minimum}.")


def _check_threads(threads: Any, shape: RunShape) -> None:
    """The `threads` group's values (its types are `schema.ThreadsConfig`'s): the mode and the wait policy among
    their choices, `intra_op` >= 1 and at most a few threads per CPU, `worker_cpu` finite within [0, CPUs]."""
    if not isinstance(threads, (DictConfig, Mapping)):
        return
    from lightning_accel.thread_env import THREAD_MODES, WAIT_POLICIES

    mode = threads.get("mode", "auto")
    if mode not in THREAD_MODES:
        raise ConfigError(f"`threads.mode={mode}` is not supported; use `threads=auto` or `threads=torch`.")
    policy = threads.get("wait_policy")
    if policy is not None and str(policy).upper() not in WAIT_POLICIES:
        raise ConfigError(f"`threads.wait_policy={policy}` is not supported; use PASSIVE, ACTIVE or null.")
    most = _CPU_OVERSUBSCRIPTION * shape.cpus
    intra = threads.get("intra_op")
    if intra is not None and not 1 <= intra <= most:
        raise ConfigError(
            f"`threads.intra_op={intra}` must be within [1, {most}] ({shape.cpus} CPU(s) here, at most "
            f"{_CPU_OVERSUBSCRIPTION} threads each), or null for the plan's."
        )
    worker_cpu = threads.get("worker_cpu", 1.0)
    if not (math.isfinite(worker_cpu) and 0 <= worker_cpu <= shape.cpus):
        raise ConfigError(
            f"`threads.worker_cpu={worker_cpu}` must be a number of CPUs within [0, {shape.cpus}] (the CPUs this "
            "process may use): 1.0 for a CPU-bound loader, 0.25 for one that waits on I/O."
        )


def _check_scheduler(scheduler: Any) -> None:
    """The `scheduler` partial's settings that hold whatever the fit's length (`schedules.check_schedule_settings`)."""
    if not isinstance(scheduler, (DictConfig, Mapping)) or not isinstance(scheduler.get("_target_"), str):
        return
    from lightning_accel.schedules import check_schedule_settings

    settings = OmegaConf.to_container(scheduler, resolve=True) if isinstance(scheduler, DictConfig) else scheduler
    try:
        check_schedule_settings(str(scheduler.get("_target_")), cast("Mapping[str, Any]", settings))
    except ConfigError as err:  # the schedule names its argument; the user wrote it under `scheduler`
        raise err.at("scheduler") from None


def _check_micro_batch(cfg: DictConfig) -> None:
    """A `MicroBatchFinder` given a size: it divides the loader's batch, where the config says the batch (the example
    datamodules' `data.batch_size`, per device); a larger size would run every batch whole, and one that does not
    divide would run a smaller last piece."""
    from lightning_accel.callbacks.micro_batch import MicroBatchFinder

    data_class = str(OmegaConf.select(cfg, "data._target_", default="")).rsplit(".", 1)[-1]
    batch = OmegaConf.select(cfg, "data.batch_size", default=None)
    if data_class not in {c for c, _, _ in _EXAMPLE_DATA.values()} or not isinstance(batch, int) or batch < 1:
        return
    for name, node in (cfg.get("callbacks") or {}).items():
        cls = target_class(node.get("_target_")) if isinstance(node, (DictConfig, Mapping)) else None
        size = node.get("micro_batch_size") if cls is not None and issubclass(cls, MicroBatchFinder) else None
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            continue  # `auto`, or a value the callback's constructor names
        if size > batch or batch % size:
            divisors = [d for d in range(batch - 1, 0, -1) if batch % d == 0][:4]
            what = "is larger than" if size > batch else "does not divide"
            raise ConfigError(
                f"`callbacks.{name}.micro_batch_size={size}` {what} the batch it splits (`data.batch_size={batch}` per "
                f"device); use a divisor of {batch} ({', '.join(map(str, divisors))}, ...), `auto`, or "
                "`micro_batch=none` to run every batch whole."
            )


def _check_accumulation(cfg: DictConfig, shape: RunShape) -> None:
    """An accumulation callback owns `accumulate_grad_batches`; a global batch must split evenly over the
    data-parallel ranks (pipeline stages and tensor-parallel ranks share a batch)."""
    schedulers = accumulation_callbacks(cfg)
    if not schedulers:
        return
    if len(schedulers) > 1:
        names = ", ".join(f"`callbacks.{name}`" for name, _ in schedulers)
        raise ConfigError(f"{names} are all accumulation callbacks; keep one (remove others with `~callbacks.NAME`).")
    name, node = schedulers[0]
    accumulate = cfg.trainer.get("accumulate_grad_batches", 1)
    if accumulate != 1:
        raise ConfigError(
            f"`trainer.accumulate_grad_batches={accumulate}` conflicts with `callbacks.{name}`, which sets it per "
            f"window; use `accumulation=none` with the callback, or remove it with `~callbacks.{name}`."
        )
    global_batch = node.get("global_batch_size")
    micro = node.get("micro_batch_size")
    data_class = str(OmegaConf.select(cfg, "data._target_", default="")).rsplit(".", 1)[-1]
    if micro is None and data_class in {c for c, _, _ in _EXAMPLE_DATA.values()}:
        micro = OmegaConf.select(cfg, "data.batch_size", default=None)  # per device in the examples; others: at fit
    ranks = shape.data_parallel_size()
    if isinstance(global_batch, int) and isinstance(micro, int) and micro > 0 and ranks is not None:
        from lightning_accel.callbacks.accumulation import micro_batches_for

        try:
            micro_batches_for(global_batch, micro, ranks)
        except ConfigError as err:  # the callback names its arguments; the user set them under these paths
            micro_path = f"callbacks.{name}.micro_batch_size" if node.get("micro_batch_size") else "data.batch_size"
            text = str(err).replace("`global_batch_size=", f"`callbacks.{name}.global_batch_size=")
            text = text.replace("`micro_batch_size=", f"`{micro_path}=")
            raise ConfigError(text, setting=f"callbacks.{name}.global_batch_size") from None


def check_combinations(cfg: DictConfig, *, visible_cuda: int | None = None, shape: RunShape | None = None) -> None:
    """Settings that are each valid but fail together, or that Lightning would silently ignore.

    Checked: the accelerator against the CUDA devices visible, `trainer.devices` against them, the strategy against
    the accelerator (FSDP and DeepSpeed need CUDA), the precision against the strategy (ModelParallelStrategy) and
    the accelerator (Transformer Engine needs CUDA), DDP communication hooks on CPU (Lightning drops them), and
    `strategy=pipeline`'s schedule, precision and data-parallel size against the world size.

    Args:
        cfg: the composed config.
        visible_cuda: CUDA devices visible; None counts them (without creating a CUDA context).
        shape: the config's run shape, when the caller has it already.

    Raises:
        ConfigError: naming the settings, the values and the fix.
    """
    shape = shape or run_shape(cfg, visible_cuda=visible_cuda)
    accelerator, visible, on_cuda, devices = shape.accelerator, shape.visible_cuda, shape.on_cuda, shape.devices
    if accelerator not in ("auto", "cpu", "gpu", "cuda"):
        return  # mps and tpu: Lightning checks those itself
    if accelerator in ("gpu", "cuda") and visible == 0:
        raise ConfigError(
            f"`trainer.accelerator={accelerator}` but this process sees no CUDA device (check `nvidia-smi` and "
            "CUDA_VISIBLE_DEVICES, or run `accel-doctor`); use `trainer.accelerator=cpu` to run on the CPU."
        )
    if on_cuda:
        _check_devices_visible(devices, visible)
    else:
        _check_cpu_processes(devices, shape.cpus)
    strategy, name, precision = cfg.trainer.get("strategy", "auto"), shape.family, shape.precision
    if not on_cuda and name in ("fsdp", "deepspeed"):
        fix = "`strategy=model_parallel` (FSDP2, runs on CPU)" if name == "fsdp" else "`strategy=ddp`"
        shown = strategy.get("_target_") if isinstance(strategy, (DictConfig, Mapping)) else strategy
        raise ConfigError(
            f"`trainer.strategy={shown!r}` needs CUDA GPUs, but this run is on the CPU "
            f"(`trainer.accelerator={accelerator}`); use {fix}, or run on GPUs."
        )
    if name == "model_parallel" and precision in MODEL_PARALLEL_REFUSED:
        raise ConfigError(
            f"`trainer.precision={precision}` is not supported by `strategy=model_parallel` (ModelParallelStrategy "
            "takes 32-true, bf16-mixed, bf16-true or 16-true); use `precision=bf16_mixed`."
        )
    cls = target_class(strategy.get("_target_")) if isinstance(strategy, (DictConfig, Mapping)) else None
    from lightning_accel.strategies.pipeline import PipelineStrategy

    if cls is not None and issubclass(cls, PipelineStrategy):  # ours, not another pipeline strategy
        from lightning_accel.strategies.pipeline import check_pipeline_settings

        values = OmegaConf.to_container(strategy, resolve=True) if isinstance(strategy, DictConfig) else strategy
        try:  # a strategy node is a mapping: its class was read from its `_target_`
            check_pipeline_settings(cast("Mapping[str, Any]", values), precision=precision, world=shape.world_size)
        except ConfigError as err:  # the library names its arguments; the user wrote them under these paths
            raise err.at("trainer" if err.setting == "precision" else "trainer.strategy") from None
    _check_callbacks(cfg, shape)
    if not on_cuda and precision.startswith("transformer-engine"):
        raise ConfigError(
            f"`trainer.precision={precision}` needs a CUDA GPU (Transformer Engine), but this run is on the CPU; "
            "use `precision=bf16_mixed` or `precision=fp32`."
        )
    if not on_cuda and isinstance(strategy, (DictConfig, Mapping)) and strategy.get("ddp_comm_hook") is not None:
        raise ConfigError(
            f"`trainer.strategy.ddp_comm_hook={_show(strategy.get('ddp_comm_hook'))}` has no effect on the CPU: "
            "Lightning registers DDP communication hooks on CUDA only and drops them silently elsewhere; remove "
            "it (`~trainer.strategy.ddp_comm_hook`) or run on GPUs."
        )


_CPU_OVERSUBSCRIPTION = 4  # CPU ranks per usable CPU still accepted: tests run 4 pipeline ranks on 2 cores


def _check_cpu_processes(devices: Any, cpus: int) -> None:
    """On the CPU, `trainer.devices` is a number of processes: Lightning starts any number, each with its own copy
    of the model; far more than the CPUs only thrashes (and 1000 exhausts memory or process limits)."""
    count = count_devices(devices)
    if count is None or count <= 1:
        return
    if count > _CPU_OVERSUBSCRIPTION * cpus:
        raise ConfigError(
            f"`trainer.devices={_show(devices)}` starts {count} CPU processes, but this process may use "
            f"{cpus} CPU(s) (affinity and cgroup quota); use at most `trainer.devices={_CPU_OVERSUBSCRIPTION * cpus}` "
            f"(better {cpus}), or run on GPUs."
        )


def _check_devices_visible(devices: Any, visible: int) -> None:
    if isinstance(devices, (ListConfig, list)) or (isinstance(devices, str) and "," in devices):
        indices = devices if not isinstance(devices, str) else [int(d) for d in devices.split(",") if d.strip()]
        missing = [d for d in indices if isinstance(d, int) and d >= visible]
        if missing:
            raise ConfigError(
                f"`trainer.devices={_show(devices)}` names device(s) {missing}, but only indices 0..{visible - 1} "
                f"are visible; use indices below {visible}, or check CUDA_VISIBLE_DEVICES."
            )
        return
    count = count_devices(devices)
    if count is not None and count > visible:
        raise ConfigError(
            f"`trainer.devices={count}` but only {visible} CUDA device(s) are visible; use "
            f"`trainer.devices={visible}` or `trainer.devices=-1` (all), or check CUDA_VISIBLE_DEVICES."
        )


def _check_callbacks(cfg: DictConfig, shape: RunShape) -> None:
    """Each callback's own rule for the run (`check_run(family=..., on_cuda=..., block_classes=..., settings=...)`,
    a classmethod beside the callback, as `check_pipeline_settings` beside the pipeline): the plan asks the class
    a `_target_` names, never matches its name."""
    block_classes = bool(OmegaConf.select(cfg, "callbacks.parallelize.block_classes"))
    for name, node in (cfg.get("callbacks") or {}).items():
        cls = target_class(node.get("_target_")) if isinstance(node, (DictConfig, Mapping)) else None
        rule = getattr(cls, "check_run", None)
        if not callable(rule):
            continue
        settings = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
        try:
            rule(family=shape.family, on_cuda=shape.on_cuda, block_classes=block_classes, settings=settings)
        except ConfigError as err:  # the callback says what it cannot do; the user chose it under this key
            where = f"callbacks.{name}" + (f".{err.setting}" if err.setting else "")
            raise ConfigError(f"`callbacks.{name}` {err}", setting=where) from None


def check_ckpt_path(cfg: DictConfig) -> str | None:
    """`ckpt_path` names a checkpoint this run can load (to resume with `fit`, or to test with `fit=false`): `last`
    needs the run directory's `last.ckpt`; a path must be a `torch.save` file (a zip archive) or a distributed
    checkpoint directory (with `.metadata`), and nothing in it may need more than tensors and plain types.

    Returns:
        The checkpoint to load (`last` resolved to its file), `best`/`hpc`/`registry` as they are, or None.

    Raises:
        ConfigError: naming the path, what it is, and the fix.
    """
    path = cfg.get("ckpt_path")
    if path is None or str(path) in ("best", "hpc", "registry"):
        return None if path is None else str(path)
    from lightning_accel.strategies.checkpoint_io import recover_directory

    if str(path) == "last":
        dirpath = OmegaConf.select(cfg, "callbacks.model_checkpoint.dirpath", default=None)
        if dirpath is None:
            return "last"
        last = Path(str(dirpath)) / "last.ckpt"
        recover_directory(last)  # a directory checkpoint whose swap a kill interrupted
        if not last.exists():
            raise ConfigError(
                f"`ckpt_path=last` finds no {last}: this run directory "
                "holds no earlier run. Resume in the earlier run's directory "
                "(`hydra.run.dir=<its directory> ckpt_path=last`) or pass its checkpoint file "
                "(`ckpt_path=<dir>/checkpoints/last.ckpt`)."
            )
        path = last  # checked below like any path: Lightning drops `weights_only` for some strategies
    import zipfile

    file = Path(str(path))
    recover_directory(file)
    if not file.exists():
        raise ConfigError(
            f"`ckpt_path={str(path)!r}` does not exist; pass a checkpoint file (`.../checkpoints/"
            "last.ckpt`) or `ckpt_path=last` in the run directory to resume."
        )
    if not (file.is_dir() or file.is_file()):  # a FIFO or a device would block the first read
        raise ConfigError(
            f"`ckpt_path={str(path)!r}` is not a regular file or directory (a pipe, a socket or a "
            "device); pass a checkpoint file or directory."
        )
    if file.is_dir() and not (file / ".metadata").is_file():
        raise ConfigError(
            f"`ckpt_path={str(path)!r}` is a directory but not a distributed checkpoint (no "
            "`.metadata`); pass a checkpoint file or a directory a PipelineStrategy or "
            "ModelParallelStrategy run saved."
        )
    if file.is_file() and not zipfile.is_zipfile(file):
        raise ConfigError(
            f"`ckpt_path={str(path)!r}` is not a checkpoint (not a torch.save archive: truncated, "
            "corrupt or another kind of file); pass the run's `checkpoints/last.ckpt` or another "
            "checkpoint."
        )
    from lightning_accel.strategies.dcp_checks import check_distributed_checkpoint, load_metadata

    # no pickle payload runs: a file (or any file of a distributed checkpoint: index, shards, meta.pt) needing more
    # than tensors and plain types is refused here, whatever torch's default `weights_only` is (False before 2.6)
    if file.is_dir():
        check_distributed_checkpoint(file)
    else:
        load_metadata(file, mmap=True)  # mapped, not read: every rank checks, before launch
    return str(file)


def check_hpc_checkpoint(cfg: DictConfig) -> str | None:
    """The HPC checkpoint Lightning resumes from by itself, checked before launch like any `ckpt_path`: under SLURM
    with `ckpt_path=null` (or `ckpt_path=hpc`) Lightning loads the newest `hpc_ckpt_<n>.ckpt` in the run directory
    (`trainer.default_root_dir`), which a requeued job finds there.

    Returns:
        The HPC checkpoint Lightning will load, or None.

    Raises:
        ConfigError: naming the file, that it holds objects torch's `weights_only` load refuses (or is no checkpoint
            at all), and the fix.
    """
    import pickle

    import torch
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from lightning_accel.strategies.dcp_checks import refused_object

    asked = cfg.get("ckpt_path")
    if not cfg.get("fit", True) or not (asked == "hpc" or (asked is None and SLURMEnvironment.detect())):
        return None
    root = OmegaConf.select(cfg, "trainer.default_root_dir", default=None)
    folder = Path(str(root)) if root is not None and "://" not in str(root) else None
    versions = [] if folder is None or not folder.is_dir() else list(folder.glob("hpc_ckpt_*.ckpt"))
    numbered = [(int(p.stem.rsplit("_", 1)[1]), p) for p in versions if p.stem.rsplit("_", 1)[1].isdigit()]
    if not numbered:
        return None
    hpc = max(numbered)[1]
    resumed = f"which Lightning resumes from by itself under SLURM (`ckpt_path={asked or 'null'}`)"
    try:
        torch.load(hpc, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        raise ConfigError(
            f"the HPC checkpoint {hpc}, {resumed}, holds objects that torch's `weights_only` load refuses "
            f"({refused_object(err)}): loading it could run code, so it is not loaded. If this job did not save it, "
            f"or you do not trust it, move it out of {hpc.parent} (the job then starts afresh, or resumes with "
            "`ckpt_path=last`); if you made it and trust it, load it once with `torch.load(path, weights_only=False)` "
            "and save its tensors and plain values again."
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as err:  # truncated, or not torch's archive
        raise ConfigError(
            f"the HPC checkpoint {hpc}, {resumed}, is not a readable torch checkpoint ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else 'no detail'}); move it out of {hpc.parent} (the job then "
            "starts afresh, or resumes with `ckpt_path=last`)."
        ) from None
    return str(hpc)


def check_checkpoint_dir(cfg: DictConfig) -> None:
    """The checkpoint directory can be written, before anything trains (a read-only one failed at the first save,
    after training); what killed saves left in it is removed.

    Raises:
        ConfigError: naming `callbacks.model_checkpoint.dirpath`, the path and what the OS said.
    """
    from lightning_accel.files import directory_write_error
    from lightning_accel.strategies.checkpoint_io import remove_stale_temporaries

    dirpath = OmegaConf.select(cfg, "callbacks.model_checkpoint.dirpath", default=None)
    if dirpath is None or "://" in str(dirpath) or not cfg.get("fit", True):
        return
    problem = directory_write_error(str(dirpath))
    if problem is not None:
        raise ConfigError(
            f"`callbacks.model_checkpoint.dirpath={dirpath}` cannot be written: {problem}; make it writable or "
            "point it elsewhere."
        )
    removed = remove_stale_temporaries(str(dirpath))
    if removed:
        log.info("removed what killed saves left in %s: %s", dirpath, ", ".join(p.name for p in removed))


OUTPUT_DIR_KEYS = (
    "dirpath",
    "save_dir",
    "report_dir",
    "runs_dir",
    "cache_dir",
    "prometheus_textfile_dir",
    "prometheus_file_sd_dir",
)
"""The settings of a callback or logger that name a directory it writes into (checked before launch)."""


def check_output_dirs(cfg: DictConfig) -> None:
    """Every directory a callback or logger of the run writes into, where the config names one (`logger.csv.save_dir`,
    `callbacks.gpu_monitor.report_dir`, `callbacks.nonfinite.dirpath`, ...), can be created and written, before
    launch: a logger's failed at the first step with a traceback; the others lost their output silently or late
    (a NaN checkpoint, a report at the end of the run). Nothing is created.

    Raises:
        ConfigError: naming the setting, the path in the way and what the OS said (`Read-only file system (EROFS)`).
    """
    from lightning_accel.files import directory_write_error

    for group in ("callbacks", "logger"):
        nodes = cfg.get(group) or {}
        for name, node in nodes.items() if isinstance(nodes, (DictConfig, Mapping)) else ():
            if not isinstance(node, (DictConfig, Mapping)) or (group, name) == ("callbacks", "model_checkpoint"):
                continue  # `check_checkpoint_dir` checks that one when the run fits
            for key in OUTPUT_DIR_KEYS:
                value = node.get(key)
                if not isinstance(value, str) or not value or "://" in value:
                    continue
                problem = directory_write_error(value)
                if problem is not None:
                    raise ConfigError(
                        f"`{group}.{name}.{key}={value}` cannot be written: {problem}; point it at a writable "
                        "directory."
                    )


def check_checkpoint_fits(model: Any, path: str | None) -> None:
    """The checkpoint to load holds the model's own parameters and shapes, checked before launch (another model
    configuration failed inside Lightning's load, with a traceback of key lists). A model with `strict_loading=False`
    is not checked.

    Raises:
        ConfigError: naming the checkpoint, what differs (a few names and shapes) and the fix.
    """
    if path is None or path in ("best", "last", "hpc", "registry") or not getattr(model, "strict_loading", True):
        return
    from lightning_accel.strategies.dcp_checks import checkpoint_shapes

    theirs = checkpoint_shapes(path)
    if theirs is None:  # a format whose parameters cannot be read without loading it
        return
    mine = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing = sorted(set(mine) - set(theirs))
    unexpected = sorted(set(theirs) - set(mine))
    different = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])
    if not (missing or unexpected or different):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} of the model's parameters are not in it ({', '.join(missing[:3])}, ...)")
    if unexpected:
        parts.append(f"it holds {len(unexpected)} the model lacks ({', '.join(unexpected[:3])}, ...)")
    if different:
        shown = ", ".join(f"{n} {theirs[n]} vs the model's {mine[n]}" for n in different[:3])
        parts.append(f"{len(different)} differ in shape ({shown})")
    raise ConfigError(
        f"`ckpt_path={path}` was saved by another model configuration: {'; '.join(parts)}. Resume with "
        "the `model.*` settings it was trained with, or start a new run."
    )


def check_master_port(env: Any = None) -> None:
    """A `MASTER_PORT` of ours that another process holds is refused before launch (the ranks waited 125 s for a
    rendezvous that could not happen, then blamed it). Only for jobs this process launches: under torchrun or SLURM
    the launcher owns the port.

    Raises:
        ConfigError: naming `MASTER_PORT`, the port and the fix.
    """
    import os
    import socket

    env = os.environ if env is None else env
    port = env.get("MASTER_PORT")
    if not port or any(k in env for k in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_PROCID")):
        return
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"`MASTER_PORT={port}` is not a port number; unset it or use one within 1-65535.")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", int(port)))  # one node: the store listens here
        except OSError:
            raise ConfigError(
                f"`MASTER_PORT={port}` is taken by another process, so the ranks could not meet; unset "
                "it (Lightning picks a free port) or choose a free one."
            ) from None


def trainer_setting_error(err: Exception, cfg: DictConfig, trainer: Any) -> ConfigError | None:
    """Lightning's own refusal of a Trainer setting before the first step (`val_check_interval` beyond the epoch,
    ...), as a ConfigError naming the config path and value, or None for any other error."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    if trainer.global_step > 0 or not isinstance(err, (ValueError, MisconfigurationException)):
        return None
    text = str(err).strip()
    for name in re.findall(r"`(\w+)`", text):
        if name in cfg.trainer:
            return ConfigError(f"`trainer.{name}={cfg.trainer.get(name)}`: {text.splitlines()[0]}")
    return None


def _batch_bytes(data: Any) -> int | None:
    """Bytes of one training batch, where the config alone says: a language-model batch (`batch_size` x `block_size`
    int64 tokens, inputs and targets); None for data whose batches the config does not describe."""
    if not isinstance(data, (DictConfig, Mapping)):
        return None
    batch, block = data.get("batch_size"), data.get("block_size")
    if isinstance(batch, int) and isinstance(block, int) and batch > 0 and block > 0:
        return 2 * batch * block * 8
    return None


def check_loader_memory(
    cfg: DictConfig,
    ranks: int,
    *,
    root: str = "/",
    rank_bytes: int | None = None,
    worker_bytes: int | None = None,
) -> LoaderMemory | None:
    """Refuse, before launch, DataLoader workers that the cgroup's memory limit cannot hold: ranks x workers x
    (prefetched batches + each worker's footprint), plus pinned copies, beside what the ranks hold.

    A worker's footprint (`worker_bytes`; None: measured once, `system.loader_memory.worker_footprint`, and only
    when there is a limit to hold it against: one worker started for a second or two).

    Returns the estimate (`system.loader_memory.LoaderMemory`), or None when the config does not say a batch's size.

    Raises:
        ConfigError: naming `data.num_workers`, the figures and the most workers that fit.
    """
    from lightning_accel.system.cgroup import read_memory_limit
    from lightning_accel.system.loader_memory import estimate_loader_memory, worker_footprint

    data = cfg.get("data")
    batch_bytes = _batch_bytes(data)
    workers = data.get("num_workers", 0) if isinstance(data, (DictConfig, Mapping)) else 0
    if batch_bytes is None or not isinstance(workers, int) or workers <= 0:
        return None
    if rank_bytes is None:
        import psutil

        rank_bytes = psutil.Process().memory_info().rss
    limit = read_memory_limit(root)
    note = ""
    if worker_bytes is None and limit.limit_bytes is not None:
        worker_bytes, note = worker_footprint()
    prefetch = data.get("prefetch_factor") or 2
    estimate = estimate_loader_memory(
        limit_bytes=limit.limit_bytes,
        source=limit.source,
        ranks=ranks,
        num_workers=workers,
        prefetch_factor=prefetch if isinstance(prefetch, int) else 2,
        batch_bytes=batch_bytes,
        worker_bytes=worker_bytes,
        worker_bytes_note=note,
        pin_memory=bool(data.get("pin_memory", False)),
        rank_bytes=rank_bytes,
    )
    if not estimate.fits:
        most = estimate.most_workers
        fix = (
            f"use `data.num_workers={most}` (the most that fit)"
            if most
            else "use `data.num_workers=0` (no worker fits)"
        )
        raise ConfigError(
            f"`data.num_workers={workers}` would be OOM-killed: {estimate.describe()}; {fix}, a smaller "
            "`data.batch_size` or `data.prefetch_factor`, or raise the memory limit (`docker run --memory`)."
        )
    return estimate


CGROUP_ROOT = "/"
"""The root the cgroup's memory files are read under when a worker dies (tests point it at a fake tree)."""
_WORKER_KILLED = re.compile(
    r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (?:is killed by signal: Killed|exited unexpectedly)"
)


def oom_kills() -> int | None:
    """The memory cgroup's OOM-kill count now (`system.cgroup.read_oom_kills`), read when a run starts so a kill
    during the run can be told from older ones; None when unreadable."""
    from lightning_accel.system.cgroup import read_oom_kills

    found = read_oom_kills(CGROUP_ROOT)
    return None if found is None else found[0]


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB"


def worker_killed_error(
    err: BaseException, trainer: Any, *, oom_kills_before: int | None = None
) -> WorkerKilledError | None:
    """A `WorkerKilledError` for a DataLoader worker killed by SIGKILL (torch's "DataLoader worker (pid X) is killed
    by signal: Killed" or "... exited unexpectedly"), naming the cause the cgroup shows: its memory limit, with the
    figures, when its OOM-kill count grew during the run. Says which checkpoint stands. None for any other error.
    """
    from lightning_accel.errors import WorkerKilledError
    from lightning_accel.system.cgroup import read_memory_limit, read_oom_kills

    seen: BaseException | None = err
    match = None
    while seen is not None and match is None:
        match = _WORKER_KILLED.search(str(seen))
        seen = seen.__cause__ or seen.__context__
    if match is None:
        return None
    pids = match.group(1).strip()
    limit = read_memory_limit(CGROUP_ROOT)
    found = read_oom_kills(CGROUP_ROOT)
    kills, events = (None, "") if found is None else (found[0] - (oom_kills_before or 0), found[1])
    fix = (
        "use fewer `data.num_workers`, a smaller `data.batch_size` or `data.prefetch_factor`, or raise the memory "
        "limit (`docker run --memory`)"
    )
    if limit.limit_bytes is not None and kills is not None and kills > 0:
        cause = (
            f"killed by the cgroup's memory limit: {_gib(limit.limit_bytes)} ({limit.source}), {kills} OOM kill(s) "
            f"during the run in {events}"
        )
    elif limit.limit_bytes is not None and found is None:
        cause = (
            f"killed (SIGKILL); the cgroup's memory limit is {_gib(limit.limit_bytes)} ({limit.source}) and its OOM "
            "kills cannot be read: most likely that limit"
        )
    else:
        why = "no cgroup memory limit" if limit.limit_bytes is None else f"no OOM kill counted in {events}"
        cause = f"killed (SIGKILL), not by the cgroup's memory limit ({why}): by the kernel's OOM killer or a process"
        fix = "check `dmesg` for the OOM killer, and what else sends signals on this machine; " + fix
    last = str(getattr(getattr(trainer, "checkpoint_callback", None), "last_model_path", "") or "")
    kept = (
        f"the last checkpoint stands: {last} (resume with `ckpt_path=last`)"
        if last and Path(last).is_file()
        else "no checkpoint had been saved yet"
    )
    step = getattr(trainer, "global_step", "?")
    return WorkerKilledError(f"DataLoader worker (pid {pids}) was {cause}, at global step {step}; {kept}. Fix: {fix}.")


def training_step_error(err: BaseException, cfg: DictConfig, trainer: Any) -> RunFailedError | None:
    """Lightning's refusal of what the model's `training_step` returned (a dict without 'loss', a list, a string),
    named: the model, what it returned, and what automatic optimization needs. None for any other error."""
    from lightning_accel import _lightning

    refused = _lightning.training_step_output_refused(err)
    if refused is None:
        return None
    kept, output = refused
    if not kept:
        returned = "a dict without 'loss', or something that is neither a Tensor, a dict nor None"
    elif isinstance(output, Mapping):
        returned = f"a dict with the keys {sorted(map(str, output))} and no 'loss' (or 'loss' set to None)"
    else:
        returned = f"a {type(output).__name__} ({_show(output)[:80]}), which is neither a Tensor, a dict nor None"
    target = OmegaConf.select(cfg, "model._target_", default=None)
    model = f"`model._target_={target}`" if target else "the model"
    return RunFailedError(
        f"{model}: `training_step` returned {returned}, at global step {trainer.global_step}. Lightning's automatic "
        "optimization needs the loss to backpropagate: return the loss tensor, a dict holding it under 'loss' "
        "(`{'loss': loss, ...}`; the other keys reach `on_train_batch_end`), or None to skip the batch."
    )
