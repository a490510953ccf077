"""Trains the `nn.Linear` layers in float8 with torchao: `precision=fp8` without Transformer Engine."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_accel.errors import ConfigTypeError

__all__ = ["Float8Training", "float8_linear_filter"]

_CONVERTED = "_lightning_accel_float8"  # marks a module already converted, so a second fit does not convert again
_FP8_MULTIPLE = 16  # float8 matmuls (torch._scaled_mm) need both matrix dimensions divisible by 16


def float8_linear_filter(module: nn.Module, fqn: str, skip_modules: Sequence[str] = ()) -> bool:
    """Whether torchao should convert `module`: an `nn.Linear` with in and out features divisible by 16.

    Args:
        module: the module torchao offers for conversion.
        fqn: its fully qualified name in the LightningModule (`blocks.0.attn.q_proj`).
        skip_modules: substrings of names to leave in high precision (`lm_head`, `blocks.0.`).
    """
    if not isinstance(module, nn.Linear):
        return False
    if module.in_features % _FP8_MULTIPLE or module.out_features % _FP8_MULTIPLE:
        return False
    return not any(part in fqn for part in skip_modules)


class Float8Training(Callback):
    """Swaps the LightningModule's `nn.Linear` layers for torchao's `Float8Linear` before training starts.

    In `setup` it calls `torchao.float8.convert_to_float8_training` on the LightningModule, so the matmuls of the
    forward and backward passes run in float8 with dynamic scaling, while weights, gradients and optimizer state stay
    in their usual dtype. Layers whose in or out features are not multiples of 16 are kept (float8 matmuls need that),
    as are layers whose names contain one of `skip_modules`. The conversion runs before the optimizer is built and at
    most once per module, so a second `fit` changes nothing; layers made later, in `configure_model`, are not seen.
    Use it with `precision="bf16-mixed"` on a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper);
    `accel-train precision=fp8` adds it when torchao is the fp8 package installed. `torch.compile` makes float8
    fast; without it the casts can cost more than they save.

    Keeps identical: the weights, gradients and optimizer state's dtypes, and every layer it skips.
    Changes on purpose: the matmuls of the converted `nn.Linear` layers run in float8 with dynamic scaling (a quality
        change that accel-bench's quality check measures).
    Cannot serve: a machine without torchao (refused at setup by name: the zoo on a CPU), or without a CUDA GPU of
        compute capability 8.9 or newer.

    Logs:
        nothing.

    Args:
        skip_modules: substrings of module names to keep in high precision, e.g. `["lm_head"]` for the output layer.
        recipe: a torchao recipe name for `Float8LinearConfig.from_recipe_name` (`tensorwise`, `rowwise`,
            `rowwise_with_gw_hp`); None takes torchao's default (tensorwise scaling).

    Raises:
        ModuleNotFoundError: in `setup`, when torchao is not installed.

    Example::

        trainer = Trainer(precision="bf16-mixed", callbacks=[Float8Training(skip_modules=["lm_head"])])
    """

    def __init__(self, skip_modules: Sequence[str] = (), recipe: str | None = None) -> None:
        if isinstance(skip_modules, str):
            raise ConfigTypeError(
                f"`skip_modules={skip_modules!r}` must be a list of name substrings, not one string; "
                f"use `skip_modules=[{skip_modules!r}]`."
            )
        self.skip_modules = tuple(str(part) for part in skip_modules)
        self.recipe = recipe
        self.converted: list[str] = []
        """Names of the layers converted by the last `setup` that converted anything."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if getattr(pl_module, _CONVERTED, False):
            return
        convert, config = _torchao_float8(self.recipe)
        keep = functools.partial(float8_linear_filter, skip_modules=self.skip_modules)
        self.converted = [name for name, module in pl_module.named_modules() if keep(module, name)]
        kept = sum(isinstance(module, nn.Linear) for module in pl_module.modules()) - len(self.converted)
        kwargs: dict[str, Any] = {"module_filter_fn": keep}
        if config is not None:
            kwargs["config"] = config
        convert(pl_module, **kwargs)
        setattr(pl_module, _CONVERTED, True)
        rank_zero_info(
            f"Float8Training: {len(self.converted)} nn.Linear layers train in float8; {kept} keep their precision."
        )


def _torchao_float8(recipe: str | None) -> tuple[Any, Any]:
    """torchao's `convert_to_float8_training` and the config for `recipe` (None for torchao's default)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise ModuleNotFoundError(
            "`Float8Training` (and `precision=fp8` without Transformer Engine) needs torchao; install it with "
            "`pip install torchao`, or use `precision=amp`."
        ) from err
    config = Float8LinearConfig.from_recipe_name(recipe) if recipe is not None else None
    return convert_to_float8_training, config
