"""patch_attribute: the one way to patch Lightning internals, and no patch outlives a fit that raised."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_accel.callbacks import AccumulationScheduler, NonFiniteGuard, Parallelize
from lightning_accel.patching import patch_attribute


class _Thing:
    def method(self) -> str:
        return "class"


def test_the_undo_restores_exactly_what_was_there() -> None:
    thing = _Thing()
    undo = patch_attribute(thing, "method", lambda: "patched")
    assert thing.method() == "patched"
    undo()
    undo()  # twice is harmless
    assert thing.method() == "class" and "method" not in thing.__dict__  # the class's method shows through again
    thing.method = lambda: "own"  # type: ignore[method-assign]
    undo = patch_attribute(thing, "method", lambda: "patched")
    undo()
    assert thing.method() == "own"


def test_a_missing_attribute_is_refused_with_the_version_and_the_reason() -> None:
    with pytest.raises(RuntimeError, match=r"`_Thing.nope` does not exist in this Lightning .*; the test needs it"):
        patch_attribute(_Thing(), "nope", 1, why="the test")


class _FailsMidEpoch(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == 5:
            raise RuntimeError("mid-epoch failure")
        return super().training_step(batch, batch_idx)


def test_no_loop_patch_remains_after_a_fit_that_raises_mid_epoch(tmp_path) -> None:
    """AccumulationScheduler's loop patches were undone only in teardown, which Lightning skips after an exception."""
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_epochs=1,
        limit_train_batches=10,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[AccumulationScheduler({0: 2})],
    )
    with pytest.raises(RuntimeError, match="mid-epoch failure"):
        trainer.fit(_FailsMidEpoch())
    epoch_loop = trainer.fit_loop.epoch_loop
    assert "_accumulated_batches_reached" not in epoch_loop.__dict__
    assert "_make_zero_grad_fn" not in epoch_loop.automatic_optimization.__dict__
    assert trainer.accumulate_grad_batches == 1


def test_no_patch_of_any_callback_remains_after_a_fit_that_raises_mid_epoch(tmp_path) -> None:
    """Every patching callback together (the loop, `configure_model`, `lr_scheduler_step`): none survives the error."""
    from _tiny import TinyRegression, tiny_loader

    class Fails(TinyRegression):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if batch_idx == 5:
                raise RuntimeError("mid-epoch failure")
            return super().training_step(batch, batch_idx)

    model = Fails(lr_decay=True)
    callbacks = [AccumulationScheduler({0: 2}), NonFiniteGuard(action="skip"), Parallelize()]
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    with pytest.raises(RuntimeError, match="mid-epoch failure"):
        trainer.fit(model, tiny_loader(64))
    assert model.training_steps == 5  # it did train, with the patches in place, before the error
    assert not {"configure_model", "lr_scheduler_step", "log", "log_dict"} & set(model.__dict__)
    assert "_accumulated_batches_reached" not in trainer.fit_loop.epoch_loop.__dict__


def test_hydra_safe_launch_puts_the_launchers_command_back_even_when_the_fit_raises() -> None:
    from importlib import import_module

    from lightning_accel._lightning import HYDRA_LAUNCHER_MODULES
    from lightning_accel.launch import child_rank_command, hydra_safe_launch

    modules = [import_module(name) for name in HYDRA_LAUNCHER_MODULES]
    before = [module._hydra_subprocess_cmd for module in modules]
    with pytest.raises(RuntimeError, match="in the fit"), hydra_safe_launch():
        assert all(module._hydra_subprocess_cmd is child_rank_command for module in modules)
        raise RuntimeError("in the fit")
    assert [module._hydra_subprocess_cmd for module in modules] == before
