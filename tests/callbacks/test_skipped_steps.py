"""Tests of SkippedStepGuard: a real CPU fp16 GradScaler, an inf gradient forced at one step, the LR that step used."""

from __future__ import annotations

import copy
import csv
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from _tiny import TinyRegression, tiny_loader
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

from lightning_accel.callbacks import AccumulationScheduler
from lightning_accel.callbacks._lr_hold import active_hold, hold_lr_schedulers, release_lr_schedulers
from lightning_accel.callbacks.skipped_steps import SkippedStepGuard, scale_dropped


class InfGradModel(TinyRegression):
    """A linear regression whose gradients are forced to inf on the training batches `inf_batches` (loss stays finite).

    SGD at LR 1/(k + 1) on optimizer step k (a step-interval LambdaLR), so the LR each step used names the
    scheduler's position. Records `(global_step, lr, weight)` at each optimizer step, before it.
    """

    def __init__(self, inf_batches: tuple[int, ...] = ()) -> None:
        super().__init__(lr=1.0, lr_decay=True)
        self.inf_batches = set(inf_batches)
        self.steps: list[tuple[int, float, torch.Tensor]] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.layer(x)
        if batch_idx in self.inf_batches:
            out.register_hook(lambda grad: grad + float("inf"))
        return F.mse_loss(out.float(), y)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.steps.append((self.global_step, optimizer.param_groups[0]["lr"], self.layer.weight.detach().clone()))

    @property
    def lrs(self) -> list[float]:
        return [lr for _, lr, _ in self.steps]


def _loader() -> DataLoader:
    return tiny_loader(64)


def _fp16() -> MixedPrecision:
    # a low scale that never grows, so only the forced inf gradients skip a step
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=10**6))


def _trainer(tmp_path: Path, callbacks: list[pl.Callback], *, fp16: bool = True, **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = {"max_steps": 5, "logger": False, "enable_checkpointing": False}
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[_fp16()] if fp16 else None,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{**defaults, **kwargs},
    )


def _last_epoch(trainer: pl.Trainer) -> int:
    return trainer.lr_scheduler_configs[0].scheduler.last_epoch


def test_scale_dropped() -> None:
    assert scale_dropped(16.0, 8.0)
    assert not scale_dropped(16.0, 16.0) and not scale_dropped(16.0, 32.0)


def test_without_the_guard_lightning_advances_the_schedule_on_a_skipped_step(tmp_path: Path) -> None:
    model = InfGradModel(inf_batches=(2,))
    trainer = _trainer(tmp_path, [])
    trainer.fit(model, _loader())
    assert torch.equal(model.steps[2][2], model.steps[3][2])  # the GradScaler skipped step 2 ...
    assert model.lrs == pytest.approx([1, 1 / 2, 1 / 3, 1 / 4, 1 / 5])  # ... and the schedule moved on anyway
    assert _last_epoch(trainer) == 5


def test_a_skipped_step_does_not_advance_the_schedule(tmp_path: Path) -> None:
    model, guard = InfGradModel(inf_batches=(2,)), SkippedStepGuard()
    trainer = _trainer(tmp_path, [guard], logger=CSVLogger(tmp_path, name="", version=""), log_every_n_steps=1)
    trainer.fit(model, _loader())
    assert torch.equal(model.steps[2][2], model.steps[3][2])  # step 2 was skipped
    assert model.lrs == pytest.approx([1, 1 / 2, 1 / 3, 1 / 3, 1 / 4])  # step 3 reuses step 2's LR
    assert _last_epoch(trainer) == 4
    assert guard.skipped_steps == 1
    assert trainer.callback_metrics["train/skipped_steps"] == 1
    with open(tmp_path / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["train/skipped_steps"]]
    logged = [(int(r["step"]), float(r["train/skipped_steps"])) for r in rows]
    assert logged == [(0, 0.0), (1, 0.0), (2, 1.0), (3, 1.0), (4, 1.0)]
    assert active_hold(model) is None and "lr_scheduler_step" not in model.__dict__  # restored after fit


@pytest.mark.parametrize("inf_batch", [2, 3], ids=["first-micro-batch", "last-micro-batch"])
def test_gradient_accumulation_holds_the_window_step(tmp_path: Path, inf_batch: int) -> None:
    for guarded, expected in ((False, [1, 1 / 2, 1 / 3, 1 / 4]), (True, [1, 1 / 2, 1 / 2, 1 / 3])):
        model, guard = InfGradModel(inf_batches=(inf_batch,)), SkippedStepGuard()
        trainer = _trainer(tmp_path, [guard] if guarded else [], max_steps=4, accumulate_grad_batches=2)
        trainer.fit(model, _loader())
        assert [step for step, _, _ in model.steps] == [0, 1, 2, 3]  # one check per window, not per micro-batch
        assert torch.equal(model.steps[1][2], model.steps[2][2])  # the window of batches 2-3 did not update
        assert model.lrs == pytest.approx(expected)
        assert guard.skipped_steps == (1 if guarded else 0)


