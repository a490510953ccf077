"""LR scheduler factories: shapes of the schedules and the errors for settings that cannot work."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_accel import schedules
from lightning_accel.schedules import cosine_schedule, linear_warmup_schedule, onecycle_schedule


def _lrs(scheduler, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    lrs.append(scheduler.get_last_lr()[0])
    return lrs


def _optimizer(lr: float = 1.0) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_cosine_warms_up_then_decays_to_the_floor_at_the_last_step() -> None:
    lrs = _lrs(cosine_schedule(_optimizer(), total_steps=100, warmup_steps=10, min_lr_ratio=0.1), 100)
    assert lrs[0] == pytest.approx(1 / 11)  # (0 + 1) / (10 + 1) of the base LR
    assert lrs[9] == pytest.approx(10 / 11)
    assert lrs[10] == pytest.approx(1.0)  # the peak: first step after warm-up
    assert all(a >= b for a, b in zip(lrs[10:99], lrs[11:100], strict=True))
    assert lrs[99] == pytest.approx(0.1, rel=1e-9)  # the fit's last optimizer step (index total_steps - 1)
    midpoint = 10 + 89 / 2
    assert cosine_schedule(_optimizer(), 100, warmup_steps=10, min_lr_ratio=0.1).lr_lambdas[0](midpoint) == (
        pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), rel=1e-9)
    )


def test_cosine_warmup_as_fraction() -> None:
    lrs = _lrs(cosine_schedule(_optimizer(), total_steps=200, warmup_steps=0.05), 200)
    assert lrs[10] == pytest.approx(1.0) and lrs[9] < 1.0  # 10 warm-up steps
    assert lrs[199] == pytest.approx(0.0, abs=1e-12)


def test_linear_warmup_then_linear_decay() -> None:
    lrs = _lrs(linear_warmup_schedule(_optimizer(), total_steps=21, warmup_steps=4, min_lr_ratio=0.2), 21)
    assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    decay = lrs[4:21]
    assert decay == pytest.approx([1.0 - 0.8 * i / 16 for i in range(17)])
    assert lrs[20] == pytest.approx(0.2, rel=1e-9)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"warmup_steps": 100}, "warmup_steps=100"),
        ({"warmup_steps": 1.5}, "warmup_steps=1.5"),
        ({"min_lr_ratio": 2.0}, "min_lr_ratio=2.0"),
    ],
)
def test_cosine_rejects_bad_settings(kwargs, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        cosine_schedule(_optimizer(), total_steps=100, **kwargs)


def test_onecycle_peaks_at_optimizer_lr_and_ends_near_zero() -> None:
    lrs = _lrs(onecycle_schedule(_optimizer(lr=0.5), total_steps=50, pct_start=0.2), 49)
    assert max(lrs) == pytest.approx(0.5, rel=1e-3)
    assert lrs[0] == pytest.approx(0.5 / 25)
    assert lrs[-1] < 1e-4


class _Estimates(Exception):
    """Raised from configure_optimizers with both estimates: the fit stops before any step."""


def _estimates(tmp_path, **trainer_kwargs) -> tuple[object, object]:
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_accel import estimated_optimizer_steps

    class Model(BoringModel):
        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            lightning = self.trainer.estimated_stepping_batches
            try:
                ours: object = estimated_optimizer_steps(self.trainer)
            except ValueError as err:
                ours = err
            raise _Estimates(lightning, ours)

    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    with pytest.raises(_Estimates) as got:
        trainer.fit(Model())
    return got.value.args[0], got.value.args[1]


# BoringModel: 64 batches per epoch
GRID = [
    dict(max_epochs=e, max_steps=s, limit_train_batches=b, accumulate_grad_batches=a)
    for e in (1, 3)
    for s in (-1, 7, 40)
    for b in (1.0, 0.5, 5)
    for a in (1, 3)
]


@pytest.mark.parametrize("kwargs", GRID, ids=[",".join(f"{k[:5]}={v}" for k, v in g.items()) for g in GRID])
def test_estimated_optimizer_steps_agrees_with_lightning_without_an_accumulation_callback(tmp_path, kwargs) -> None:
    lightning, ours = _estimates(tmp_path, **kwargs)
    assert ours == lightning


@pytest.mark.parametrize(
    ("kwargs", "lightning", "ours"),
    [
        (dict(max_epochs=2, limit_train_batches=0), -1, 0),  # "The fit has no end" before: it takes 0 steps
        (dict(max_epochs=0), 64, 0),  # Lightning counts max(max_epochs, 1) epochs; none runs
        (dict(max_epochs=-1, max_steps=12), 12, 12),
        (dict(max_epochs=-1, max_steps=-1), float("inf"), ValueError),  # no schedule can be sized
    ],
)
def test_estimated_optimizer_steps_at_the_edges(tmp_path, kwargs, lightning, ours) -> None:
    got_lightning, got_ours = _estimates(tmp_path, **kwargs)
    assert got_lightning == lightning
    if ours is ValueError:
        assert isinstance(got_ours, ValueError) and "no end" in str(got_ours)
    else:
        assert got_ours == ours


@pytest.mark.parametrize("name", ["cosine_schedule", "linear_warmup_schedule", "onecycle_schedule"])
def test_a_schedule_called_without_total_steps_says_how(name: str) -> None:
    """lightning-hydra-template's model calls `self.hparams.scheduler(optimizer=optimizer)`: onecycle said only
    "missing ... 'total_steps'"."""
    from lightning_accel import schedules
    from lightning_accel.errors import ConfigError

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ConfigError, match=r"needs `total_steps`.*estimated_optimizer_steps\(self.trainer\)"):
        getattr(schedules, name)(optimizer=optimizer)


def test_a_scheduler_without_total_steps_is_stepped_per_epoch_and_plateau_on_the_monitor() -> None:
    """`scheduler=plateau` (ReduceLROnPlateau, lightning-hydra-template's own) and torch's StepLR take no fit length:
    called with the optimizer alone and stepped every epoch; ReduceLROnPlateau follows `monitor`."""
    import functools

    import lightning.pytorch as pl

    model = pl.LightningModule()
    model.layer = torch.nn.Linear(2, 1)
    plateau = functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, mode="min", factor=0.1, patience=10)
    config = schedules.configure_optimizers(model, None, plateau, monitor="val/acc")
    assert isinstance(config["lr_scheduler"]["scheduler"], torch.optim.lr_scheduler.ReduceLROnPlateau)
    assert config["lr_scheduler"]["interval"] == "epoch" and config["lr_scheduler"]["monitor"] == "val/acc"
    step = schedules.configure_optimizers(model, None, functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2))
    assert step["lr_scheduler"]["interval"] == "epoch" and "monitor" not in step["lr_scheduler"]
