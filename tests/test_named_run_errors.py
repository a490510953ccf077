"""Errors named where a raw one came from below: a payload in the HPC checkpoint a SLURM job resumes from
by itself, and a `training_step` whose output Lightning cannot train on."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _env import clean_env
from _tiny import TinyRegression, tiny_loader

from lightning_accel.errors import ConfigError
from lightning_accel.train import plan_run

SMOKE = ["trainer=smoke", "trainer.accelerator=cpu", "data.max_chars=200000", "test=false"]


# --- a payload in the HPC checkpoint a SLURM job resumes from by itself -----------------------------------------------

_SLURM = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0"}


def test_a_payload_in_the_hpc_checkpoint_of_slurm_auto_resume_is_named_before_launch(
    compose_train, tmp_path: Path, monkeypatch
) -> None:
    """Lightning loaded it itself and torch refused it with a raw UnpicklingError and its traceback."""
    for key, value in _SLURM.items():
        monkeypatch.setenv(key, value)
    cfg = compose_train([*SMOKE])
    torch.save({"global_step": 3}, tmp_path / "hpc_ckpt_1.ckpt")
    assert plan_run(cfg) is not None  # plain tensors and values: resumed as Lightning does
    torch.save({"global_step": 7, "payload": argparse.Namespace(run="code")}, tmp_path / "hpc_ckpt_2.ckpt")
    with pytest.raises(ConfigError) as refused:
        plan_run(cfg)
    message = str(refused.value)
    assert (
        f"the HPC checkpoint {tmp_path / 'hpc_ckpt_2.ckpt'}, which Lightning resumes from by itself under SLURM"
        in message
    )
    assert "holds objects that torch's `weights_only` load refuses" in message and "argparse.Namespace" in message
    assert f"move it out of {tmp_path}" in message
    monkeypatch.delenv("SLURM_NTASKS")
    plan_run(cfg)  # not under SLURM: Lightning does not look for it


# --- a training_step whose output Lightning cannot train on ----------------------------------------------------------


class _NoLoss(TinyRegression):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return {"acc": super().training_step(batch, batch_idx), "logits": None}


class _AList(TinyRegression):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return [super().training_step(batch, batch_idx)]


@pytest.mark.parametrize(
    ("model", "returned"),
    [
        (_NoLoss, "returned a dict with the keys ['acc', 'logits'] and no 'loss'"),
        (_AList, "returned a list ([tensor("),
    ],
    ids=["a-dict-without-loss", "a-list"],
)
def test_what_training_step_returned_is_named(compose_train, model: type, returned: str) -> None:
    from lightning_accel.checks import training_step_error
    from lightning_accel.errors import RunFailedError

    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    with pytest.raises(Exception) as raised:
        trainer.fit(model(), tiny_loader())
    named = training_step_error(raised.value, compose_train(SMOKE), trainer)
    assert isinstance(named, RunFailedError), raised.value
    assert str(named).startswith(
        f"`model._target_=lightning_accel.examples.GPTLanguageModel`: `training_step` {returned}"
    )
    assert "return the loss tensor, a dict holding it under 'loss'" in str(named)
    assert training_step_error(ValueError("something else"), compose_train(SMOKE), trainer) is None


_NO_LOSS = """
from lightning_accel.examples import GPTLanguageModel


class NoLoss(GPTLanguageModel):
    def training_step(self, batch, batch_idx):
        return {"train_loss": super().training_step(batch, batch_idx)}
"""


@pytest.mark.slow
def test_accel_train_names_a_training_step_without_loss_and_exits_1(tmp_path: Path) -> None:
    """A traceback ending in Lightning's MisconfigurationException, without what was returned."""
    (tmp_path / "nolossmod.py").write_text(_NO_LOSS)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_accel.train",
            *SMOKE,
            "model._target_=nolossmod.NoLoss",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])),
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (
        "accel-train: error: `model._target_=nolossmod.NoLoss`: `training_step` returned a dict with the keys "
        "['train_loss'] and no 'loss'"
    ) in done.stderr
