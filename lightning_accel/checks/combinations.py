"""Settings that are each valid but fail together (or that Lightning would silently ignore), read from the run's
shape: the accelerator against the CUDA devices, the strategy against the accelerator, the precision against both,
the pipeline's schedule, and each callback's own `check_run` rule."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_accel.checks._values import _CPU_OVERSUBSCRIPTION, _show
from lightning_accel.errors import ConfigError
from lightning_accel.precision import MODEL_PARALLEL_REFUSED
from lightning_accel.shape import RunShape, run_shape
from lightning_accel.targets import target_class

__all__ = ["check_combinations"]


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
        _check_devices_visible(devices, shape.devices_per_node, visible)
    else:
        _check_cpu_processes(devices, shape.devices_per_node, shape.cpus)
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


def _check_cpu_processes(devices: Any, count: int | None, cpus: int) -> None:
    """On the CPU, `trainer.devices` is a number of processes: Lightning starts any number, each with its own copy
    of the model; far more than the CPUs only thrashes (and 1000 exhausts memory or process limits)."""
    if count is None or count <= 1:
        return
    if count > _CPU_OVERSUBSCRIPTION * cpus:
        raise ConfigError(
            f"`trainer.devices={_show(devices)}` starts {count} CPU processes, but this process may use "
            f"{cpus} CPU(s) (affinity and cgroup quota); use at most `trainer.devices={_CPU_OVERSUBSCRIPTION * cpus}` "
            f"(better {cpus}), or run on GPUs."
        )


def _check_devices_visible(devices: Any, count: int | None, visible: int) -> None:
    if isinstance(devices, (ListConfig, list)) or (isinstance(devices, str) and "," in devices):
        indices = devices if not isinstance(devices, str) else [int(d) for d in devices.split(",") if d.strip()]
        missing = [d for d in indices if isinstance(d, int) and d >= visible]
        if missing:
            raise ConfigError(
                f"`trainer.devices={_show(devices)}` names device(s) {missing}, but only indices 0..{visible - 1} "
                f"are visible; use indices below {visible}, or check CUDA_VISIBLE_DEVICES."
            )
        return
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
