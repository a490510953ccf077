"""A preset's DataLoader settings on a datamodule that does not take them (lightning-hydra-template's MNIST-style)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.compose import instantiate_datamodule, split_data_config
from lightning_accel.errors import ConfigError


class TemplateStyleDataModule(pl.LightningDataModule):
    """Like the template's MNISTDataModule: `batch_size`, `num_workers`, `pin_memory`, no `persistent_workers`."""

    def __init__(self, batch_size: int = 4, num_workers: int = 0, pin_memory: bool = False) -> None:
        super().__init__()
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, pin_memory

    def train_dataloader(self) -> DataLoader:
        data = TensorDataset(torch.arange(32.0).reshape(16, 2))
        return DataLoader(
            data, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers, pin_memory=self.pin_memory
        )

    def val_dataloader(self) -> list[DataLoader]:
        return [DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=self.batch_size)]


TARGET = f"{__name__}.TemplateStyleDataModule"


def test_settings_it_takes_go_to_its_constructor_the_others_to_its_loaders() -> None:
    """`preset=amp` sets `data.num_workers=2` and `data.persistent_workers=true`: a TypeError before."""
    datamodule = instantiate_datamodule(
        {"_target_": TARGET, "batch_size": 4, "num_workers": 2, "persistent_workers": True}
    )
    assert datamodule.num_workers == 2
    train = datamodule.train_dataloader()
    assert train.num_workers == 2 and train.persistent_workers and train.batch_size == 4
    assert isinstance(train.sampler, torch.utils.data.RandomSampler)  # shuffling kept
    (val,) = datamodule.val_dataloader()
    assert val.persistent_workers is False  # no workers there: persistent_workers does not apply
    assert sorted(next(iter(train))[0].shape) == [2, 4]


def test_a_setting_that_is_no_loader_argument_is_named_before_anything_is_built() -> None:
    with pytest.raises(ConfigError, match=r"`data.block_size=64` is not an argument of .*TemplateStyleDataModule"):
        split_data_config({"_target_": TARGET, "block_size": 64})


def test_a_datamodule_that_takes_them_gets_them_unchanged() -> None:
    taken, loader = split_data_config(
        {"_target_": "lightning_accel.examples.StdlibTextDataModule", "num_workers": 2, "persistent_workers": True}
    )
    assert loader == {} and taken["persistent_workers"] is True


def test_config_paths_names_the_config_path_of_a_constructor_argument() -> None:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from lightning_accel.compose import config_paths
    from lightning_accel.errors import ConfigError, ConfigTypeError

    strategy = {"_target_": "lightning_accel.strategies.ModelParallelStrategy", "tensor_parallel_size": 0}
    cfg = OmegaConf.create(
        {
            "trainer": {
                "_target_": "lightning.pytorch.Trainer",
                "accelerator": "cpu",
                "num_nodes": 1,
                "strategy": strategy,
            }
        }
    )
    with pytest.raises(ConfigError, match=r"^`trainer.strategy.tensor_parallel_size=0` must be a positive") as caught:
        with config_paths(cfg):
            instantiate(cfg.trainer)  # Hydra wraps the constructor's error; config_paths unwraps it
    assert caught.value.setting == "trainer.strategy.tensor_parallel_size"
    with pytest.raises(ConfigTypeError, match=r"^`trainer.num_nodes='x'` is wrong"):  # the class is kept
        with config_paths(cfg):
            raise ConfigTypeError("`num_nodes='x'` is wrong", setting="num_nodes")
    with pytest.raises(ConfigError, match=r"^`other=1` is not in the config$"):  # not set there: left as it is
        with config_paths(cfg):
            raise ConfigError("`other=1` is not in the config", setting="other")
    with pytest.raises(KeyError):  # not a user's mistake: untouched
        with config_paths(cfg):
            raise KeyError("x")


def test_a_schedule_error_names_its_config_path_and_at_is_idempotent() -> None:
    from omegaconf import OmegaConf

    from lightning_accel.compose import config_paths
    from lightning_accel.errors import ConfigError
    from lightning_accel.schedules import cosine_schedule

    cfg = OmegaConf.create({"trainer": {}, "scheduler": {"_target_": "x", "warmup_steps": 1.5}})
    with pytest.raises(ConfigError, match=r"^`scheduler.warmup_steps=1.5` as a fraction") as caught:
        with config_paths(cfg):
            cosine_schedule(
                torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), total_steps=10, warmup_steps=1.5
            )
    assert str(caught.value.at("scheduler")) == str(caught.value)  # already there: not prefixed twice
