"""Tests of the digits data module and MLP classifier."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_accel import examples

DigitsClassifier, DigitsDataModule = examples.DigitsClassifier, examples.DigitsDataModule

needs_sklearn = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="needs scikit-learn")


def _labels(dataset: TensorDataset) -> torch.Tensor:
    return dataset.tensors[1]


@needs_sklearn
def test_splits_are_stratified_scaled_and_deterministic() -> None:
    dm = DigitsDataModule(val_fraction=0.15, test_fraction=0.15, seed=0)
    dm.setup("fit")
    sizes = [len(dm.train_set), len(dm.val_set), len(dm.test_set)]
    assert sum(sizes) == 1797 and sizes[2] == 270
    for dataset in (dm.train_set, dm.val_set, dm.test_set):
        assert set(_labels(dataset).tolist()) == set(range(10))  # every class in every split
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (64, dm.num_features) and x.dtype == torch.float32 and y.dtype == torch.long
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    again = DigitsDataModule(seed=0)
    again.setup("test")
    assert torch.equal(again.test_set.tensors[0], dm.test_set.tensors[0])
    other = DigitsDataModule(seed=1)
    other.setup("test")
    assert not torch.equal(other.test_set.tensors[0], dm.test_set.tensors[0])


def test_invalid_arguments_name_the_setting() -> None:
    with pytest.raises(ValueError, match="`data.batch_size=0`"):
        DigitsDataModule(batch_size=0)
    with pytest.raises(ValueError, match="must be below 1"):
        DigitsDataModule(val_fraction=0.6, test_fraction=0.4)
    with pytest.raises(ValueError, match="`model.hidden_dim=0`"):
        DigitsClassifier(hidden_dim=0)


def test_missing_sklearn_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("sklearn", "sklearn.datasets", "sklearn.model_selection"):
        monkeypatch.setitem(sys.modules, name, None)
    dm = DigitsDataModule()
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lightning_accel\[digits\]'"):
        dm.setup("fit")


@pytest.mark.slow
def test_importing_the_examples_does_not_import_sklearn() -> None:
    code = "import sys, lightning_accel.examples; assert 'sklearn' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_flops_per_batch() -> None:
    model = DigitsClassifier()
    params = sum(p.numel() for p in model.parameters())
    assert model.flops_per_batch(32) == 6 * params * 32 == 32 * model.flops_per_batch(1)


@needs_sklearn
def test_short_fit_beats_chance(tmp_path: Path) -> None:
    L.seed_everything(0)
    model = DigitsClassifier(optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
    trainer = L.Trainer(
        max_steps=30,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    dm = DigitsDataModule()
    trainer.fit(model, datamodule=dm)
    assert {"train/loss", "train/acc", "val/loss", "val/acc"} <= set(trainer.callback_metrics)
    result = trainer.test(model, datamodule=dm, verbose=False)[0]
    assert result["test/acc"] > 0.8  # chance is 0.1
    assert result["test/loss"] < 1.0


def test_seed_none_splits_and_shuffles_from_the_global_rngs() -> None:
    dm = DigitsDataModule(seed=None)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert len(x) == len(y) > 0
