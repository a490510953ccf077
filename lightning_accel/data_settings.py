"""DataLoader settings a preset gives `data.*` that the user's datamodule does not take: applied to its loaders."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

from lightning_accel.errors import ConfigError

__all__ = ["LOADER_KEYS", "instantiate_datamodule", "split_data_config"]

log = logging.getLogger(__name__)

LOADER_KEYS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")
"""DataLoader arguments the presets set under `data.` (and that can be applied to a built DataLoader)."""

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
    from hydra.utils import instantiate
    from omegaconf import DictConfig, OmegaConf

    plain = OmegaConf.to_container(data, resolve=True) if isinstance(data, DictConfig) else dict(data)
    assert isinstance(plain, dict)
    taken, loader = split_data_config(plain)
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
    from lightning_accel.tuning.dataloader.timing import LoaderSettings, loader_settings, rebuild_loader

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
            rank_zero_warn(f"`data.{next(iter(settings))}` & co not applied to a {type(loader).__name__}: {err}",
                           category=LightningAccelWarning)  # fmt: skip
            return loader

    for name in _LOADER_METHODS:
        method = getattr(datamodule, name, None)
        if callable(method):

            def wrapped(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
                return rebuilt(_method(*args, **kwargs))

            setattr(datamodule, name, wrapped)
