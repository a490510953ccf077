"""Compile: torch.compile of the model from config, its errors before launch, and parity with eager."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _tiny import TinyRegression, tiny_loader

from lightning_accel.callbacks import Compile
from lightning_accel.errors import ConfigError, LightningAccelWarning
from lightning_accel.system import software


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"mode": "fast"}, "mode"),
        ({"fullgraph": "yes"}, "fullgraph"),
        ({"dynamic": 1}, "dynamic"),
        ({"backend": ""}, "backend"),
    ],
)
def test_bad_options_name_the_setting(kwargs: dict[str, Any], setting: str) -> None:
    with pytest.raises(ConfigError, match=setting) as info:
        Compile(**kwargs)
    assert info.value.setting == setting


def _fit(
    callback: Compile, tmp_path: Any, model: pl.LightningModule | None = None, extra: list[pl.Callback] | None = None
) -> pl.LightningModule:
    model = model or TinyRegression(seed=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[callback, *(extra or [])],
    )
    trainer.fit(model, tiny_loader())
    return model


def test_the_forward_runs_compiled_during_the_fit_and_eagerly_after(tmp_path) -> None:
    calls: list[bool] = []

    class Watching(TinyRegression):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            calls.append(self._compiled_call_impl is not None)
            return super().training_step(batch, batch_idx)

    model = _fit(Compile(backend="eager"), tmp_path, Watching(seed=0))
    assert calls == [True, True, True]
    assert model._compiled_call_impl is None  # undone at teardown: the module is eager again
    assert type(model) is Watching  # compiled in place: the class, hooks and state_dict keys stay


def test_no_compiler_for_inductor_is_an_error_naming_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(software.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    problem = software.compile_problem("inductor", on_cuda=False)
    assert problem is not None and "C++ compiler" in problem and "build-essential" in problem
    assert "C compiler" in (software.compile_problem("inductor", on_cuda=True) or "")
    assert software.compile_problem("aot_eager") is None  # builds no kernels
    with pytest.raises(ConfigError, match="C\\+\\+ compiler.*compile=none"):
        _fit(Compile(), tmp_path)


def test_model_parallel_without_blocks_is_refused_and_with_blocks_goes_through_parallelize(tmp_path) -> None:
    from lightning_accel.callbacks import Parallelize

    parallelize = Parallelize(block_classes=["Linear"])
    compile_ = Compile(mode="max-autotune")

    from lightning.pytorch.strategies import ModelParallelStrategy

    trainer: Any = type("T", (), {})()  # the two things setup reads: the strategy (on the CPU) and the callbacks
    trainer.strategy = ModelParallelStrategy()
    trainer.strategy.parallel_devices = [torch.device("cpu")]
    type(trainer).callbacks = []
    with pytest.raises(ConfigError, match="through the Parallelize callback"):
        compile_.setup(trainer, TinyRegression(), "fit")
    type(trainer).callbacks = [parallelize]
    compile_.setup(trainer, TinyRegression(), "fit")
    assert parallelize.compile and parallelize.compile_mode == "max-autotune"


@pytest.mark.slow  # ~15 s of compiling; Compile's settings are tested by default
def test_compiled_gpt_matches_eager_within_1_percent(tmp_path) -> None:
    """The GPT example compiled with inductor (gcc on this CPU) against eager, same seed and data: validation loss
    within 1% after 12 steps (they agree to float rounding)."""
    from lightning_accel.examples import GPTLanguageModel

    data = torch.randint(0, 256, (64, 33), generator=torch.Generator().manual_seed(0))
    pairs = list(zip(data[:, :-1], data[:, 1:], strict=True))
    losses = {}
    for name, extra in (("eager", []), ("compiled", [Compile()])):
        pl.seed_everything(0, verbose=False)
        model = GPTLanguageModel(block_size=32, n_layer=1, n_head=2, n_embd=32)
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=12,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=extra,
            num_sanity_val_steps=0,
            default_root_dir=str(tmp_path),
        )
        trainer.fit(
            model,
            torch.utils.data.DataLoader(pairs[:48], batch_size=8),
            torch.utils.data.DataLoader(pairs[48:], batch_size=8),
        )
        losses[name] = float(trainer.callback_metrics["val/loss"])
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=0.01), losses


class _CallsItself(TinyRegression):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)


def test_a_step_that_never_calls_the_module_itself_is_warned_before_the_first_optimizer_step(tmp_path) -> None:
    """`self.layer(x)` (TinyRegression) or `self.model(...)` (Lightning's LSTM demo) never runs the compiled forward:
    said at the first optimizer step, once, not left to a user who sees no speed-up."""
    seen: list[tuple[int, int]] = []  # (optimizer steps taken, warnings so far) at each optimizer step

    class Steps(pl.Callback):
        def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
            seen.append((trainer.global_step, sum("never called" in str(w.message) for w in record)))

    with pytest.warns(LightningAccelWarning, match=r"never called the TinyRegression itself") as record:
        _fit(Compile(backend="eager"), tmp_path, TinyRegression(seed=0), extra=[Steps()])
    assert len([w for w in record if "never called" in str(w.message)]) == 1
    assert seen[0] == (0, 1)  # Compile's hook ran first: the warning came before the first step was taken


def test_a_step_that_calls_the_module_itself_is_not_warned(tmp_path, recwarn: pytest.WarningsRecorder) -> None:
    _fit(Compile(backend="eager"), tmp_path, _CallsItself(seed=0))
    assert not [w for w in recwarn if "never called" in str(w.message)]
