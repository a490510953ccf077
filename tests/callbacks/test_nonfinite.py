"""Tests of NonFiniteGuard: each action on a NaN loss forced at one batch, fp16 with SkippedStepGuard, and DDP."""

from __future__ import annotations

import copy
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _tiny import TinyRegression, decaying_lr, tiny_loader
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

from lightning_accel.callbacks._lr_hold import active_hold
from lightning_accel.callbacks.nonfinite import NonFiniteGuard, drop_gradients, nonfinite_report
from lightning_accel.callbacks.skipped_steps import SkippedStepGuard
from lightning_accel.errors import LightningAccelWarning, NonFiniteLossError


class NaNLossModel(TinyRegression):
    """A linear regression whose loss is NaN on the training batches `nan_batches`.

    SGD with momentum (a zeroed gradient would still move the weights; a dropped one does not) at LR 1/(k + 1) on
    optimizer step k. Records the weight at the start of every batch and `(global_step, lr)` at each optimizer step.
    """

    def __init__(self, nan_batches: tuple[int, ...] = (), fused_adamw: bool = False) -> None:
        super().__init__(lr=0.1, momentum=0.9, lr_decay=True)
        self.nan_batches = set(nan_batches)
        self.fused_adamw = fused_adamw  # an optimizer that unscales inside `GradScaler.step`
        self.weights: list[torch.Tensor] = []  # at the start of each batch
        self.steps: list[tuple[int, float]] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx in self.nan_batches else loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.weights.append(self.layer.weight.detach().clone())

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.steps.append((self.global_step, optimizer.param_groups[0]["lr"]))

    def configure_optimizers(self) -> Any:
        if self.fused_adamw:
            return decaying_lr(torch.optim.AdamW(self.parameters(), lr=0.1, fused=True))
        return super().configure_optimizers()

    @property
    def lrs(self) -> list[float]:
        return [lr / 0.1 for _, lr in self.steps]


def _loader() -> DataLoader:
    return tiny_loader(64)


def _trainer(tmp_path: Path, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = {"max_steps": 6, "logger": False, "enable_checkpointing": False}
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{**defaults, **kwargs},
    )


def _finite(weight: torch.Tensor) -> bool:
    return bool(torch.isfinite(weight).all())


