"""The other groups' settings, alone and against the run's shape: data fractions and loader numbers, the optimizer,
the scheduler, NCCL, threads, accumulation, the micro-batch size and the example models' data."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_accel.checks._values import _CPU_OVERSUBSCRIPTION, _EXAMPLE_DATA, _check_choice, _check_int, _show
from lightning_accel.errors import ConfigError
from lightning_accel.precision import FLOAT32_MATMUL_PRECISIONS
from lightning_accel.targets import target_class

if TYPE_CHECKING:
    from lightning_accel.shape import RunShape

__all__ = ["check_group_settings"]


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


_MAX_SEED = 2**32 - 1  # numpy's seed range, which `lightning.seed_everything` enforces


def _check_loader_numbers(data: Any) -> None:
    """`data.batch_size` (an integer >= 1) and `data.num_workers` (an integer >= 0), whatever the datamodule."""
    if not isinstance(data, (DictConfig, Mapping)):
        return
    if data.get("batch_size") is not None:
        _check_int("data.batch_size", data.get("batch_size"), minimum=1)
    if data.get("num_workers") is not None:
        _check_int("data.num_workers", data.get("num_workers"), minimum=0)


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
    schedulers = [(name, cfg.callbacks[name]) for name in shape.accumulation_callbacks]
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


def check_group_settings(cfg: DictConfig, shape: RunShape) -> None:
    """Each setting of the groups beyond `trainer`, alone, and those that the run's shape bounds (threads per CPU,
    a global batch over the data-parallel ranks).

    Raises:
        ConfigError: naming the setting, the value received and the fix.
    """
    if cfg.get("float32_matmul_precision") is not None:
        _check_choice(
            "float32_matmul_precision",
            cfg.float32_matmul_precision,
            FLOAT32_MATMUL_PRECISIONS,
            hint="or null to leave it alone",
        )
    _check_fractions(cfg.get("data"))
    _check_nccl(cfg.get("nccl"))
    seed = cfg.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED):
        raise ConfigError(
            f"`seed={seed!r}` must be an integer within [0, {_MAX_SEED}] (what `seed_everything` "
            "takes), or null to leave the random generators alone."
        )
    _check_loader_numbers(cfg.get("data"))
    _check_optimizer(cfg.model.get("optimizer"))
    _check_scheduler(cfg.get("scheduler"))
    _check_threads(cfg.get("threads"), shape)
    _check_accumulation(cfg, shape)
    _check_micro_batch(cfg)
    _check_example_data(cfg.model, cfg.data)
