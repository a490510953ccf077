"""The search-path plugin: a user's own Hydra app selects this package's groups without copying a file."""

from __future__ import annotations

import json
import os
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from hydra.core.plugins import Plugins
from hydra.plugins.search_path_plugin import SearchPathPlugin

APP = '''
"""A user's own app: own config dir, own LightningModule, this package's presets through the plugin."""
import json

import hydra
import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.compose import instantiate_named


class Line(pl.LightningModule):  # learns y = 3x + 1
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg):
    pl.seed_everything(0)
    x = torch.rand(256, 1)
    loader = DataLoader(TensorDataset(x, 3 * x + 1), batch_size=16, shuffle=True, num_workers=cfg.data.num_workers,
                        persistent_workers=cfg.data.persistent_workers)
    model = Line()
    trainer = instantiate(cfg.trainer, callbacks=instantiate_named(cfg.callbacks))
    trainer.fit(model, loader)
    print("RESULT " + json.dumps({"precision": cfg.trainer.precision, "marker": cfg.get("marker"),
        "num_workers": cfg.data.num_workers, "callbacks": sorted(cfg.callbacks),
        "scheduler": OmegaConf.to_container(cfg.scheduler) if cfg.scheduler else None,
        "first_loss": model.losses[0], "last_loss": model.losses[-1]}))


if __name__ == "__main__":
    main()
'''

CONFIG = """
defaults:
  - _self_
  - precision: fp32
  - strategy: auto
  - accumulation: none
  - scheduler: none
  - callbacks: none
  - preset: null
trainer:
  _target_: lightning.pytorch.Trainer
  accelerator: cpu
  devices: 1
  max_epochs: 4
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
data:
  num_workers: 0
  persistent_workers: false
"""

# The user's own amp wins over the packaged one of the same name.
OWN_PRECISION = """
# @package _global_
trainer:
  precision: 32-true
marker: users-own-amp
"""


def _write_app(root: Path) -> None:
    (root / "conf" / "precision").mkdir(parents=True)
    (root / "app.py").write_text(APP)
    (root / "conf" / "config.yaml").write_text(textwrap.dedent(CONFIG))
    (root / "conf" / "precision" / "amp.yaml").write_text(OWN_PRECISION)


def _result(stdout: str) -> dict:
    line = next(line for line in stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_plugin_is_discovered_as_namespace_package() -> None:
    found = [f"{cls.__module__}.{cls.__name__}" for cls in Plugins.instance().discover(SearchPathPlugin)]
    assert "hydra_plugins.lightning_accel_searchpath.searchpath.LightningAccelSearchPathPlugin" in found


def test_plugin_entry_point_is_declared() -> None:
    declared = {ep.name: ep.value for ep in entry_points(group="hydra.plugins")}
    assert declared.get("lightning_accel_searchpath") == "hydra_plugins.lightning_accel_searchpath"


@pytest.mark.slow
def test_users_app_selects_packaged_presets_and_trains(tmp_path: Path, run_cli) -> None:
    import subprocess
    import sys

    _write_app(tmp_path)

    def app(*overrides: str) -> dict:
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}  # the DataLoaderTuner's decision cache
        result = subprocess.run(
            [sys.executable, "app.py", *overrides, "hydra.run.dir=run"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return _result(result.stdout)

    amp = app("preset=amp", "callbacks=[lr_monitor,model_summary]", "scheduler=onecycle", "trainer.logger=true")
    assert amp["num_workers"] == 2  # from the packaged amp preset
    assert amp["marker"] == "users-own-amp"  # the preset's `override /precision` took the user's file
    assert amp["precision"] == "32-true"
    assert amp["callbacks"] == ["dataloader_tuner", "lr_monitor", "model_summary"]  # the preset adds the tuner
    assert amp["scheduler"]["_target_"] == "lightning_accel.schedules.onecycle_schedule"
    assert amp["last_loss"] < amp["first_loss"] / 10

    baseline = app("preset=baseline", "precision=fp16_mixed")
    assert baseline["precision"] == "16-mixed" and baseline["marker"] is None and baseline["num_workers"] == 0


def test_accel_train_reads_its_tree_by_directory_and_the_plugin_adds_it_no_second_time(monkeypatch) -> None:
    """accel-train's tree is a directory on disk here (file source: `--help` answers sooner than through `pkg://`),
    and the plugin knows that directory as its own tree: it appends `pkg://lightning_accel.conf` once, for apps that
    do not already hold it."""
    import importlib.util

    from hydra._internal.config_search_path_impl import ConfigSearchPathImpl

    from hydra_plugins.lightning_accel_searchpath import searchpath
    from lightning_accel import train

    directory = train.config_path()
    assert os.path.isfile(os.path.join(directory, "train.yaml")), directory

    for main in (directory, f"file://{directory}", searchpath.PATH):
        path = ConfigSearchPathImpl()
        path.append(provider="main", path=main)
        searchpath.LightningAccelSearchPathPlugin().manipulate_search_path(path)
        assert [element.path for element in path.get_path()] == [main], main

    other = ConfigSearchPathImpl()
    other.append(provider="main", path=str(Path(directory).parent / "tests"))
    searchpath.LightningAccelSearchPathPlugin().manipulate_search_path(other)
    assert [element.path for element in other.get_path()][-1] == searchpath.PATH

    # a tree that is not a directory (a zipped install): the package, as before
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert train.config_path() == train.CONFIG_PACKAGE
