"""`check_app_config` in a Hydra app of the user's own, the smallest one: its trainer config asks for 2 devices, and
this package's `preset=ddp` sets `trainer.devices=auto` (1 process on a CPU). The user's count is kept, whatever
else the command line overrides. (The real lightning-hydra-template runs the same rules: tests/test_template_app.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _env import clean_env

APP = """
import json

import hydra
from omegaconf import OmegaConf

from lightning_accel.app_config import check_app_config


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg):
    warnings = check_app_config(cfg)
    print("RESULT", json.dumps({"devices": OmegaConf.to_container(cfg.trainer)["devices"], "warnings": warnings}))


main()
"""


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("app")
    (root / "configs" / "trainer").mkdir(parents=True)
    (root / "configs" / "train.yaml").write_text(
        "defaults:\n  - trainer: two\n  - precision: fp32\n  - strategy: auto\n  - preset: null\n  - _self_\n"
    )
    (root / "configs" / "trainer" / "two.yaml").write_text("accelerator: cpu\ndevices: 2\n")
    (root / "app.py").write_text(APP)
    return root


def _run(app: Path, tmp_path: Path, *overrides: str) -> dict:
    done = subprocess.run(
        [sys.executable, "app.py", f"hydra.run.dir={tmp_path / 'run'}", *overrides],
        cwd=app,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return {**json.loads(line.removeprefix("RESULT ")), "output": done.stdout + done.stderr}


@pytest.mark.parametrize(
    "extra",
    [
        [],
        # a key the preset brings: without the preset it has nothing to override, and the devices check composing
        # the app without the preset failed on it and was skipped (the preset's `auto` won, 1 process)
        ["callbacks.dataloader_tuner.max_tuning_time_s=10"],
        ["callbacks.dataloader_tuner.steps_per_trial=4", "data.num_workers=1"],
    ],
    ids=["alone", "a-preset-callback-override", "two-preset-keys"],
)
def test_your_device_count_is_kept_over_a_presets_auto(app: Path, tmp_path: Path, extra: list[str]) -> None:
    result = _run(app, tmp_path, "preset=ddp", *extra)
    assert result["devices"] == 2, result["output"][-3000:]
    assert "your trainer config's `trainer.devices=2` is kept" in result["output"]
    assert result["warnings"] == []


def test_the_command_lines_device_count_wins(app: Path, tmp_path: Path) -> None:
    result = _run(app, tmp_path, "preset=ddp", "trainer.devices=3", "callbacks.dataloader_tuner.max_tuning_time_s=10")
    assert result["devices"] == 3 and "is kept" not in result["output"]
