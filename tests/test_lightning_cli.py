"""From LightningCLI: examples/cli.py with examples/cli.yaml (our callbacks, plugin and DDPStrategy) on 2 CPU ranks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _env import clean_env

ROOT = Path(__file__).resolve().parents[1]


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = clean_env()
    examples = ROOT / "examples"
    command = [
        sys.executable,
        str(examples / "cli.py"),
        "fit",
        "--config",
        str(examples / "cli.yaml"),
        f"--trainer.default_root_dir={tmp_path}",
        "--data.max_chars=200000",
        *args,
    ]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_cli_example_trains_on_two_ranks_with_our_callbacks_and_lightnings_timeout(tmp_path: Path) -> None:
    done = _cli(
        tmp_path,
        "--trainer.devices=2",
        "--trainer.max_steps=6",
        "--trainer.val_check_interval=3",
        "--trainer.limit_val_batches=1",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    last = next(tmp_path.rglob("last.ckpt"))
    state = torch.load(last, map_location="cpu", weights_only=True)
    assert state["global_step"] == 6
    assert any("AccumulationScheduler" in key for key in state["callbacks"])
    config = next(tmp_path.rglob("config.yaml")).read_text()
    assert "timeout: 1800" in config and "lightning_accel.callbacks.StopOnSignal" in config


@pytest.mark.slow  # the clash itself: tests/strategies/test_nccl.py, in process
def test_a_clash_of_lightnings_timeout_and_ours_is_named(tmp_path: Path) -> None:
    done = _cli(tmp_path, "--trainer.strategy.init_args.timeout_s=60", "--trainer.max_steps=1")
    assert done.returncode != 0
    assert "both set the collective timeout" in done.stderr
