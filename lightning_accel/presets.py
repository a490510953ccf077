"""The run shape (facts about a composed run, computed once) and the checks made before anything is built or spawned.

`run_shape(cfg)` is the one place that parses `trainer.devices`, names the strategy family, finds the accumulation
callback and counts the CPUs (through `system/`) and CUDA devices; the checks here, accel-bench's ladder and the run
summary read those facts from it instead of working them out again.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_accel.errors import ConfigError
from lightning_accel.precision import FLOAT32_MATMUL_PRECISIONS, MODEL_PARALLEL_REFUSED, PRECISION_CHOICES

__all__ = [
    "DISTRIBUTED_FAMILIES",
    "RunShape",
    "accumulation_callbacks",
    "apply_ddp_grad_compression",
    "check_combinations",
    "check_config",
    "count_devices",
    "effective_trainer_settings",
    "run_shape",
    "runs_on_cuda",
    "strategy_family",
]

_ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")
_DEVICES_STR = re.compile(r"^\s*(auto|-1|\d+|\d+\s*(,\s*\d+\s*)*,?)\s*$")


def check_config(cfg: DictConfig) -> None:
    """Fail fast, before any Trainer or process exists, on settings that cannot work.

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
        _check_choice("float32_matmul_precision", cfg.float32_matmul_precision, FLOAT32_MATMUL_PRECISIONS,
                      hint="or null to leave it alone")  # fmt: skip
    _check_int("trainer.num_nodes", trainer.get("num_nodes", 1), minimum=1)
    _check_int("trainer.accumulate_grad_batches", trainer.get("accumulate_grad_batches", 1), minimum=1)
    _check_int("trainer.max_steps", trainer.get("max_steps", -1), minimum=-1)
    if trainer.get("max_steps", -1) == 0 and cfg.get("fit", True):
        raise ConfigError("`trainer.max_steps=0` trains nothing; use -1 (no step limit, `max_epochs` decides) or a "
                          "number of optimizer steps >= 1 (or `fit=false` to skip training).")  # fmt: skip
    _check_val_check_interval(trainer.get("val_check_interval"))
    _check_fractions(cfg.get("data"))
    _check_nccl(cfg.get("nccl"))
    if trainer.get("max_epochs") is not None:
        _check_int("trainer.max_epochs", trainer.max_epochs, minimum=-1)
        if trainer.max_epochs == 0 and cfg.get("fit", True) and trainer.get("max_steps", -1) in (-1, None):
            raise ConfigError("`trainer.max_epochs=0` trains nothing; use -1 (no epoch limit, `max_steps` decides) or "
                              "a number of epochs >= 1 (or `fit=false` to skip training).")  # fmt: skip
    _check_limit("trainer.limit_train_batches", trainer.get("limit_train_batches"), cfg.get("fit", True))
    seed = cfg.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED):
        raise ConfigError(f"`seed={seed!r}` must be an integer within [0, {_MAX_SEED}] (what `seed_everything` "
                          "takes), or null to leave the random generators alone.")  # fmt: skip
    _check_loader_numbers(cfg.get("data"))
    _check_optimizer(cfg.model.get("optimizer"))
    shape = run_shape(cfg)
    _check_accumulation(cfg, shape)
    _check_example_data(cfg.model, cfg.data)
    check_combinations(cfg, shape=shape)


# The example models and the data they train on (conf/model/*.yaml pick it); a user's own model is not checked.
_EXAMPLE_DATA = {"GPTLanguageModel": ("StdlibTextDataModule", "stdlib_text", "gpt"),
                 "DigitsClassifier": ("DigitsDataModule", "digits", "classifier")}  # fmt: skip


def _check_example_data(model: DictConfig, data: DictConfig) -> None:
    model_class = str(model.get("_target_", "")).rsplit(".", 1)[-1]
    data_class = str(data.get("_target_", "")).rsplit(".", 1)[-1]
    vocab = model.get("vocab_size")
    if data_class == "StdlibTextDataModule" and isinstance(vocab, int) and not isinstance(vocab, bool) and vocab < 256:
        raise ConfigError(f"`model.vocab_size={vocab}` is smaller than the 256 byte values `data=stdlib_text` "
                          "produces; use `model.vocab_size=256`.")  # fmt: skip
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


