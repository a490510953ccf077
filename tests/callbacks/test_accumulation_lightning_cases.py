"""Lightning's GradientAccumulationScheduler cases, run against Lightning's class and ours: AccumulationScheduler is
a drop-in superset. Written from the behaviour Lightning documents and tests; where ours differs on purpose (listed
in its docstring) the case says so and asserts our behaviour."""

from __future__ import annotations

import math
from unittest.mock import Mock, patch

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_accel.callbacks import AccumulationScheduler
from lightning_accel.errors import ConfigError

BOTH = pytest.mark.parametrize(
    "cls", [GradientAccumulationScheduler, AccumulationScheduler], ids=["lightning", "lightning_accel"]
)


def _trainer(tmp_path, **kwargs) -> Trainer:
    return Trainer(
        default_root_dir=tmp_path,
        limit_val_batches=1,
        enable_model_summary=False,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        **kwargs,
    )


@BOTH
@pytest.mark.parametrize(
    ("scheduling", "expected_zero_grads"), [({1: 2, 3: 4}, 10 + 5 + 5 + 3), ({0: 2, 2: 1}, 5 + 5 + 10 + 10)]
)
def test_zero_grad_calls_follow_the_schedule(cls, tmp_path, scheduling, expected_zero_grads) -> None:
    """4 epochs of 10 batches: one zero_grad per optimizer step; epoch 3 of `{3: 4}` has 2 windows of 4 and one of 2."""
    with patch("torch.optim.SGD.zero_grad") as sgd_zero_grad:
        trainer = _trainer(tmp_path, limit_train_batches=10, max_epochs=4, callbacks=cls(dict(scheduling)))
        assert trainer.accumulate_grad_batches == 1  # the Trainer argument's initial value
        trainer.fit(BoringModel())
        assert sum(isinstance(cb, cls) for cb in trainer.callbacks) == 1
        assert sgd_zero_grad.call_count == expected_zero_grads


@pytest.mark.parametrize("accumulate_grad_batches", [1, 2, 3])
def test_constant_accumulation_matches_the_trainer_argument(tmp_path, accumulate_grad_batches: int) -> None:
    with patch("torch.optim.SGD.zero_grad") as sgd_zero_grad:
        trainer = _trainer(
            tmp_path,
            limit_train_batches=20,
            max_epochs=1,
            callbacks=AccumulationScheduler({0: accumulate_grad_batches}),
        )
        trainer.fit(BoringModel())
        assert sgd_zero_grad.call_count == math.ceil(20 / accumulate_grad_batches)


@BOTH
@pytest.mark.parametrize("scheduling", [{1: 2, -3: 4}, {0: 2, "x": 1}, {0: 2, 1.5: 1}])
def test_invalid_keys(cls, scheduling) -> None:
    with pytest.raises(MisconfigurationException, match="Epoch should be an int"):
        cls(scheduling=scheduling)


def test_string_digit_keys_are_read_as_numbers_a_deliberate_difference() -> None:
    """Lightning refuses `{0: 2, "2": 1}`; Hydra passes YAML/command-line keys as strings, so ours reads them."""
    with pytest.raises(MisconfigurationException, match="Epoch should be an int"):
        GradientAccumulationScheduler(scheduling={0: 2, "2": 1})
    assert AccumulationScheduler(scheduling={0: 2, "2": 1}).scheduling == {0: 2, 2: 1}


@BOTH
@pytest.mark.parametrize("scheduling", [{1: 0, 3: 4}, {0: 2, 2: "2"}])
def test_invalid_values(cls, scheduling) -> None:
    with pytest.raises(MisconfigurationException, match="Accumulation factor should be an int"):
        cls(scheduling=scheduling)


@BOTH
def test_an_empty_schedule_is_a_type_error(cls) -> None:
    with pytest.raises(TypeError):
        cls(scheduling={})


def test_our_errors_are_also_config_errors() -> None:
    with pytest.raises(ConfigError):
        AccumulationScheduler({-1: 2})
    with pytest.raises(ConfigError):
        AccumulationScheduler({})


@BOTH
def test_public_api(cls) -> None:
    callback = cls({4: 2, 8: 4})
    assert callback.scheduling == {0: 1, 4: 2, 8: 4}  # the implicit first epoch
    assert callback.epochs == [0, 4, 8]
    assert callback.going_to_accumulate_grad_batches()
    assert [callback.get_accumulate_grad_batches(e) for e in (0, 3, 4, 7, 8, 100)] == [1, 1, 2, 2, 4, 4]
    assert not cls({0: 1}).going_to_accumulate_grad_batches()


@BOTH
def test_unsupported_strategies(cls) -> None:
    """A strategy that fixes the accumulation factor itself (DeepSpeed) is refused when training starts."""
    scheduler = cls({1: 2})
    trainer = Trainer()
    trainer._accelerator_connector.strategy = Mock(spec=DeepSpeedStrategy)
    with pytest.raises(RuntimeError, match="does not support `accumulate_grad_batches` changing between epochs"):
        scheduler.on_train_start(trainer, BoringModel())


@BOTH
def test_unsupported_manual_optimization(cls) -> None:
    scheduler = cls({1: 2})
    model = BoringModel()
    model.automatic_optimization = False
    with pytest.raises(RuntimeError, match="Automatic gradient accumulation and the `GradientAccumulationScheduler`"):
        scheduler.on_train_start(Trainer(), model)


@BOTH
def test_warns_when_the_model_overrides_optimization_hooks(cls) -> None:
    class OverriddenOptimizerStep(BoringModel):
        def optimizer_step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            super().optimizer_step(*args, **kwargs)

    class OverriddenZeroGrad(BoringModel):
        def optimizer_zero_grad(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            super().optimizer_zero_grad(*args, **kwargs)

    scheduler = cls({1: 2})
    for model in (OverriddenOptimizerStep(), OverriddenZeroGrad()):
        with pytest.warns(UserWarning, match="the hooks will not be called on every batch"):
            scheduler.on_train_start(Trainer(), model)


@BOTH
def test_the_trainer_argument_and_the_callback_together_are_refused(cls, tmp_path) -> None:
    trainer = _trainer(tmp_path, accumulate_grad_batches=2, callbacks=[cls({0: 2})], max_steps=1)
    with pytest.raises(ValueError, match="`accumulate_grad_batches` and are using the `GradientAccumulationScheduler`"):
        trainer.fit(BoringModel())
