"""hydra_safe_launch and the child-rank command it gives Lightning's launcher."""

from __future__ import annotations

import importlib.machinery
import os
import sys

import pytest
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

import __main__
from lightning_accel import launch
from lightning_accel.launch import child_rank_command, hydra_safe_launch


def test_config_flags_are_kept_and_overrides_dropped() -> None:
    argv = ["-m", "a=1,2", "--config-name", "mine", "-cp=/x/conf", "--config-dir", "/extra", "b=3"]
    assert launch._config_flags(argv) == ["--config-name", "mine", "-cp=/x/conf", "--config-dir", "/extra"]


def test_child_command_is_the_job_in_run_mode(compose_train, monkeypatch, tmp_path) -> None:
    cfg = compose_train(["seed=2", "trainer.devices=2"])  # this job's own overrides
    OmegaConf.set_readonly(cfg.hydra, False)
    cfg.hydra.overrides.hydra = [
        "hydra.mode=MULTIRUN",
        "hydra.sweep.dir=/s",
        "hydra.job.chdir=false",
        "hydra/launcher=basic",
    ]
    HydraConfig.instance().set_config(cfg)
    monkeypatch.setattr(sys, "argv", ["/bin/app.py", "-m", "seed=1,2", "-cn", "train"])
    monkeypatch.setattr(__main__, "__spec__", None)  # a script, whether pytest runs as `pytest` or `python -m pytest`
    command, cwd = child_rank_command(local_rank=1)
    assert command[:2] == [sys.executable, "/bin/app.py"]
    assert command[2:] == [
        "-cn",
        "train",  # the primary config choice is kept
        "hydra.job.chdir=false",  # hydra overrides, less sweep/launcher/mode ones
        "seed=2",
        "trainer.devices=2",  # the job's overrides, not the sweep's
        f"hydra.run.dir='{tmp_path}'",
        "hydra.output_subdir=null",
        "hydra.job.name=train_rank1",
        "hydra.mode=RUN",
    ]
    assert cwd == os.getcwd()


def test_child_command_of_a_module_app_runs_the_module(compose_train, monkeypatch) -> None:
    compose_train(["seed=2"])
    monkeypatch.setattr(sys, "argv", ["/site/lightning_accel/train.py", "seed=2"])
    monkeypatch.setattr(__main__, "__spec__", importlib.machinery.ModuleSpec("lightning_accel.train", None))
    command, _ = child_rank_command(local_rank=1)
    assert command[:3] == [sys.executable, "-m", "lightning_accel.train"] and "seed=2" in command


def test_launch_environment_is_restored_and_lightning_unpatched(monkeypatch) -> None:
    from lightning.pytorch.strategies.launchers import subprocess_script

    original = subprocess_script._hydra_subprocess_cmd
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("MASTER_PORT", "1234")
    with hydra_safe_launch():
        assert subprocess_script._hydra_subprocess_cmd is child_rank_command
        os.environ["LOCAL_RANK"] = "0"  # what Lightning's launcher leaves behind
        os.environ["MASTER_PORT"] = "5555"
    assert "LOCAL_RANK" not in os.environ
    assert os.environ["MASTER_PORT"] == "1234"
    assert subprocess_script._hydra_subprocess_cmd is original


def _sleeper(seconds: float) -> None:
    import time

    time.sleep(seconds)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["popen", "multiprocessing"])
def test_waiting_for_child_ranks_takes_both_launchers_processes(kind: str) -> None:
    """`ddp` starts child ranks with Popen (`wait`), `ddp_spawn`/`ddp_fork` with multiprocessing (`join`): the
    template's `trainer=ddp_sim` (ddp_spawn) crashed after a finished fit with "'SpawnProcess' object has no attribute
    'wait'". A child still running past the timeout is killed."""
    import multiprocessing
    import subprocess
    import sys
    from types import SimpleNamespace

    from lightning_accel.launch import _wait_for_children

    if kind == "popen":
        done, stuck = (subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({s})"]) for s in (0, 60))
    else:
        ctx = multiprocessing.get_context("spawn")
        done, stuck = (ctx.Process(target=_sleeper, args=(s,)) for s in (0, 60))
        done.start()
        stuck.start()
    trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=SimpleNamespace(procs=[done, stuck])))
    _wait_for_children(trainer, timeout_s=5.0)  # type: ignore[arg-type]
    if kind == "popen":
        assert done.returncode == 0 and stuck.wait(timeout=10) == -9
    else:
        stuck.join(timeout=10)
        assert done.exitcode == 0 and stuck.exitcode == -9