def count_devices(devices: Any) -> int | None:
    """Devices per node that `trainer.devices` fixes: a count (`2`, `"2"`), or the length of a list of indices
    (`[0, 1]`, `"0,1"`); None for `auto` and -1 (the machine decides) and for values that are not device settings."""
    if isinstance(devices, bool):
        return None
    if isinstance(devices, (ListConfig, list, tuple)):
        return len(devices)
    if isinstance(devices, int):
        return devices if devices > 0 else None
    text = str(devices).strip()
    if "," in text:
        return len([d for d in text.split(",") if d.strip()])
    return int(text) if text.isdigit() and int(text) > 0 else None


_STRATEGY_FAMILIES = {"DDPStrategy": "ddp", "FSDPStrategy": "fsdp", "ModelParallelStrategy": "model_parallel",
                      "DeepSpeedStrategy": "deepspeed", "SingleDeviceStrategy": "single_device",
                      "PipelineStrategy": "pipeline"}  # fmt: skip
DISTRIBUTED_FAMILIES = ("ddp", "fsdp", "model_parallel", "deepspeed", "pipeline")


def strategy_family(strategy: Any) -> str:
    """The strategy family ("auto", "ddp", "fsdp", "model_parallel", "pipeline", "deepspeed", "single_device", or
    the class name of another strategy) of a registry name (`ddp_spawn`) or a `_target_` config."""
    if isinstance(strategy, (DictConfig, Mapping)):
        target = str(strategy.get("_target_", "")).rsplit(".", 1)[-1]
        if target in _STRATEGY_FAMILIES:
            return _STRATEGY_FAMILIES[target]
        return "pipeline" if "pipeline" in target.lower() else target
    name = str(strategy)
    for family in ("fsdp", "deepspeed", "ddp"):
        if name.startswith(family):
            return family
    return name


def accumulation_callbacks(cfg: DictConfig) -> list[tuple[str, DictConfig]]:
    """`(name, node)` of each callback in `cfg.callbacks` that sets `accumulate_grad_batches` per window: this
    package's `AccumulationScheduler` or Lightning's `GradientAccumulationScheduler`."""
    callbacks = cfg.get("callbacks") or {}
    return [
        (str(name), node)
        for name, node in callbacks.items()
        if isinstance(node, DictConfig) and str(node.get("_target_", "")).rsplit(".", 1)[-1] in _ACCUMULATION_CALLBACKS
    ]


_ACCUMULATION_CALLBACKS = ("AccumulationScheduler", "GradientAccumulationScheduler")


def _visible_cuda_devices() -> int:
    """CUDA devices this process sees, counted without creating a CUDA context (NVML first, as Lightning does)."""
    from lightning.fabric.accelerators.cuda import num_cuda_devices

    return num_cuda_devices()


def _usable_cpus() -> int:
    """CPUs this process may use: its affinity, capped by the cgroup's CPU quota (`system/` reads both)."""
    from lightning_accel.system.cgroup import read_cpu_budget

    return max(1, int(read_cpu_budget().effective))


