"""Helpers for Hydra apps that build a Lightning run from this package's config groups: accel-train uses them, and
so can your own app (lightning-hydra-template's `train.py`). No `@hydra.main` here, and importing this module has no
side effects.

- `check_app_config(cfg)`: this package's checks on a composed config, and a warning for each group option whose
  callback the config dropped;
- `apply_precision(cfg)`: resolve `amp`/`fp8` for this machine and apply `float32_matmul_precision`;
  `precision_callbacks(resolved)`: the callbacks that choice needs in the Trainer;
- `instantiate_callbacks(cfg)`, `instantiate_named(section)`: callbacks and loggers keyed by name;
- `instantiate_datamodule(cfg.data)`: a preset's DataLoader settings the datamodule does not take go to its loaders;
- `apply_nccl(cfg, undo)`: a preset's NCCL variables for a CUDA run, removed again when `undo` closes;
- `hydra_safe_launch(trainer)`: DDP's child ranks start inside the Hydra job (Lightning issue #11300);
- `config_paths(cfg)`: a library error naming a constructor argument (`tensor_parallel_size=0`) is re-raised naming
  the config path the value came from (`trainer.strategy.tensor_parallel_size=0`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, cast

from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_accel.app_config import check_app_config
from lightning_accel.errors import ConfigError, ConfigTypeError, named_argument
from lightning_accel.launch import hydra_safe_launch
from lightning_accel.shape import runs_on_cuda
from lightning_accel.tuning.dataloader.loader_settings import LOADER_KEYS

if TYPE_CHECKING:
    from lightning.pytorch import Callback

    from lightning_accel.precision import ResolvedPrecision
    from lightning_accel.strategies.nccl import NcclPlan

__all__ = [
    "apply_loader_settings",
    "apply_nccl",
    "apply_precision",
    "check_app_config",
    "config_paths",
    "hydra_safe_launch",
    "instantiate_callbacks",
    "instantiate_datamodule",
    "instantiate_named",
    "precision_callbacks",
    "split_data_config",
]

log = logging.getLogger(__name__)

_LOADER_METHODS = ("train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader")


def split_data_config(data: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`data`'s settings the `_target_` takes, and the DataLoader settings it does not (applied to its loaders).

    Raises:
        ConfigError: for any other setting the `_target_` does not take (named, with its arguments), before anything
            is built.
    """
    from hydra.utils import get_method

    target = str(data.get("_target_", ""))
    try:
        signature = inspect.signature(get_method(target))
    except (ValueError, TypeError):  # a callable without a readable signature: pass everything through
        return dict(data), {}
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(data), {}
    taken, loader = {}, {}
    for key, value in data.items():
        if key.startswith("_") or key in params:
            taken[key] = value
        elif key in LOADER_KEYS:
            loader[key] = value
        else:
            accepted = ", ".join(n for n in params if n != "self")
            raise ConfigError(
                f"`data.{key}={value!r}` is not an argument of {target} (it takes: {accepted}); remove it "
                f"(`~data.{key}`) or add `{key}` to the datamodule's `__init__`."
            )
    return taken, loader


def instantiate_datamodule(data: Any) -> Any:
    """`hydra.utils.instantiate(data)`, where DataLoader settings the datamodule does not take (a preset's
    `data.num_workers`, `data.persistent_workers`, ... on lightning-hydra-template's MNISTDataModule, say) are left
    out of its constructor and applied to every DataLoader its `*_dataloader()` methods return instead.

    Raises:
        ConfigError: for another setting the datamodule does not take.
    """
    plain = OmegaConf.to_container(data, resolve=True) if isinstance(data, DictConfig) else dict(data)
    assert isinstance(plain, dict)
    taken, loader = split_data_config(cast("dict[str, Any]", plain))  # a config group's keys are strings
    datamodule = instantiate(taken)
    if loader:
        log.info("%s takes no %s: applied to the DataLoaders it returns", taken.get("_target_"), ", ".join(loader))
        apply_loader_settings(datamodule, loader)
    return datamodule


