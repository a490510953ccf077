"""The run's shape: the facts of a composed run, read once from its config before anything is checked or planned.

`run_shape(cfg)` is the one place that parses `trainer.devices`, names the strategy family, finds the accumulation
callback and counts the CPUs (through `system/`) and CUDA devices. The checks (`lightning_accel.checks`) read the
shape (and resolve the precision for this machine into it), the plan (`lightning_accel.run_plan`) is built from the
checked shape, and accel-bench's ladder, accel-tune's search space and the run summary read it. Nothing here checks
or plans: this module imports no other composition module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_accel.targets import node_class

__all__ = [
    "DISTRIBUTED_FAMILIES",
    "RunShape",
    "accumulation_callbacks",
    "count_devices",
    "run_shape",
    "runs_on_cuda",
    "strategy_family",
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


def strategy_family(strategy: Any) -> str:
    """The strategy family ("auto", "ddp", "fsdp", "model_parallel", "pipeline", "deepspeed", "single_device", or
    the name of another strategy) of a registry name (`ddp_spawn`) or a `_target_` config (by the class it names:
    a subclass of Lightning's DDPStrategy is "ddp")."""
    if isinstance(strategy, (DictConfig, Mapping)):
        cls = node_class(strategy)
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
        cls = node_class(node)
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
    """`trainer.precision`: as configured; as resolved for this machine in a checked run (`checks.CheckedRun`)."""
    accumulation_callback: str | None
    """The name under `callbacks` of the accumulation callback, if there is (exactly) one."""
    accumulation_callbacks: tuple[str, ...] = ()
    """The names under `callbacks` of every accumulation callback (`accumulation_callbacks`)."""

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
    trainer = cfg.get("trainer")
    if not isinstance(trainer, (DictConfig, Mapping)):
        trainer = {}  # the checks name what is missing: the shape of a config without a trainer is the defaults'
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
        accumulation_callbacks=tuple(name for name, _ in schedulers),
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
