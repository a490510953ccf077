"""The suite every callback of lightning_accel passes: constructible, picklable, state round trip, two fits, no GPU."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _fake_nvml import FakeGPU, FakeNVML, install
from test_float8 import FakeTorchao
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel.callbacks as callbacks

# One factory per exported callback, with settings that exercise it on a CPU Trainer. A callback exported without an
# entry here fails `test_every_exported_callback_is_in_the_suite`.
FACTORIES: dict[str, Callable[[pytest.MonkeyPatch], pl.Callback]] = {
    "AccumulationScheduler": lambda mp: callbacks.AccumulationScheduler({0: 1, 2: 2}, unit="step"),
    "BenchMonitor": lambda mp: callbacks.BenchMonitor(metric="train/loss", target=1e9, warmup_batches=1),
    "DataLoaderTuner": lambda mp: callbacks.DataLoaderTuner(steps_per_trial=2, use_cache=False, print_table=False),
    "Float8Training": lambda mp: (FakeTorchao().install(mp), callbacks.Float8Training())[1],
    "GPUMonitor": lambda mp: (
        install(mp, FakeNVML([FakeGPU("GPU-a"), FakeGPU("GPU-b")])),
        callbacks.GPUMonitor(device_indices=[0, 1], print_report=False),
    )[1],
    "NonFiniteGuard": lambda mp: callbacks.NonFiniteGuard(action="skip"),
    "Parallelize": lambda mp: callbacks.Parallelize(block_classes=["Linear"], activation_checkpointing=True),
    "Preflight": lambda mp: callbacks.Preflight(),
    "SkippedStepGuard": lambda mp: callbacks.SkippedStepGuard(),
    "StopOnSignal": lambda mp: callbacks.StopOnSignal(),
    "LRScaling": lambda mp: callbacks.LRScaling("sqrt", reference_global_batch=8),
}


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(callback: pl.Callback, root: str) -> pl.Trainer:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen))
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=2, callbacks=[callback], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(_Tiny(), DataLoader(data, batch_size=4))
    return trainer


def test_every_exported_callback_is_in_the_suite() -> None:
    assert sorted(callbacks.__all__) == sorted(FACTORIES)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_constructible_and_picklable(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    callback = FACTORIES[name](monkeypatch)
    assert isinstance(callback, pl.Callback)
    assert type(pickle.loads(pickle.dumps(callback))) is type(callback)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_two_fits_in_a_row_and_state_round_trip(name: str, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    callback = FACTORIES[name](monkeypatch)
    first = _fit(callback, str(tmp_path / "first"))
    second = _fit(callback, str(tmp_path / "second"))
    assert first.global_step > 0 and second.global_step == first.global_step
    state = callback.state_dict()
    fresh = FACTORIES[name](monkeypatch)
    fresh.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert fresh.state_dict() == state
    assert type(pickle.loads(pickle.dumps(callback))) is type(callback)  # still picklable after fitting