def test_constructor_checks() -> None:
    with pytest.raises(ValueError, match=r"action='ignore'.*'warn', 'skip', 'stop', 'raise'"):
        NonFiniteGuard(action="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"filename='bad-\{iteration\}'.*\{step\}"):
        NonFiniteGuard(filename="bad-{iteration}")
    assert NonFiniteGuard(filename="nan-e{epoch}-s{step:05d}").filename == "nan-e{epoch}-s{step:05d}"


def test_report() -> None:
    assert nonfinite_report(7, 1, 3, [float("nan")]) == "Non-finite loss nan at global step 7 (epoch 1, batch 3)"
    assert "loss per rank [0.5, inf]" in nonfinite_report(7, 1, 3, [0.5, float("inf")])


def test_warn_reports_the_step_and_lets_the_update_through(tmp_path: Path) -> None:
    model, guard = NaNLossModel(nan_batches=(2,)), NonFiniteGuard(action="warn")
    trainer = _trainer(tmp_path, [guard], max_steps=3)  # a 4th step would see the NaN weights' loss
    with pytest.warns(LightningAccelWarning, match=r"Non-finite loss nan at global step 2 \(epoch 0, batch 2\)"):
        trainer.fit(model, _loader())
    assert guard.nonfinite_losses == 1 and trainer.callback_metrics["train/nonfinite_losses"] == 1
    assert not _finite(model.layer.weight)  # "warn" does not protect the weights
    assert active_hold(model) is None


def test_skip_drops_the_update_and_holds_the_schedule(tmp_path: Path) -> None:
    model, guard = NaNLossModel(nan_batches=(2,)), NonFiniteGuard(action="skip")
    trainer = _trainer(tmp_path, [guard], max_steps=5)
    with pytest.warns(LightningAccelWarning, match="global step 2.*skipped"):
        trainer.fit(model, _loader())
    assert torch.equal(model.weights[2], model.weights[3])  # no update, not even from momentum
    assert not torch.equal(model.weights[3], model.weights[4])  # training goes on
    assert _finite(model.layer.weight)
    assert model.lrs == pytest.approx([1, 1 / 2, 1 / 3, 1 / 3, 1 / 4])
    assert guard.nonfinite_losses == 1 and trainer.callback_metrics["train/nonfinite_losses"] == 1
    assert active_hold(model) is None


def test_skip_drops_the_whole_accumulation_window(tmp_path: Path) -> None:
    model, guard = NaNLossModel(nan_batches=(2,)), NonFiniteGuard(action="skip")
    trainer = _trainer(tmp_path, [guard], max_steps=3, accumulate_grad_batches=2)
    with pytest.warns(LightningAccelWarning):
        trainer.fit(model, _loader())
    assert torch.equal(model.weights[2], model.weights[4])  # batches 2 and 3 made one window, dropped
    assert _finite(model.layer.weight) and model.lrs == pytest.approx([1, 1 / 2, 1 / 2])


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_stop_saves_the_last_good_state_and_stops(tmp_path: Path) -> None:
    model, guard = NaNLossModel(nan_batches=(3,)), NonFiniteGuard(action="stop")
    trainer = _trainer(tmp_path, [guard], max_steps=10)
    with pytest.warns(LightningAccelWarning, match="global step 3.*stopping"):
        trainer.fit(model, _loader())
    path = tmp_path / "checkpoints" / "nonfinite-step3.ckpt"
    assert guard.last_checkpoint_path == str(path) and path.is_file()
    assert trainer.global_step == 4 and len(model.weights) == 4  # stopped after the bad batch
    saved = torch.load(path, weights_only=False)
    assert torch.equal(saved["state_dict"]["layer.weight"], model.weights[3])  # the weights before the bad step
    assert torch.equal(model.layer.weight, model.weights[3]) and _finite(model.layer.weight)
    assert saved["lr_schedulers"][0]["last_epoch"] == 3

    resumed = NaNLossModel()  # the checkpoint resumes
    _trainer(tmp_path, [NonFiniteGuard(action="stop")], max_steps=6).fit(resumed, _loader(), ckpt_path=path)
    assert torch.equal(resumed.weights[0], model.weights[3]) and _finite(resumed.layer.weight)


def test_raise_saves_then_raises(tmp_path: Path) -> None:
    model = NaNLossModel(nan_batches=(1,))
    guard = NonFiniteGuard(action="raise", dirpath=tmp_path / "bad", filename="e{epoch}-s{step}")
    trainer = _trainer(tmp_path, [guard])
    with pytest.raises(NonFiniteLossError, match=r"global step 1 \(epoch 0, batch 1\).*e0-s1\.ckpt"):
        trainer.fit(model, _loader())
    saved = torch.load(tmp_path / "bad" / "e0-s1.ckpt", weights_only=False)
    assert torch.equal(saved["state_dict"]["layer.weight"], model.weights[1])
    assert active_hold(model) is None  # restored on the exception too


def test_stop_defaults_to_the_model_checkpoint_folder(tmp_path: Path) -> None:
    model, guard = NaNLossModel(nan_batches=(1,)), NonFiniteGuard(action="stop")
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "mc")
    with pytest.warns(LightningAccelWarning):
        _trainer(tmp_path, [guard, ckpt], enable_checkpointing=True).fit(model, _loader())
    assert (tmp_path / "mc" / "nonfinite-step1.ckpt").is_file()


