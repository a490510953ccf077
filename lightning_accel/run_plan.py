"""The run plan: everything accel-train (and accel-bench's planning) decides from a composed config before anything
is built or spawned, computed once and then only read.

`run_shape(cfg)` is the one place that parses `trainer.devices`, names the strategy family, finds the accumulation
callback and counts the CPUs (through `system/`) and CUDA devices. `build_run_plan(cfg)` checks the config
(`checks.check_config`), resolves the precision for this machine, checks the combinations again with it, and plans
the gradient compression and the NCCL variables, into a frozen `RunPlan`. The config itself is never written back:
what the plan decides reaches the Trainer as keyword arguments (`RunPlan.trainer_kwargs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_accel.errors import ConfigError

if TYPE_CHECKING:
    from lightning_accel.precision import ResolvedPrecision
    from lightning_accel.strategies.nccl import NcclPlan
    from lightning_accel.system.threads import ThreadPlan

__all__ = [
    "DISTRIBUTED_FAMILIES",
    "RunPlan",
    "RunShape",
    "accumulation_callbacks",
    "build_run_plan",
    "count_devices",
    "effective_trainer_settings",
    "plan_grad_compression",
    "resolve_config_precision",
    "run_shape",
    "runs_on_cuda",
    "strategy_family",
    "target_class",
]


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


DISTRIBUTED_FAMILIES = ("ddp", "fsdp", "model_parallel", "deepspeed", "pipeline")


def target_class(target: Any) -> type | None:
    """The class a `_target_` names, imported; None for an empty target or one that cannot be imported here (a
    user's class whose module is not importable yet), so no rule applies to it."""
    if not isinstance(target, str) or not target:
        return None
    from hydra.utils import get_class

    try:
        return get_class(target)
    except Exception:  # an unimportable target: nothing of ours to check
        return None


def _node_class(node: Any) -> type | None:
    return target_class(node.get("_target_")) if isinstance(node, (DictConfig, Mapping)) else None


def strategy_family(strategy: Any) -> str:
    """The strategy family ("auto", "ddp", "fsdp", "model_parallel", "pipeline", "deepspeed", "single_device", or
    the name of another strategy) of a registry name (`ddp_spawn`) or a `_target_` config (by the class it names:
    a subclass of Lightning's DDPStrategy is "ddp")."""
    if isinstance(strategy, (DictConfig, Mapping)):
        cls = _node_class(strategy)
        if cls is None:
            return str(strategy.get("_target_", "")).rsplit(".", 1)[-1]
        from lightning.pytorch import strategies as pl_strategies

        from lightning_accel.strategies.pipeline import PipelineStrategy

        families = (
            (PipelineStrategy, "pipeline"),
            (pl_strategies.DeepSpeedStrategy, "deepspeed"),
            (pl_strategies.FSDPStrategy, "fsdp"),
            (pl_strategies.ModelParallelStrategy, "model_parallel"),
            (pl_strategies.DDPStrategy, "ddp"),
            (pl_strategies.SingleDeviceStrategy, "single_device"),
        )
        return next((family for base, family in families if issubclass(cls, base)), cls.__name__)
    name = str(strategy)
    for family in ("fsdp", "deepspeed", "ddp"):
        if name.startswith(family):
            return family
    return name


def accumulation_callbacks(cfg: DictConfig) -> list[tuple[str, DictConfig]]:
    """`(name, node)` of each callback in `cfg.callbacks` that sets `accumulate_grad_batches` per window: this
    package's `AccumulationScheduler` or Lightning's `GradientAccumulationScheduler` (or a subclass)."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    from lightning_accel.callbacks.accumulation import AccumulationScheduler

    found = []
    for name, node in (cfg.get("callbacks") or {}).items():
        cls = _node_class(node)
        if cls is not None and issubclass(cls, (AccumulationScheduler, GradientAccumulationScheduler)):
            found.append((str(name), node))
    return found


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
    """`trainer.precision`: as resolved for this machine in a `RunPlan`, else as configured."""
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


def run_shape(
    cfg: DictConfig, *, visible_cuda: int | None = None, cpus: int | None = None, precision: str | None = None
) -> RunShape:
    """The `RunShape` of a composed config (one with a `trainer` section).

    Args:
        cfg: the composed config.
        visible_cuda: CUDA devices visible; None counts them (without creating a CUDA context).
        cpus: CPUs this process may use; None reads them through `system/` (affinity and cgroup quota).
        precision: the precision resolved for this machine (`amp` and `fp8` resolve per machine); None takes
            `trainer.precision` as configured.
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
        precision=precision or str(trainer.get("precision", "32-true")),
        accumulation_callback=schedulers[0][0] if len(schedulers) == 1 else None,
    )


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