def test_windows_of_lightning_accels_accumulation_scheduler(tmp_path: Path) -> None:
    model, guard = InfGradModel(inf_batches=(4,)), SkippedStepGuard()  # windows: [0], [1, 2], [3, 4], [5, 6]
    trainer = _trainer(tmp_path, [AccumulationScheduler({0: 1, 1: 2}, unit="step"), guard], max_steps=4)
    trainer.fit(model, _loader())
    assert torch.equal(model.steps[2][2], model.steps[3][2])  # the window of batches 3-4 did not update
    assert model.lrs == pytest.approx([1, 1 / 2, 1 / 3, 1 / 3]) and guard.skipped_steps == 1


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_a_checkpoint_after_a_skip_saves_and_resumes(tmp_path: Path) -> None:
    model, guard = InfGradModel(inf_batches=(1,)), SkippedStepGuard()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    trainer = _trainer(tmp_path, [guard, ckpt], max_steps=3, enable_checkpointing=True)
    trainer.fit(model, _loader())
    saved = torch.load(tmp_path / "ckpt" / "epoch=0-step=3.ckpt", weights_only=False)
    sched_state = saved["lr_schedulers"][0]
    assert sched_state["last_epoch"] == 2  # 3 steps, 1 held
    assert set(sched_state) == set(trainer.lr_scheduler_configs[0].scheduler.state_dict())  # nothing added to it
    assert saved["callbacks"]["SkippedStepGuard"] == {"skipped_steps": 1}

    resumed_model, resumed_guard = InfGradModel(), SkippedStepGuard()
    resumed = _trainer(tmp_path, [resumed_guard], max_steps=5)
    resumed.fit(resumed_model, _loader(), ckpt_path=tmp_path / "ckpt" / "epoch=0-step=3.ckpt")
    assert resumed_guard.skipped_steps == 1
    assert resumed_model.lrs == pytest.approx([1 / 3, 1 / 4])  # continues where the held schedule stood
    assert _last_epoch(resumed) == 4


def test_no_scaler_is_a_no_op(tmp_path: Path) -> None:
    model, guard = InfGradModel(), SkippedStepGuard()

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            assert "lr_scheduler_step" not in pl_module.__dict__

    trainer = _trainer(tmp_path, [guard, Probe()], fp16=False, max_steps=2)
    trainer.fit(model, _loader())
    assert guard.skipped_steps == 0 and "train/skipped_steps" not in trainer.callback_metrics
    assert model.lrs == pytest.approx([1, 1 / 2])


def test_two_fits_in_a_row_start_from_zero(tmp_path: Path) -> None:
    guard = SkippedStepGuard()
    for _ in range(2):
        model = InfGradModel(inf_batches=(1,))
        _trainer(tmp_path, [guard], max_steps=3).fit(model, _loader())
        assert guard.skipped_steps == 1
        assert model.lrs == pytest.approx([1, 1 / 2, 1 / 2])


def test_state_dict_round_trip_and_pickling() -> None:
    guard = SkippedStepGuard()
    guard.skipped_steps = 7
    other = SkippedStepGuard()
    other.load_state_dict(guard.state_dict())
    assert other.skipped_steps == 7
    assert pickle.loads(pickle.dumps(guard)).skipped_steps == 7
    assert copy.deepcopy(guard).skipped_steps == 7


def test_hold_is_shared_and_restores_the_modules_own_attribute() -> None:
    stepped: list[str] = []
    step_sched, epoch_sched = object(), object()
    configs = [SimpleNamespace(scheduler=s, interval=i) for s, i in ((step_sched, "step"), (epoch_sched, "epoch"))]
    module = pl.LightningModule()
    module.trainer = SimpleNamespace(lr_scheduler_configs=configs)  # type: ignore[assignment]
    own = lambda scheduler, metric: stepped.append("step" if scheduler is step_sched else "epoch")  # noqa: E731
    module.lr_scheduler_step = own  # type: ignore[method-assign]
    owner_a, owner_b = object(), object()
    flags = {"a": False, "b": False}
    hold_lr_schedulers(module, owner_a, lambda: flags["a"])
    hold_lr_schedulers(module, owner_b, lambda: flags["b"])
    hold = active_hold(module)
    assert hold is not None

    module.lr_scheduler_step(step_sched, None)
    flags["b"] = True
    module.lr_scheduler_step(step_sched, None)  # held by b
    module.lr_scheduler_step(epoch_sched, None)  # epoch-interval schedulers are never held
    assert stepped == ["step", "epoch"] and hold.held_steps == 1

    release_lr_schedulers(module, owner_b)
    assert active_hold(module) is hold  # owner a still holds
    module.lr_scheduler_step(step_sched, None)
    assert stepped == ["step", "epoch", "step"]
    release_lr_schedulers(module, owner_a)
    release_lr_schedulers(module, owner_a)  # twice is fine
    assert module.__dict__["lr_scheduler_step"] is own


def test_a_held_module_copies_and_pickles_without_its_trainer_or_owners() -> None:
    module = InfGradModel()
    module.trainer = SimpleNamespace(lr_scheduler_configs=[])  # type: ignore[assignment]
    hold_lr_schedulers(module, object(), lambda: True)  # a lambda: not picklable
    for clone in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        clone_hold = active_hold(clone)
        assert clone_hold is not None and clone_hold.pl_module is clone and clone_hold.owners == {}
        assert clone._trainer is None
