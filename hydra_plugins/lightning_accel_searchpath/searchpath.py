"""Appends `pkg://lightning_accel.conf` to every Hydra app's config search path."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import OmegaConf

from lightning_accel.schema import register_schemas

PROVIDER = "lightning_accel"
PATH = "pkg://lightning_accel.conf"


def _lazy(name: str) -> Any:
    """A resolver that imports lightning_accel when a config resolves it, not when Hydra scans its plugins (which
    would import torch in every Hydra app)."""

    def resolve(*args: Any) -> Any:
        from lightning_accel import launch

        return getattr(launch, name)(*args)

    return resolve


# The resolvers this package's configs use (`${accel_precision:amp,...}` in precision=amp, `${accel_run_id:...}` and
# `${accel_job_name:...}` in hydra=default), so that any app using them (lightning-hydra-template's, say) resolves
# them with no call of ours: a Trainer from `precision=amp` gets this machine's precision string.
for _name, _function, _cached in (
    ("accel_precision", "precision_resolver", True),
    ("accel_fused", "fused_resolver", True),
    ("accel_on_cuda", "on_cuda_resolver", True),
    ("accel_run_id", "resolve_run_id", True),
    ("accel_unique", "unique_stamp", True),
    ("accel_job_name", "external_rank_job_name", False),
):
    if not OmegaConf.has_resolver(_name):
        OmegaConf.register_new_resolver(_name, _lazy(_function), use_cache=_cached)

# The types of this package's group options (`- /accel_schema/...` in their defaults lists): registered here too, so
# an app finds them whichever way it reached the config tree (the tree's `__init__` registers them as well).
register_schemas()


class LightningAccelSearchPathPlugin(SearchPathPlugin):
    """Appends this package's config tree after the app's own, so the app's same-named configs win.

    Without the plugin (say, when `hydra_plugins` is not importable), an app gets the same with one line in its
    primary config: `hydra: {searchpath: [pkg://lightning_accel.conf]}`.
    """

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        if not any(_is_this_tree(element.path) for element in search_path.get_path()):
            search_path.append(provider=PROVIDER, path=PATH)


def _is_this_tree(path: str) -> bool:
    """Whether a search-path entry is this package's tree: `PATH`, or its directory (accel-train reads the tree by
    its directory, `lightning_accel.train.config_path`)."""
    if path == PATH:
        return True
    directory = path.removeprefix("file://")
    if not os.path.isabs(directory):
        return False
    spec = importlib.util.find_spec("lightning_accel.conf")
    locations = (spec.submodule_search_locations or []) if spec is not None else []
    return any(os.path.realpath(directory) == os.path.realpath(location) for location in locations)