def apply_loader_settings(datamodule: Any, settings: Mapping[str, Any]) -> None:
    """Wrap the datamodule's `*_dataloader()` methods so each DataLoader they return is rebuilt with `settings`
    (same dataset, sampler, batching and collation); a loader that cannot be rebuilt (a subclass, an
    IterableDataset) is returned as it is, with a warning."""
    from lightning.pytorch.utilities import rank_zero_warn
    from torch.utils.data import DataLoader

    from lightning_accel.errors import LightningAccelWarning
    from lightning_accel.tuning.dataloader.loader_settings import LoaderSettings
    from lightning_accel.tuning.dataloader.timing import loader_settings, rebuild_loader

    def rebuilt(loader: Any) -> Any:
        if isinstance(loader, (list, tuple)):
            return type(loader)(rebuilt(one) for one in loader)
        if isinstance(loader, dict):
            return {name: rebuilt(one) for name, one in loader.items()}
        if not isinstance(loader, DataLoader):
            return loader
        current = loader_settings(loader).as_dict()
        wanted = LoaderSettings(**{**current, **settings})
        if wanted.num_workers == 0:
            wanted = LoaderSettings(num_workers=0, pin_memory=wanted.pin_memory)
        try:
            return rebuild_loader(loader, wanted)
        except TypeError as err:
            rank_zero_warn(
                f"`data.{next(iter(settings))}` & co not applied to a {type(loader).__name__}: {err}",
                category=LightningAccelWarning,
            )
            return loader

    for name in _LOADER_METHODS:
        method = getattr(datamodule, name, None)
        if callable(method):

            def wrapped(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
                return rebuilt(_method(*args, **kwargs))

            setattr(datamodule, name, wrapped)


def instantiate_named(section: DictConfig | None) -> list[Any]:
    """Instantiate a dict of `_target_` configs keyed by name (callbacks, loggers); null entries are skipped."""
    if not section:
        return []
    return [instantiate(node) for _, node in sorted(section.items()) if node is not None]


def apply_precision(cfg: DictConfig) -> ResolvedPrecision:
    """Resolve `trainer.precision` for this machine, write it back into `cfg` and apply `float32_matmul_precision`.

    `amp` and `fp8` become a Lightning precision string (see `lightning_accel.precision.resolve_precision`), and
    the choice is logged with its reason. A Hydra app of your own that selects `precision=amp` or `precision=fp8`
    (or `preset=amp`) calls this before it instantiates `cfg.trainer`, and adds `precision_callbacks(resolved)` to
    the Trainer's callbacks.

    Raises:
        ConfigError: when the precision cannot run here (fp8 without a capable GPU or package, bf16 on a GPU without
            bf16, ...) or `float32_matmul_precision` is not `highest`, `high`, `medium` or null.
    """
    import torch

    from lightning_accel.checks import resolve_config_precision
    from lightning_accel.precision import apply_float32_matmul_precision

    resolved = resolve_config_precision(cfg)
    apply_float32_matmul_precision(cfg.get("float32_matmul_precision"))
    with open_dict(cfg):
        cfg.trainer.precision = resolved.value
    log.info("%s; float32_matmul_precision=%s", resolved.describe(), torch.get_float32_matmul_precision())
    return resolved


def precision_callbacks(resolved: ResolvedPrecision) -> list[Callback]:
    """The callbacks a resolved precision needs in the Trainer: `Float8Training` for fp8 through torchao, else none."""
    if not resolved.float8_training:
        return []
    from lightning_accel.callbacks.float8 import Float8Training

    return [Float8Training()]


def apply_nccl(cfg: DictConfig, undo: ExitStack | None = None) -> NcclPlan | None:
    """Set the NCCL variables of `cfg.nccl.preset` for a CUDA run (the launched ranks inherit them) and log them;
    with `undo`, the stack removes them again when it closes (accel-train closes it at the end of each job).

    Raises:
        ConfigError: for an unknown preset, or `nccl=ib` without an ACTIVE InfiniBand/RoCE port.
    """
    from lightning_accel.strategies.nccl import nccl_plan

    section = cfg.get("nccl")
    if not section or section.get("preset", "none") == "none":
        return None
    if not runs_on_cuda(cfg):
        log.info("nccl=%s: not applied, this run is on the CPU (gloo)", section.preset)
        return None
    trace_dir = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None
    try:
        plan = nccl_plan(
            section.preset,
            socket_ifname=section.get("socket_ifname"),
            num_nodes=int(cfg.trainer.get("num_nodes", 1)),
            trace_dir=trace_dir,
        )
    except ConfigError as err:  # `preset=...` is `nccl.preset` in the config
        raise err.at("nccl") from None
    removal = plan.apply()
    if undo is not None:
        undo.callback(removal)
    log.info(plan.describe())
    return plan


def instantiate_callbacks(cfg: DictConfig) -> list[Any]:
    """The run's callbacks, sorted by name; a callback whose constructor rejects its arguments is a ConfigError
    naming `callbacks.<name>`.

    Raises:
        ConfigError: with the callback's own message (the value and the fix).
    """
    built = []
    for name, node in sorted((cfg.get("callbacks") or {}).items()):
        if node is None:
            continue
        try:
            built.append(instantiate(node))
        except Exception as err:
            cause = err.__cause__ or err  # Hydra wraps the constructor's error in an InstantiationException
            target = node.get("_target_", "?") if isinstance(node, DictConfig) else "?"
            kind = ConfigTypeError if isinstance(cause, TypeError) else ConfigError  # keep the builtin it deserves
            raise kind(f"`callbacks.{name}` ({target}) cannot be built: {_at_path(cause, node, name)}") from None
    return built


def _at_path(err: BaseException, node: Any, name: str) -> str:
    """A constructor's message with the argument it is about named by its config path (`interval_s=nan` ->
    `callbacks.gpu_monitor.interval_s=nan`), where it names one the node sets."""
    named = named_argument(err, node) if isinstance(err, ConfigError) and isinstance(node, DictConfig) else None
    if named is None or named.setting is None:
        return str(err)
    moved = named.at(f"callbacks.{name}")
    return str(moved) if moved is not named else f"`callbacks.{name}.{named.setting}`: {err}"


# Config sections whose values reach a constructor as keyword arguments, most specific first.
_ARGUMENT_SECTIONS = ("trainer.strategy", "scheduler", "trainer")


@contextmanager
def config_paths(cfg: DictConfig) -> Iterator[None]:
    """Re-raise a `ConfigError` that names a constructor argument (`err.setting`, e.g. `n_stages`) with the config
    path the value came from (`trainer.strategy.n_stages`), when that section of `cfg` sets it; Hydra's
    `InstantiationException` around such an error is unwrapped. Other errors pass through unchanged."""
    try:
        yield
    except Exception as err:
        cause = err.__cause__ if isinstance(err, InstantiationException) else err
        if not isinstance(cause, ConfigError) or not cause.setting:
            raise
        for path in _ARGUMENT_SECTIONS:
            section = OmegaConf.select(cfg, path, default=None)
            if isinstance(section, DictConfig) and cause.setting in section:
                raise cause.at(path) from None
        if cause is err:
            raise
        raise cause from None
