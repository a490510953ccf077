"""The run plan: what accel-train (and accel-bench's planning) decides from a checked config before anything is built
or spawned, computed once and then only read.

The order is compose -> shape (`lightning_accel.shape.run_shape`) -> checks (`lightning_accel.checks.check_run`) ->
plan -> launch, and the caller takes each step: `build_run_plan(cfg, checked)` takes what the checks passed (the
shape, with the precision resolved for this machine) and plans the gradient compression, the NCCL variables and the
thread plan into a frozen `RunPlan`. It never calls the checks and never reads the shape again. The config itself is
never written back: what the plan decides reaches the Trainer as keyword arguments (`RunPlan.trainer_kwargs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_accel.errors import ConfigError

if TYPE_CHECKING:
    from lightning_accel.checks import CheckedRun
    from lightning_accel.precision import ResolvedPrecision
    from lightning_accel.shape import RunShape
    from lightning_accel.strategies.nccl import NcclPlan
    from lightning_accel.system.threads import ThreadPlan

__all__ = [
    "RunPlan",
    "build_run_plan",
    "effective_trainer_settings",
    "plan_grad_compression",
]


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


def build_run_plan(cfg: DictConfig, checked: CheckedRun) -> RunPlan:
    """Decide the run from a config the checks passed (`checks.check_run(cfg, shape)`): gradient compression, the
    NCCL variables for a CUDA run and the thread plan, beside the shape and the precision the checks resolved. Reads
    `cfg`, never writes it; calls no check.

    Example::

        shape = run_shape(cfg)                              # the facts of the run
        plan = build_run_plan(cfg, check_run(cfg, shape))   # checked, then planned

    Raises:
        ConfigError: for a plan that cannot work (compression without DDP, an NCCL preset that does not fit),
            naming the setting; before any Trainer exists or any process is spawned.
    """
    shape, resolved = checked.shape, checked.precision
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
