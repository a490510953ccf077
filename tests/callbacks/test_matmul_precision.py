"""MatmulPrecision: torch's float32 matmul precision set on every rank for the stage (ddp_spawn ranks included),
restored after it, and the precision choice logged with its reason."""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _tiny import TinyRegression, tiny_loader

from lightning_accel.callbacks import MatmulPrecision
from lightning_accel.errors import ConfigError


class _Seen(TinyRegression):
    """Records torch's matmul precision inside each training step, in whatever process runs it."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        seen = torch.tensor(["highest", "high", "medium"].index(torch.get_float32_matmul_precision()))
        self.log("seen", seen.float(), reduce_fx="max", sync_dist=True)
        return super().training_step(batch, batch_idx)


def test_set_for_the_stage_and_restored_after_it(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    before = torch.get_float32_matmul_precision()
    assert before == "highest"
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[MatmulPrecision("high", requested="amp")],
        default_root_dir=str(tmp_path),
    )
    with caplog.at_level(logging.INFO):
        trainer.fit(_Seen(), tiny_loader(16))
    assert trainer.callback_metrics["seen"] == 1.0  # `high` inside the steps
    assert torch.get_float32_matmul_precision() == before  # and put back
    line = next(r.getMessage() for r in caplog.records if "MatmulPrecision" in r.getMessage())
    assert "precision=32-true (amp: " in line and "float32_matmul_precision=high: fp32 matmuls may use TF32" in line


@pytest.mark.slow
def test_each_spawned_rank_gets_it(tmp_path) -> None:
    """`ddp_spawn` ranks are fresh interpreters: a setting made in the launching process would not reach them."""
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
        callbacks=[MatmulPrecision("medium")],
    )
    trainer.fit(_Seen(), tiny_loader(16))
    assert trainer.callback_metrics["seen"] == 2.0  # `medium` on both ranks (the max over ranks)
    assert torch.get_float32_matmul_precision() == "highest"


def test_an_unknown_precision_names_the_argument() -> None:
    with pytest.raises(ConfigError, match="`float32_matmul_precision='low'`"):
        MatmulPrecision("low")