@dataclass(frozen=True, kw_only=True)
class RunShape:
    """What a composed run is, computed once from its config by `run_shape`: where it runs, on how many processes,
    with which strategy family, data-parallel size and accumulation callback."""

    accelerator: str
    """`trainer.accelerator` as configured (auto, cpu, gpu, cuda, ...)."""
    on_cuda: bool
    """Whether the run's accelerator is CUDA (`gpu`/`cuda`, or `auto` with a CUDA device visible)."""
    visible_cuda: int
    """CUDA devices this process sees."""
    cpus: int
    """CPUs this process may use (affinity and cgroup quota)."""
    devices: Any
    """`trainer.devices` as configured (plain Python)."""
    devices_per_node: int | None
    """What `trainer.devices` fixes (`count_devices`); None for `auto` and -1, which the machine decides."""
    num_nodes: int
    family: str
    """`strategy_family` of `trainer.strategy`."""
    strategy: Any
    """`trainer.strategy` as configured (plain Python: a registry name or a dict with `_target_`)."""
    precision: str
    """`trainer.precision` as configured."""
    accumulation_callback: str | None
    """The name under `callbacks` of the accumulation callback, if there is (exactly) one."""

    @property
    def world_size(self) -> int | None:
        """Devices x nodes when the config fixes both; None when the machine decides."""
        return None if self.devices_per_node is None else self.devices_per_node * self.num_nodes

    @property
    def distributed(self) -> bool:
        """Whether the strategy is one that runs several processes (DDP, FSDP, model parallel, pipeline, DeepSpeed)."""
        return self.family in DISTRIBUTED_FAMILIES

    def data_parallel_size(self, world_size: int | None = None) -> int | None:
        """Ranks that load batches of their own on `world_size` processes (default: `self.world_size`): a
        pipeline's `data_parallel_size` (default 1), a model-parallel strategy's (`auto`: the world over
        `tensor_parallel_size` for this package's, the number of nodes for Lightning's own), else the world size."""
        world = self.world_size if world_size is None else world_size
        strategy = self.strategy if isinstance(self.strategy, Mapping) else {}
        if self.family == "pipeline":
            dp = strategy.get("data_parallel_size", 1)
            return dp if isinstance(dp, int) and dp > 0 else world
        if self.family == "model_parallel":
            dp = strategy.get("data_parallel_size", "auto")
            if isinstance(dp, int) and dp > 0:
                return dp
            if not str(strategy.get("_target_", "")).startswith("lightning_accel."):
                return self.num_nodes  # Lightning's ModelParallelStrategy: "auto" is the number of nodes
            tp = strategy.get("tensor_parallel_size", 1)
            if not (isinstance(tp, int) and tp > 0):
                return self.num_nodes  # both "auto": Lightning's own rule, the number of nodes
            return None if world is None else max(1, world // tp)
        return world


def run_shape(cfg: DictConfig, *, visible_cuda: int | None = None, cpus: int | None = None) -> RunShape:
    """The `RunShape` of a composed config (one with a `trainer` section).

    Args:
        cfg: the composed config.
        visible_cuda: CUDA devices visible; None counts them (without creating a CUDA context).
        cpus: CPUs this process may use; None reads them through `system/` (affinity and cgroup quota).
    """
    trainer = cfg.trainer
    accelerator = str(trainer.get("accelerator", "auto"))
    visible = _visible_cuda_devices() if visible_cuda is None else visible_cuda
    devices = trainer.get("devices", "auto")
    nodes = trainer.get("num_nodes", 1)
    strategy = trainer.get("strategy", "auto")
    plain_strategy = OmegaConf.to_container(strategy) if isinstance(strategy, DictConfig) else strategy
    schedulers = accumulation_callbacks(cfg)
    return RunShape(
        accelerator=accelerator,
        on_cuda=_on_cuda(accelerator, lambda: visible),
        visible_cuda=visible,
        cpus=_usable_cpus() if cpus is None else cpus,
        devices=OmegaConf.to_container(devices) if isinstance(devices, ListConfig) else devices,
        devices_per_node=count_devices(devices),
        num_nodes=nodes if isinstance(nodes, int) and not isinstance(nodes, bool) else 1,
        family=strategy_family(strategy),
        strategy=plain_strategy,
        precision=str(trainer.get("precision", "32-true")),
        accumulation_callback=schedulers[0][0] if len(schedulers) == 1 else None,
    )


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
            raise ConfigError(f"`trainer.devices={_show(devices)}` names a device twice; list each index once, e.g. "
                              "`trainer.devices=[0,1]`.")  # fmt: skip
    raise ConfigError(
        f"`trainer.devices={_show(devices)}` is not a device count or list of device indices; use a count "
        "(`trainer.devices=2`), indices (`trainer.devices=[0,1]`), -1 for all devices, or `auto`."
    )


def _check_val_check_interval(value: Any) -> None:
    """Lightning's `val_check_interval`: a fraction of the epoch in (0, 1], or a number of batches >= 1."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"`trainer.val_check_interval={_show(value)}` must be a fraction of the epoch (0 < x <= 1.0) "
                          "or a number of batches (an integer >= 1).")  # fmt: skip
    if (isinstance(value, int) and value < 1) or (isinstance(value, float) and not 0.0 < value <= 1.0):
        raise ConfigError(
            f"`trainer.val_check_interval={value}` validates never or always; use a fraction of the "
            "epoch (0 < x <= 1.0, e.g. 0.25) or a number of batches (an integer >= 1, e.g. 200)."
        )


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
        raise ConfigError(f"`data.val_fraction` + `data.test_fraction` = {total:g} leaves no training data; keep "
                          "their sum below 1, e.g. 0.05 each.")  # fmt: skip


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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 or (
            isinstance(value, float) and value > 1.0):  # fmt: skip
        raise ConfigError(f"`{setting}={_show(value)}` must be a fraction within [0, 1] or a number of batches >= 0.")
    if value == 0 and fit and setting.endswith("train_batches"):
        raise ConfigError(f"`{setting}={_show(value)}` trains on no batch at all; use a count >= 1 or a fraction "
                          "above 0 (or `fit=false` to skip training).")  # fmt: skip


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
        if len(values) != 2 or any(isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 <= b < 1.0
                                   for b in values):  # fmt: skip
            raise ConfigError(f"`model.optimizer.betas={_show(betas)}` must be two numbers within [0, 1), e.g. "
                              "[0.9, 0.95].")  # fmt: skip


def _check_int(setting: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"`{setting}={_show(value)}` must be an integer >= {minimum}.")


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

        micro_batches_for(global_batch, micro, ranks)


def runs_on_cuda(cfg: DictConfig, *, visible_cuda: int | None = None) -> bool:
    """Whether the composed run's accelerator is CUDA (`gpu`/`cuda`, or `auto` with a CUDA device visible); counts
    the CUDA devices only for `auto`."""
    return _on_cuda(
        str(cfg.trainer.get("accelerator", "auto")),
        lambda: _visible_cuda_devices() if visible_cuda is None else visible_cuda,
    )


def _on_cuda(accelerator: str, visible: Any) -> bool:
    """`gpu`/`cuda`, or `auto` with a CUDA device visible (`visible()` counts them)."""
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and visible() > 0)


_COMPRESSION_HOOKS = {
    "bf16": "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook",
    "fp16": "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook",
}


def apply_ddp_grad_compression(cfg: DictConfig, *, visible_cuda: int | None = None) -> str | None:
    """Turn `ddp_grad_compression` (none, bf16, fp16; set by `strategy=ddp`) into DDPStrategy's `ddp_comm_hook`.

    On CUDA the gradients are all-reduced in the compressed dtype (half the bytes on the wire); on the CPU the hook
    is not applied, and a rank-zero warning says so (Lightning itself would drop it without a word).

    Returns:
        What was done, for the log; None when compression is off.

    Raises:
        ConfigError: for an unknown value, or compression with a strategy other than DDP.
    """
    from omegaconf import open_dict

    choice = cfg.get("ddp_grad_compression")
    if choice in (None, "none"):
        return None
    if choice not in _COMPRESSION_HOOKS:
        raise ConfigError(f"`ddp_grad_compression={_show(choice)}` is not supported; use `none`, `bf16` or `fp16`.")
    strategy = cfg.trainer.get("strategy", "auto")
    if not isinstance(strategy, (DictConfig, Mapping)) or strategy_family(strategy) != "ddp":
        raise ConfigError(
            f"`ddp_grad_compression={choice}` needs `strategy=ddp`, not `trainer.strategy={_show(strategy)}`; "
            "pick `strategy=ddp` or set `ddp_grad_compression=none`."
        )
    if not runs_on_cuda(cfg, visible_cuda=visible_cuda):
        from lightning.pytorch.utilities import rank_zero_warn

        from lightning_accel.errors import LightningAccelWarning

        rank_zero_warn(
            f"`ddp_grad_compression={choice}` is not applied on the CPU: DDP communication hooks run on CUDA only, "
            "so gradients are all-reduced in fp32 here (set `ddp_grad_compression=none` to silence this).",
            category=LightningAccelWarning,
        )
        return f"ddp_grad_compression={choice} not applied (CPU)"
    with open_dict(cfg):
        cfg.trainer.strategy.ddp_comm_hook = {"_target_": "hydra.utils.get_method", "path": _COMPRESSION_HOOKS[choice]}
    return f"ddp_grad_compression={choice}: DDP all-reduces gradients in {choice} ({_COMPRESSION_HOOKS[choice]})"


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
    target = str(strategy.get("_target_", "")) if isinstance(strategy, (DictConfig, Mapping)) else ""
    if target.rsplit(".", 1)[-1] == "PipelineStrategy" and target.startswith("lightning_accel."):  # ours, not yours
        from lightning_accel.strategies.pipeline import check_pipeline_settings

        values = OmegaConf.to_container(strategy, resolve=True) if isinstance(strategy, DictConfig) else strategy
        try:
            check_pipeline_settings(values, precision=precision, world=shape.world_size)  # type: ignore[arg-type]
        except ConfigError as err:  # the library names its arguments; the user wrote them under these paths
            raise err.at("trainer" if err.setting == "precision" else "trainer.strategy") from None
    _check_micro_batch(cfg, name)
    _check_compile(cfg, name, on_cuda)
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


def _check_micro_batch(cfg: DictConfig, family: str) -> None:
    """MicroBatchFinder runs on one device or DDP: the other strategies split their own work."""
    for name, node in (cfg.get("callbacks") or {}).items():
        target = str(node.get("_target_", "")) if isinstance(node, (DictConfig, Mapping)) else ""
        if target.rsplit(".", 1)[-1] != "MicroBatchFinder" or family not in ("fsdp", "model_parallel", "pipeline",
                                                                             "deepspeed"):  # fmt: skip
            continue
        raise ConfigError(
            f"`callbacks.{name}` (MicroBatchFinder, `micro_batch=auto`) runs on one device or under DDP, not with "
            f"`strategy={family}`, which splits its own work and reduces gradients inside the backward; use "
            "`micro_batch=none` with it (and set the batch size by hand), or `strategy=ddp`.",
            setting=f"callbacks.{name}",
        )


def _check_compile(cfg: DictConfig, family: str, on_cuda: bool) -> None:
    """The Compile callback: a strategy it can compile under, and the compiler inductor builds kernels with."""
    for name, node in (cfg.get("callbacks") or {}).items():
        target = str(node.get("_target_", "")) if isinstance(node, (DictConfig, Mapping)) else ""
        if target.rsplit(".", 1)[-1] != "Compile" or not target.startswith("lightning_accel."):
            continue
        if family in ("pipeline", "deepspeed", "fsdp"):
            fix = "strategy=model_parallel (FSDP2, compiled per block)" if family == "fsdp" else "strategy=ddp"
            raise ConfigError(
                f"`callbacks.{name}` (Compile, `compile=...`) cannot compile the model under `strategy={family}`; use "
                f"`compile=none` with it, or {fix}.",
                setting=f"callbacks.{name}",
            )
        if family == "model_parallel" and not OmegaConf.select(cfg, "callbacks.parallelize.block_classes"):
            raise ConfigError(
                f"`callbacks.{name}` (Compile) under `strategy=model_parallel` compiles each block through "
                "`callbacks.parallelize`, which names no `block_classes`; set the model config's "
                "`parallel_plan.block_classes`, or use `compile=none`.",
                setting=f"callbacks.{name}",
            )
        from lightning_accel.system.software import compile_problem

        problem = compile_problem(str(node.get("backend", "inductor")), on_cuda=on_cuda)
        if problem:
            raise ConfigError(f"`callbacks.{name}` (Compile): {problem}; or use `compile=none`.",
                              setting=f"callbacks.{name}.backend")  # fmt: skip


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


_IMPLIED_DEFAULTS: dict[str, Any] = {
    "precision": "32-true", "enable_progress_bar": True, "enable_checkpointing": True, "enable_model_summary": True,
    "log_every_n_steps": 50, "limit_train_batches": 1.0, "limit_val_batches": 1.0, "limit_test_batches": 1.0,
    "limit_predict_batches": 1.0, "val_check_interval": 1.0, "num_sanity_val_steps": 2,
}  # fmt: skip


def effective_trainer_settings(cfg: DictConfig) -> dict[str, tuple[Any, Any]]:
    """`{argument: (value, Lightning's default)}` for each Trainer argument the config sets to a non-default value."""
    import inspect

    import lightning.pytorch as pl

    defaults = {
        name: param.default
        for name, param in inspect.signature(pl.Trainer.__init__).parameters.items()
        if param.default is not inspect.Parameter.empty
    }
    settings = OmegaConf.to_container(cfg.trainer, resolve=True)
    assert isinstance(settings, dict)
    settings.pop("_target_", None)
    # What Lightning does with the arguments whose signature default is None.
    implied = {**_IMPLIED_DEFAULTS, "max_epochs": 1000 if settings.get("max_steps", -1) == -1 else -1}
    defaults.update({k: v for k, v in implied.items() if defaults.get(k, None) is None})
    return {
        key: (value, defaults.get(key, "(no default)"))
        for key, value in sorted(settings.items())
        if key not in defaults or value != defaults[key]
    }