_IMPLIED_DEFAULTS: dict[str, Any] = {
    "precision": "32-true",
    "enable_progress_bar": True,
    "enable_checkpointing": True,
    "enable_model_summary": True,
    "log_every_n_steps": 50,
    "limit_train_batches": 1.0,
    "limit_val_batches": 1.0,
    "limit_test_batches": 1.0,
    "limit_predict_batches": 1.0,
    "val_check_interval": 1.0,
    "num_sanity_val_steps": 2,
}


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


def plan_grad_compression(cfg: DictConfig, shape: RunShape) -> tuple[str | None, str | None]:
    """What `ddp_grad_compression` (none, bf16, fp16; set by `strategy=ddp`) asks of DDPStrategy: (the
    `ddp_comm_hook` import path to use, or None; the line to log, or None when compression is off).

    On CUDA the gradients are all-reduced in the compressed dtype (half the bytes on the wire); on the CPU the hook
    is not applied, and a rank-zero warning says so (Lightning itself would drop it without a word).

    Raises:
        ConfigError: for an unknown value, or compression with a strategy other than DDP.
    """
    choice = cfg.get("ddp_grad_compression")
    if choice in (None, "none"):
        return None, None
    if choice not in _COMPRESSION_HOOKS:
        shown = OmegaConf.to_container(choice) if isinstance(choice, (DictConfig, ListConfig)) else choice
        raise ConfigError(f"`ddp_grad_compression={shown!r}` is not supported; use `none`, `bf16` or `fp16`.")
    strategy = cfg.trainer.get("strategy", "auto")
    if not isinstance(strategy, (DictConfig, Mapping)) or shape.family != "ddp":
        shown = OmegaConf.to_container(strategy) if isinstance(strategy, DictConfig) else strategy
        raise ConfigError(
            f"`ddp_grad_compression={choice}` needs `strategy=ddp`, not `trainer.strategy={shown!r}`; "
            "pick `strategy=ddp` or set `ddp_grad_compression=none`."
        )
    if not shape.on_cuda:
        from lightning.pytorch.utilities import rank_zero_warn

        from lightning_accel.errors import LightningAccelWarning

        rank_zero_warn(
            f"`ddp_grad_compression={choice}` is not applied on the CPU: DDP communication hooks run on CUDA only, "
            "so gradients are all-reduced in fp32 here (set `ddp_grad_compression=none` to silence this).",
            category=LightningAccelWarning,
        )
        return None, f"ddp_grad_compression={choice} not applied (CPU)"
    hook = _COMPRESSION_HOOKS[choice]
    return hook, f"ddp_grad_compression={choice}: DDP all-reduces gradients in {choice} ({hook})"


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """What a composed run will be, decided once before anything is built or spawned, and never written back into
    the config: `train._run`, accel-bench's stage planning and accel-tune's search space read it."""

    shape: RunShape
    """The run's facts, with the precision resolved for this machine."""
    precision: ResolvedPrecision
    """`trainer.precision` resolved for this machine (`amp`, `fp8`), with the reason and any callbacks it needs."""
    float32_matmul_precision: str | None
    """`torch.set_float32_matmul_precision` for the run (the precision group's choice); None leaves it alone."""
    comm_hook: str | None = None
    """The DDP communication hook's import path (`ddp_grad_compression` on CUDA), or None."""
    notes: tuple[str, ...] = ()
    """Lines for the log: the precision's reason, the compression applied or not."""
    nccl: NcclPlan | None = None
    """The NCCL variables for a CUDA run (set by the caller, who can remove them again), or None."""
    threads: ThreadPlan | None = None
    """Threads per rank, the OpenMP wait policy and their variables (`threads=auto`); None for `threads=torch`."""

    def trainer_kwargs(self, cfg: DictConfig) -> dict[str, Any]:
        """Keyword arguments for `instantiate(cfg.trainer, **kwargs)` that carry the plan's decisions instead of
        edits to the config: the resolved precision, and the strategy with its communication hook."""
        kwargs: dict[str, Any] = {"precision": self.precision.value}
        if self.comm_hook is not None:
            from hydra.utils import get_method, instantiate

            kwargs["strategy"] = instantiate(cfg.trainer.strategy, ddp_comm_hook=get_method(self.comm_hook))
        return kwargs


