"""Float8Training: which layers it offers torchao, that it converts once before the optimizer, and its errors.

torchao is replaced by a fake `torchao.float8` module that records the conversion call, so no GPU or torchao is needed.
"""

from __future__ import annotations

import pickle
import sys
import types
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import examples
from lightning_accel.callbacks.float8 import Float8Training, float8_linear_filter

GPTLanguageModel = examples.GPTLanguageModel

TINY = {"block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 32}


class FakeTorchao:
    """Stands in for `torchao.float8`: records each call and marks the layers the filter lets through."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.recipes: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        float8 = types.ModuleType("torchao.float8")
        float8.convert_to_float8_training = self.convert  # type: ignore[attr-defined]
        float8.Float8LinearConfig = types.SimpleNamespace(from_recipe_name=self.from_recipe_name)  # type: ignore[attr-defined]
        torchao = types.ModuleType("torchao")
        torchao.float8 = float8  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "torchao", torchao)
        monkeypatch.setitem(sys.modules, "torchao.float8", float8)

    def from_recipe_name(self, name: str) -> str:
        self.recipes.append(name)
        return f"config<{name}>"

    def convert(self, module: nn.Module, *, module_filter_fn=None, config=None) -> nn.Module:
        linears = [(fqn, mod) for fqn, mod in module.named_modules() if isinstance(mod, nn.Linear)]
        names = [fqn for fqn, mod in linears if module_filter_fn(mod, fqn)]
        for fqn in names:
            module.get_submodule(fqn).fake_float8 = True
        self.calls.append({"module": module, "converted": names, "config": config})
        return module


@pytest.fixture
def torchao(monkeypatch: pytest.MonkeyPatch) -> FakeTorchao:
    fake = FakeTorchao()
    fake.install(monkeypatch)
    return fake


class OptimizerSeesConversion(pl.Callback):
    """Records whether the layers were already converted when the optimizer was built (on_fit_start comes after)."""

    def __init__(self) -> None:
        self.converted_at_fit_start: bool | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.converted_at_fit_start = getattr(pl_module.blocks[0].mlp.fc, "fake_float8", False)


def _loader() -> DataLoader:
    x = torch.randint(0, 256, (16, TINY["block_size"]), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.roll(-1, dims=1)), batch_size=4)


def _fit(model: pl.LightningModule, callbacks: list[pl.Callback], tmp_path) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=callbacks,
    )
    trainer.fit(model, _loader())
    return trainer


@pytest.mark.parametrize(
    ("module", "fqn", "skip", "keep"),
    [
        (nn.Linear(32, 64), "blocks.0.mlp.fc", (), True),
        (nn.Linear(30, 64), "blocks.0.mlp.fc", (), False),  # in_features not a multiple of 16
        (nn.Linear(32, 10), "head", (), False),  # out_features not a multiple of 16
        (nn.Linear(32, 256), "lm_head", ("lm_head",), False),
        (nn.Linear(32, 256), "blocks.1.attn.q_proj", ("blocks.0.",), True),
        (nn.LayerNorm(32), "ln_f", (), False),
    ],
)
def test_filter(module: nn.Module, fqn: str, skip: tuple[str, ...], keep: bool) -> None:
    assert float8_linear_filter(module, fqn, skip) is keep


def test_setup_converts_the_linear_layers_once_before_the_optimizer(torchao: FakeTorchao, tmp_path) -> None:
    model = GPTLanguageModel(**TINY)
    callback = Float8Training(skip_modules=["lm_head"])
    seen = OptimizerSeesConversion()
    _fit(model, [callback, seen], tmp_path)
    [call] = torchao.calls
    assert call["module"] is model and call["config"] is None
    assert "blocks.0.attn.q_proj" in call["converted"] and "blocks.1.mlp.proj" in call["converted"]
    assert "lm_head" not in call["converted"]
    assert len(call["converted"]) == 12  # 6 linears per block
    assert callback.converted == call["converted"]
    assert seen.converted_at_fit_start is True

    _fit(model, [callback], tmp_path)  # a second fit of the same model converts nothing again
    assert len(torchao.calls) == 1


def test_recipe_is_passed_as_a_config(torchao: FakeTorchao, tmp_path) -> None:
    _fit(GPTLanguageModel(**TINY), [Float8Training(recipe="rowwise")], tmp_path)
    assert torchao.recipes == ["rowwise"]
    assert torchao.calls[0]["config"] == "config<rowwise>"


def test_missing_torchao_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)  # makes `import torchao...` fail
    with pytest.raises(ModuleNotFoundError, match=r"needs torchao; install it with `pip install torchao`"):
        _fit(GPTLanguageModel(**TINY), [Float8Training()], tmp_path)


def test_skip_modules_must_be_a_list() -> None:
    with pytest.raises(TypeError, match=r"use `skip_modules=\['lm_head'\]`"):
        Float8Training(skip_modules="lm_head")


def test_picklable_and_stateless() -> None:
    callback = Float8Training(skip_modules=["lm_head"], recipe="tensorwise")
    copy = pickle.loads(pickle.dumps(callback))
    assert (copy.skip_modules, copy.recipe) == (("lm_head",), "tensorwise")
    assert callback.state_dict() == {}