@pytest.mark.parametrize("fused_adamw", [False, True], ids=["sgd", "fused-adamw"])
def test_fp16_skip_holds_the_schedule_once_with_skipped_step_guard(tmp_path: Path, fused_adamw: bool) -> None:
    model = NaNLossModel(nan_batches=(2,), fused_adamw=fused_adamw)
    nonfinite, skipped = NonFiniteGuard(action="skip"), SkippedStepGuard()
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=10**6)
    trainer = _trainer(tmp_path, [nonfinite, skipped], max_steps=5, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    with pytest.warns(LightningAccelWarning, match="loss nan at global step 2"):
        trainer.fit(model, _loader())
    assert model.lrs == pytest.approx([1, 1 / 2, 1 / 3, 1 / 3, 1 / 4])  # held once, not twice
    assert nonfinite.nonfinite_losses == 1 and skipped.skipped_steps == 1
    assert torch.equal(model.weights[2], model.weights[3]) and _finite(model.layer.weight)


@pytest.mark.parametrize("fused_adamw", [False, True], ids=["sgd", "fused-adamw"])
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "grad-scaler"])
def test_drop_gradients_leaves_weights_and_optimizer_state_alone(fused_adamw: bool, scaled: bool) -> None:
    model = NaNLossModel(fused_adamw=fused_adamw)
    opt = model.configure_optimizers()["optimizer"]
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, enabled=scaled)

    def snapshot() -> list[torch.Tensor]:
        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return [t.detach().clone() for t in (*model.parameters(), *state)]

    def step(drop: bool) -> None:  # what Lightning's AMP plugin does around `on_before_optimizer_step`
        opt.zero_grad()
        scaler.scale(model.layer(torch.ones(2, 4)).sum()).backward()
        if not (scaled and fused_adamw):  # a fused optimizer unscales inside `scaler.step`
            scaler.unscale_(opt)
        if drop:
            drop_gradients(opt, scaled)
        scaler.step(opt)
        scaler.update()

    step(drop=False)  # momentum / Adam moments exist from here on
    before = snapshot()
    step(drop=True)
    after = snapshot()
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_state_dict_round_trip_and_pickling() -> None:
    guard = NonFiniteGuard(action="stop", dirpath="x")
    guard.nonfinite_losses = 2
    other = NonFiniteGuard()
    other.load_state_dict(guard.state_dict())
    assert other.nonfinite_losses == 2
    for clone in (pickle.loads(pickle.dumps(guard)), copy.deepcopy(guard)):
        assert (clone.action, clone.dirpath, clone.nonfinite_losses) == ("stop", "x", 2)


DDP_SCRIPT = """
import sys, warnings
import lightning.pytorch as pl
import torch
sys.path[:0] = [{tests_dir!r}, {tests_root!r}]
from test_nonfinite import NaNLossModel, _loader
from lightning_accel.callbacks.nonfinite import NonFiniteGuard
from lightning_accel.errors import LightningAccelWarning

class RankOneNaN(NaNLossModel):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_rank == 1 and batch_idx == 2 else loss

warnings.simplefilter("ignore")
warnings.filterwarnings("always", category=LightningAccelWarning)
guard = NonFiniteGuard(action="stop", dirpath={ckpt_dir!r})
trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_steps=50, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[guard], default_root_dir={ckpt_dir!r})
model = RankOneNaN()
trainer.fit(model, _loader())
finite = bool(torch.isfinite(model.layer.weight).all())
with open({ckpt_dir!r} + f"/rank{{trainer.global_rank}}.txt", "w") as f:  # the ranks share stdout: not there
    f.write(f"step {{trainer.global_step}} count {{guard.nonfinite_losses}} finite {{finite}}")
"""


@pytest.mark.slow
def test_ddp_a_nan_on_one_rank_stops_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "ddp_nonfinite.py"
    here = Path(__file__)
    script.write_text(
        textwrap.dedent(
            DDP_SCRIPT.format(tests_dir=str(here.parent), tests_root=str(here.parents[1]), ckpt_dir=str(tmp_path))
        )
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MASTER_PORT": str(find_free_network_port())}
    # its own session, so a hang (ranks out of step) kills the launcher and the rank it spawned, which ignore SIGTERM
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"DDP run hung (ranks out of step):\n{stdout[-3000:]}{stderr[-3000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    for rank in (0, 1):  # both stopped after the bad step, counted it once, kept finite weights
        assert (tmp_path / f"rank{rank}.txt").read_text() == "step 3 count 1 finite True", stdout[-3000:]
    assert (tmp_path / "nonfinite-step2.ckpt").is_file()
    assert re.search(r"Non-finite loss per rank \[[-+.e0-9]+, nan\] at global step 2 \(epoch 0, batch 2\)", stderr)
