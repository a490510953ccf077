"""What the model's `training_step` returned that Lightning refuses, named after the model and the fix."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_accel.checks._values import _show
from lightning_accel.errors import RunFailedError

__all__ = ["training_step_error"]


def training_step_error(err: BaseException, cfg: DictConfig, trainer: Any) -> RunFailedError | None:
    """Lightning's refusal of what the model's `training_step` returned (a dict without 'loss', a list, a string),
    named: the model, what it returned, and what automatic optimization needs. None for any other error."""
    from lightning_accel import _lightning

    refused = _lightning.training_step_output_refused(err)
    if refused is None:
        return None
    kept, output = refused
    if not kept:
        returned = "a dict without 'loss', or something that is neither a Tensor, a dict nor None"
    elif isinstance(output, Mapping):
        returned = f"a dict with the keys {sorted(map(str, output))} and no 'loss' (or 'loss' set to None)"
    else:
        returned = f"a {type(output).__name__} ({_show(output)[:80]}), which is neither a Tensor, a dict nor None"
    target = OmegaConf.select(cfg, "model._target_", default=None)
    model = f"`model._target_={target}`" if target else "the model"
    return RunFailedError(
        f"{model}: `training_step` returned {returned}, at global step {trainer.global_step}. Lightning's automatic "
        "optimization needs the loss to backpropagate: return the loss tensor, a dict holding it under 'loss' "
        "(`{'loss': loss, ...}`; the other keys reach `on_train_batch_end`), or None to skip the batch."
    )
