"""MatmulPrecision: `torch.set_float32_matmul_precision` on every rank for a stage, and why the precision was chosen."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_accel.errors import ConfigError
from lightning_accel.precision import FLOAT32_MATMUL_PRECISIONS

__all__ = ["MatmulPrecision"]

_MEANING = {
    "highest": "true fp32 matmuls (TF32 off on CUDA)",
    "high": "fp32 matmuls may use TF32 on CUDA (Ampere and newer)",
    "medium": "fp32 matmuls may use bf16 passes",
}


class MatmulPrecision(Callback):
    """Sets `torch.set_float32_matmul_precision(float32_matmul_precision)` at `setup` on every rank and puts the
    previous value back at `teardown`; on rank zero it logs the Trainer's precision, why it was chosen, and what the
    matmul setting means.

    The `precision` config group adds it as `callbacks.matmul_precision`, so a Hydra app of your own (the
    lightning-hydra-template's `train.py`) applies `precision=amp`'s `float32_matmul_precision: high` without a call
    of ours. It acts in `setup`, in each rank's own process: a rank that `ddp_spawn` starts is a fresh interpreter,
    which a setting made in the launching process does not reach.

    Keeps identical: everything on a CPU, and everything with `highest`.
    Changes on purpose: torch's float32 matmul precision (`high`: TF32 matmuls on CUDA, about 1e-3 relative rounding),
        put back at teardown.
    Cannot serve: every module is served; the setting is per process, so code outside the fit that runs between its
        setup and teardown sees it too.

    Logs:
        nothing; the precision and the reason are reported at INFO.

    Args:
        float32_matmul_precision: `highest` (true fp32: TF32 off on CUDA), `high` (TF32), `medium` (bf16 passes);
            None leaves torch's setting alone.
        requested: the precision option as the config wrote it (`amp`, `fp8`, `bf16-mixed`): the log line says what
            it resolved to here and why. None: only the Trainer's precision is logged.

    Raises:
        ConfigError: for a `float32_matmul_precision` torch does not know.

    Example::

        trainer = Trainer(precision="bf16-mixed", callbacks=[MatmulPrecision("high", requested="amp")])
    """

    def __init__(self, float32_matmul_precision: str | None = "highest", requested: str | None = None) -> None:
        if float32_matmul_precision is not None and float32_matmul_precision not in FLOAT32_MATMUL_PRECISIONS:
            options = ", ".join(f"`{v}`" for v in FLOAT32_MATMUL_PRECISIONS)
            raise ConfigError(
                f"`float32_matmul_precision={float32_matmul_precision!r}` is not supported; use one of "
                f"{options}, or None to leave torch's setting alone."
            )
        self.float32_matmul_precision = float32_matmul_precision
        self.requested = requested
        self._previous: str | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        value = self.float32_matmul_precision
        if value is not None:
            self._previous = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision(value)
        rank_zero_info(
            f"MatmulPrecision: precision={trainer.precision}{self._why(trainer)}; float32_matmul_precision="
            f"{torch.get_float32_matmul_precision()}: {_MEANING.get(torch.get_float32_matmul_precision())}"
            + ("" if value is not None else " (left as it was)")
        )

    def _why(self, trainer: pl.Trainer) -> str:
        """` (amp: <the reason it resolved so>)` when the config asked for a choice made per machine."""
        if not self.requested or self.requested == str(trainer.precision):
            return ""
        from lightning_accel.precision import resolve_precision

        accelerator = "cuda" if trainer.strategy.root_device.type == "cuda" else "cpu"
        try:
            with warnings.catch_warnings():  # the resolver warned once already, when the config was read
                warnings.simplefilter("ignore")
                return f" ({self.requested}: {resolve_precision(self.requested, accelerator).describe()})"
        except Exception as err:  # a log line must not stop the run
            return f" ({self.requested}; the reason could not be read: {type(err).__name__})"

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._previous is not None:
            torch.set_float32_matmul_precision(self._previous)
            self._previous = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "")  # Lightning skips teardown after an exception
