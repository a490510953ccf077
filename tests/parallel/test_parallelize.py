"""The Parallelize callback on one process: argument checks, the configure_model it installs, its config node."""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from hydra.utils import instantiate
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import examples
from lightning_accel.callbacks.parallelize import Parallelize
from lightning_accel.checks import check_config
from lightning_accel.errors import ConfigError, LightningAccelWarning
from lightning_accel.parallel import BlockWrapPolicy
from lightning_accel.strategies import ModelParallelStrategy

GPTLanguageModel = examples.GPTLanguageModel

TINY = {"block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32}


class _Recorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(outputs["loss"].item())


def _fit(model: pl.LightningModule, *callbacks: pl.Callback) -> list[float]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (16, 17), generator=gen)
    recorder = _Recorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        callbacks=[*callbacks, recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(LeafSpec|num_workers|log_every_n_steps|val_dataloader).*")
        trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4))
    return recorder.losses


def _model() -> GPTLanguageModel:
    torch.manual_seed(0)
    return GPTLanguageModel(**TINY)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_classes": 3}, r"`block_classes=3` must be a list of classes or class names"),
        ({"tp_plan": ["*.q_proj"]}, r"`tp_plan=\['\*.q_proj'\]` must be a dict"),
        ({"activation_checkpointing": "yes"}, r"`activation_checkpointing='yes'` must be true or false"),
        ({"compile": True}, r"name the block class in `block_classes`"),
        ({"param_dtype": "bf16"}, r"`param_dtype='bf16'` is not a floating-point torch dtype"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Parallelize(**kwargs)


def test_picklable_and_stateless() -> None:
    callback = Parallelize(["Block"], {"*.attn.q_proj": "colwise"}, activation_checkpointing=True)
    assert pickle.loads(pickle.dumps(callback)).tp_plan == {"*.attn.q_proj": "colwise"}
    assert callback.state_dict() == {}
    assert Parallelize("Block").block_classes == ["Block"] and Parallelize(None).block_classes == []


@pytest.mark.slow
def test_single_device_fit_with_checkpointing_keeps_the_losses_and_restores_the_module() -> None:
    expected = _fit(_model())
    callback = Parallelize(["Block"], activation_checkpointing=True)
    model = _model()
    assert _fit(model, callback) == pytest.approx(expected, rel=1e-6)
    assert "configure_model" not in model.__dict__  # the hook it installed is gone after the fit
    assert all(getattr(block, "_lightning_accel_checkpointed", False) for block in model.blocks)
    assert _fit(model, callback) and _fit(_model(), callback)  # again: the same module, then a fresh one


def test_the_module_own_configure_model_runs_first_once() -> None:
    class Lazy(GPTLanguageModel):
        calls = 0

        def configure_model(self) -> None:
            type(self).calls += 1

    _fit(Lazy(**TINY), Parallelize(["Block"], activation_checkpointing=True))
    assert Lazy.calls == 1


def test_module_that_shards_itself_and_a_plan_is_an_error(one_rank_mesh) -> None:
    class ShardsItself(GPTLanguageModel):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            if not isinstance(self.lm_head, FSDPModule):
                fully_shard(self.lm_head, mesh=one_rank_mesh["data_parallel"])

    with pytest.raises(ConfigError, match=r"already shards the model .*drop the Parallelize callback"):
        _fit(model := ShardsItself(**TINY), Parallelize(["Block"]))
    assert "configure_model" not in model.__dict__  # removed after the failed fit too
    assert len(_fit(ShardsItself(**TINY), Parallelize())) == 3  # no plan: left as it is


def test_tensor_parallel_plan_without_a_mesh_warns() -> None:
    with pytest.warns(LightningAccelWarning, match="has no device mesh, so the tensor-parallel plan and FSDP2"):
        _fit(_model(), Parallelize(["Block"], {"*.attn.q_proj": "colwise"}))


def test_strategy_config_reads_the_model_plan(compose_train) -> None:
    cfg = compose_train(["strategy=model_parallel", "trainer.accelerator=cpu"])
    check_config(cfg)
    callback = instantiate(cfg.callbacks.parallelize)
    assert isinstance(callback, Parallelize) and callback.block_classes == ["Block"]
    assert len(callback.tp_plan) == 6 and callback.tp_plan["blocks.*.attn.out_proj"] == "rowwise"
    assert isinstance(instantiate(cfg.trainer.strategy), ModelParallelStrategy)
    assert "parallel_plan" not in cfg.model  # not a model argument
    classifier = compose_train(["strategy=model_parallel", "model=classifier"])
    assert instantiate(classifier.callbacks.parallelize).block_classes == []  # one FSDP unit: the whole model
    with pytest.raises(ConfigError, match="not supported by `strategy=model_parallel`"):
        check_config(compose_train(["strategy=model_parallel", "precision=fp16_mixed", "trainer.accelerator=cpu"]))


def test_fsdp_config_is_cuda_only_and_wraps_the_model_blocks(compose_train) -> None:
    cfg = compose_train(["strategy=fsdp"])
    assert cfg.trainer.strategy._target_ == "lightning.pytorch.strategies.FSDPStrategy"
    policy = instantiate(cfg.trainer.strategy.auto_wrap_policy)
    assert isinstance(policy, BlockWrapPolicy) and policy.block_classes == ["Block"]
    with pytest.raises(ConfigError, match="needs CUDA GPUs.*use `strategy=model_parallel`"):
        check_config(compose_train(["strategy=fsdp", "trainer.accelerator=cpu"]))
