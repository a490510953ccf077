"""Appends `pkg://lightning_accel.conf` to every Hydra app's config search path."""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

PROVIDER = "lightning_accel"
PATH = "pkg://lightning_accel.conf"


class LightningAccelSearchPathPlugin(SearchPathPlugin):
    """Appends this package's config tree after the app's own, so the app's same-named configs win.

    Without the plugin (say, when `hydra_plugins` is not importable), an app gets the same with one line in its
    primary config: `hydra: {searchpath: [pkg://lightning_accel.conf]}`.
    """

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        if not any(element.path == PATH for element in search_path.get_path()):
            search_path.append(provider=PROVIDER, path=PATH)
