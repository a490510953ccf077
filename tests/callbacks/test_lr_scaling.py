"""LRScaling: the factor per rule, the LRs an optimizer and its schedule then use, resume, bad input, Hydra."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from _tiny import TinyRegression, tiny_loader
from torch.utils.data import DataLoader

from lightning_accel.callbacks import LRScaling
from lightning_accel.callbacks.lr_scaling import lr_scale_factor


class _Model(TinyRegression):
    """SGD at LR 0.1 under a step-interval LambdaLR 1 / (1 + step), or OneCycleLR; records the LR of every batch."""

    def __init__(self, schedule: str = "lambda") -> None:
        super().__init__(lr=0.1, lr_decay=True)
        self.schedule = schedule
        self.seen: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        if self.schedule != "onecycle":
            return super().configure_optimizers()
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=100)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return tiny_loader(64, batch_size=8, seed=None)


def _fit(callback: LRScaling, tmp_path: Path, schedule: str = "lambda", accumulate: int = 4, **kwargs) -> _Model:
    model = _Model(schedule)
    trainer = pl.Trainer(
        max_steps=2,
        accumulate_grad_batches=accumulate,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kwargs,
    )
    trainer.fit(model)
    return model


def test_the_factor_per_rule() -> None:
    assert lr_scale_factor("none", 128, 32) == 1.0
    assert lr_scale_factor("linear", 128, 32) == 4.0
    assert lr_scale_factor("sqrt", 128, 32) == 2.0
    with pytest.raises(ValueError, match="rule='cubic'"):
        lr_scale_factor("cubic", 128, 32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reference_global_batch=0"):
        LRScaling("linear", reference_global_batch=0)


@pytest.mark.parametrize(("rule", "factor"), [("linear", 4.0), ("sqrt", 2.0), ("none", 1.0)])
def test_the_schedule_follows_the_scaled_learning_rate(rule: str, factor: float, tmp_path: Path) -> None:
    callback = LRScaling(rule, reference_global_batch=8)  # type: ignore[arg-type]
    model = _fit(callback, tmp_path)  # batch 8 x 1 process x accumulate 4 = 32
    assert callback.global_batch == 32 and callback.factor == factor
    # LambdaLR 1 / (1 + step): 4 micro-batches at step 0, then at step 1
    assert model.seen == pytest.approx([0.1 * factor] * 4 + [0.05 * factor] * 4)


def test_onecycle_keeps_its_shape_at_the_scaled_peak(tmp_path: Path) -> None:
    callback = LRScaling("linear", reference_global_batch=8)
    model = _fit(callback, tmp_path, schedule="onecycle", accumulate=2)
    unscaled = _fit(LRScaling("none", reference_global_batch=8), tmp_path, schedule="onecycle", accumulate=2)
    assert [a / b for a, b in zip(model.seen, unscaled.seen, strict=True)] == pytest.approx([2.0] * 4)


def test_a_resumed_fit_is_not_scaled_twice(tmp_path: Path) -> None:
    callback = LRScaling("linear", reference_global_batch=8)
    model = _Model()
    trainer = pl.Trainer(
        max_steps=2,
        accumulate_grad_batches=4,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "two.ckpt")
    resumed = _Model()
    again = LRScaling("linear", reference_global_batch=8)
    trainer = pl.Trainer(
        max_steps=3,
        accumulate_grad_batches=4,
        callbacks=[again],
        logger=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(resumed, ckpt_path=tmp_path / "two.ckpt")
    assert again.factor is None
    assert resumed.seen and resumed.seen == pytest.approx([0.4 / 3] * len(resumed.seen))  # step 2: 0.1 x 4 / (1 + 2)


def test_the_hydra_group_adds_the_callback(compose_train) -> None:  # type: ignore[no-untyped-def]
    cfg = compose_train(["lr_scaling=sqrt"])
    assert cfg.callbacks.lr_scaling._target_ == "lightning_accel.callbacks.LRScaling"
    assert cfg.callbacks.lr_scaling.reference_global_batch == cfg.data.batch_size
    assert "lr_scaling" not in compose_train([]).callbacks
