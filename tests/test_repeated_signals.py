"""A user who insists: a second SIGINT or SIGTERM while the first is being handled still ends accel-train with 128 + N
once the checkpoint is written, a third ends it at once, and neither kills the process by the signal (exit -2).

One process each (tiny runs of the GPT example); the child's SIGINT is set to Python's default, as a terminal's is,
whatever the test runner inherited.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _env import clean_env
from _wait import wait_until

RUN = [
    "trainer=smoke",
    "trainer.accelerator=cpu",
    "data.max_chars=200000",
    "test=false",
    "callbacks.model_checkpoint.monitor=null",
    "callbacks.model_checkpoint.every_n_train_steps=5",
    "trainer.limit_val_batches=0",
    "trainer.max_steps=100000",
    "trainer.max_epochs=-1",
    "+callbacks.slow._target_=slowmod.SlowSave",
]

# `+callbacks.slow=...`: touches `ready` at a training batch past step 5 (its checkpoint saved), and makes the first
# save after step 5 (the stop's) touch `saving`, then take `seconds`, then touch `saved`.
_SLOW = """
import time
from pathlib import Path

import lightning.pytorch as pl


class SlowSave(pl.Callback):
    def __init__(self, folder, seconds):
        self.folder, self.seconds, self.slowed = Path(folder), seconds, False

    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step > 5:
            (self.folder / "ready").touch()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.global_step > 5 and not self.slowed:
            self.slowed = True
            (self.folder / "saving").touch()
            time.sleep(self.seconds)
            (self.folder / "saved").touch()
"""


def _start(tmp_path: Path, seconds: float) -> tuple[subprocess.Popen, Path]:
    (tmp_path / "slowmod.py").write_text(_SLOW)
    log = tmp_path / "log.txt"
    env = clean_env(PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    command = [
        sys.executable,
        "-m",
        "lightning_accel.train",
        *RUN,
        f"+callbacks.slow.folder={tmp_path}",
        f"+callbacks.slow.seconds={seconds}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(
            command,
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a terminal's Ctrl-C, not inherited
        )
    wait_until(
        lambda: (tmp_path / "ready").exists() or proc.poll() is not None,
        180,
        "a training step past step 5",
        detail=lambda: log.read_text()[-3000:],
    )
    assert proc.poll() is None, log.read_text()[-3000:]
    return proc, log


def _step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_two_sigints_0_3_s_apart_exit_130_not_by_the_signal(tmp_path: Path) -> None:
    """The first was handled (`last.ckpt` at the step), then the second killed the process by SIGINT (exit -2)."""
    proc, log = _start(tmp_path, seconds=0.0)
    try:
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: "every rank stops at global step" in log.read_text(), 60, "the stop")
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        _stop(proc)
    output = log.read_text()
    assert code == 130, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    stopped_at = int(output.split("every rank stops at global step ")[1].split()[0])
    assert _step(tmp_path / "run" / "checkpoints" / "last.ckpt") == stopped_at > 5


@pytest.mark.slow
def test_a_second_signal_during_the_save_is_said_and_the_exit_waits_for_the_checkpoint(tmp_path: Path) -> None:
    """It stopped at once without the checkpoint (a second Ctrl-C a second after the first: `KeyboardInterrupt`)."""
    proc, log = _start(tmp_path, seconds=4.0)
    try:
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: (tmp_path / "saving").exists(), 60, "the stop's save")
        time.sleep(1.2)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        _stop(proc)
    output = log.read_text()
    assert code == 130, output[-3000:]
    assert "SIGTERM again: the stop goes on and the process exits 130 once the checkpoint is written" in output
    assert (tmp_path / "saved").exists() and "Traceback" not in output, output[-3000:]
    assert _step(tmp_path / "run" / "checkpoints" / "last.ckpt") > 5


@pytest.mark.slow
def test_a_third_signal_ends_the_process_at_once_and_the_last_checkpoint_stands(tmp_path: Path) -> None:
    proc, log = _start(tmp_path, seconds=60.0)
    try:
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: (tmp_path / "saving").exists(), 60, "the stop's save")
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
        elapsed = time.monotonic() - sent
    finally:
        _stop(proc)
    output = log.read_text()
    assert code == 130 and elapsed < 10, (elapsed, output[-3000:])  # the save still had a minute to go
    assert "SIGINT a third time: ending at once with exit 130" in output, output[-3000:]
    assert not (tmp_path / "saved").exists()
    assert _step(tmp_path / "run" / "checkpoints" / "last.ckpt") == 5  # the step-5 checkpoint, whole
