"""What a config's `_target_` names: the class, imported, so that a rule asks the class (a subclass counts), never
matches its name. Below the run's shape and the checks, which both read it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig

__all__ = ["node_class", "target_class"]


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


def node_class(node: Any) -> type | None:
    """The class a config node's `_target_` names (`target_class`); None for a node that is not a mapping."""
    return target_class(node.get("_target_")) if isinstance(node, (DictConfig, Mapping)) else None
