"""Moved to `lightning_accel.compose` (the helpers for your own Hydra app); importing this module warns."""

from __future__ import annotations

import warnings

from lightning_accel.compose import LOADER_KEYS, apply_loader_settings, instantiate_datamodule, split_data_config

__all__ = ["LOADER_KEYS", "apply_loader_settings", "instantiate_datamodule", "split_data_config"]

warnings.warn("`lightning_accel.data_settings` moved to `lightning_accel.compose`; import from there.",
              DeprecationWarning, stacklevel=2)  # fmt: skip