def resolve_config_precision(cfg: DictConfig) -> ResolvedPrecision:
    """`trainer.precision` of a composed config resolved for this machine (`lightning_accel.precision`), with the
    reason: `amp` and `fp8` as asked, whether the config wrote them directly or through `${accel_precision:...}`.

    Raises:
        ConfigError: when the precision cannot run here, naming `trainer.precision` and the fix.
    """
    import re

    from lightning_accel.precision import resolve_precision

    accelerator = cfg.trainer.get("accelerator", "auto")
    written = cast("dict[str, Any]", OmegaConf.to_container(cfg.trainer, resolve=False))  # the trainer group: a mapping
    raw = written.get("precision", "32-true")
    requested = re.match(r"\$\{accel_precision:([^,}]+)", str(raw))  # conf/precision/amp.yaml: resolved already
    try:
        return resolve_precision(
            requested.group(1) if requested else cfg.trainer.get("precision", "32-true"),
            accelerator if isinstance(accelerator, str) else "auto",
            setting="trainer.precision",
        )
    except ConfigError as err:  # `accelerator=...` is the Trainer's
        raise err.at("trainer") from None


def build_run_plan(cfg: DictConfig, *, visible_cuda: int | None = None) -> RunPlan:
    """Check the composed config and decide the run: the checks before launch (`checks.check_config`), the
    precision resolved for this machine, the combinations checked again with it, gradient compression, and the
    NCCL variables for a CUDA run. Reads `cfg`, never writes it.

    Raises:
        ConfigError: for a setting that cannot work, naming it; before any Trainer exists or any process is spawned.
    """
    from lightning_accel.checks import check_combinations, check_config

    check_config(cfg, visible_cuda=visible_cuda)
    resolved = resolve_config_precision(cfg)
    shape = run_shape(cfg, visible_cuda=visible_cuda, precision=resolved.value)
    check_combinations(cfg, shape=shape)  # again, now with the precision resolved for this machine
    hook, note = plan_grad_compression(cfg, shape)
    nccl, notes = None, [resolved.describe(), *([note] if note else [])]
    section = cfg.get("nccl")
    if section and section.get("preset", "none") != "none":
        if not shape.on_cuda:
            notes.append(f"nccl={section.preset}: not applied, this run is on the CPU (gloo)")
        else:
            from hydra.core.hydra_config import HydraConfig

            from lightning_accel.strategies.nccl import nccl_plan

            trace_dir = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None
            try:
                nccl = nccl_plan(
                    str(section.preset),
                    socket_ifname=section.get("socket_ifname"),
                    num_nodes=shape.num_nodes,
                    trace_dir=trace_dir,
                )
            except ConfigError as err:  # `preset=...` is `nccl.preset` in the config
                raise err.at("nccl") from None
            notes.append(nccl.describe())
    from lightning_accel.thread_env import describe_plan, thread_plan_for

    threads = thread_plan_for(cfg, shape)
    if threads is None:
        notes.append(describe_plan(None))
    return RunPlan(
        shape=shape,
        precision=resolved,
        float32_matmul_precision=cfg.get("float32_matmul_precision"),
        comm_hook=hook,
        notes=tuple(notes),
        nccl=nccl,
        threads=threads,
    )
