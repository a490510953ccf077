"""Hydra search-path plugin: lets any Hydra app select lightning_accel's config groups."""

from hydra_plugins.lightning_accel_searchpath.searchpath import LightningAccelSearchPathPlugin

__all__ = ["LightningAccelSearchPathPlugin"]
