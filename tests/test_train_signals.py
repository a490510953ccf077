"""Signals to a 2-rank DDP accel-train: every rank ends, with exit 128 + N, and last.ckpt resumes.

`pytest -m slow tests/test_train_signals.py` runs the matrix once: SIGTERM and SIGINT to rank 0 only, to rank 1 only
and to the whole group, every rank ended within 30 s. `tests/benchmarks/bench_signal_matrix.py` runs it 10 times.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from _env import clean_env
from _wait import wait_until

SMOKE = [
    "trainer=smoke",
    "trainer.accelerator=cpu",
    "data.max_chars=200000",
    "strategy=ddp",
    "trainer.devices=2",
    "test=false",
    "callbacks.model_checkpoint.monitor=null",
    "callbacks.model_checkpoint.every_n_train_steps=5",
    "trainer.val_check_interval=1000000",
    "trainer.limit_val_batches=0",
]
DEADLINE_S = 30.0


# A callback the run under test gets through `+callbacks.ready=...`: rank 0 touches `path` at the start of the first
# training batch after global step `after` (a training step in flight, the checkpoint of step `after` saved).
_READY_CALLBACK = """
from pathlib import Path

import lightning.pytorch as pl


class Ready(pl.Callback):
    def __init__(self, path: str, after: int) -> None:
        self.path, self.after = Path(path), after

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.is_global_zero and trainer.global_step > self.after and not self.path.exists():
            self.path.touch()
"""


def _env() -> dict[str, str]:
    return clean_env(PYTHONUNBUFFERED="1")


def _alive(proc: subprocess.Popen, log: Path | None = None) -> bool:
    """True; an AssertionError (with the log's tail) once `proc` has exited."""
    assert proc.poll() is None, f"accel-train exited early with {proc.returncode}" + (
        f":\n{log.read_text()[-3000:]}" if log is not None else ""
    )
    return True


def _ranks(proc: subprocess.Popen, timeout: float = 120.0) -> list[psutil.Process]:
    """Rank 0 (the process started) and the child rank it launched, once both run."""

    def child() -> psutil.Process | None:
        _alive(proc)
        ranks = [c for c in psutil.Process(proc.pid).children() if "lightning_accel.train" in " ".join(c.cmdline())]
        return ranks[0] if ranks else None

    return [psutil.Process(proc.pid), wait_until(child, timeout, "the child rank to start")]


def interrupt_once(tmp_path: Path, signum: int, target: str) -> tuple[float, int, int]:
    """Start a long DDP run, wait until it trains past its first checkpoint, send `signum` to `target` (rank0, rank1,
    group).

    Returns (seconds until every rank ended, rank 0's exit code, the global step in last.ckpt).
    """
    run_dir, ready = tmp_path / "run", tmp_path / "ready"
    (tmp_path / "readymod.py").write_text(_READY_CALLBACK)
    command = [
        sys.executable,
        "-m",
        "lightning_accel.train",
        *SMOKE,
        "trainer.max_steps=100000",
        "+callbacks.ready._target_=readymod.Ready",
        f"+callbacks.ready.path={ready}",
        "+callbacks.ready.after=5",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    log = (tmp_path / "log.txt").open("w")
    proc = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    last = run_dir / "checkpoints" / "last.ckpt"
    try:
        ranks = _ranks(proc)
        wait_until(
            lambda: _alive(proc, tmp_path / "log.txt") and ready.exists(),
            180,
            "a training step past the first checkpoint (step 5)",
            detail=lambda: (tmp_path / "log.txt").read_text()[-3000:],
        )
        assert last.exists()
        sent = time.monotonic()
        if target == "group":
            os.killpg(proc.pid, signum)
        else:
            ranks[0 if target == "rank0" else 1].send_signal(signum)
        gone, alive = psutil.wait_procs(ranks, timeout=DEADLINE_S + 30)
        elapsed = time.monotonic() - sent
        assert not alive, f"ranks {[p.pid for p in alive]} still run {elapsed:.0f} s after {signum} to {target}"
        code = next(p.returncode for p in gone if p.pid == proc.pid)  # psutil reaped it: Popen.wait would say 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    step = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
    return elapsed, code, step


def _resume(tmp_path: Path, step: int) -> None:
    """Resume from last.ckpt to the next multiple of 5 (where the checkpoint callback saves again)."""
    run_dir = tmp_path / "run"
    last = run_dir / "checkpoints" / "last.ckpt"
    target = (step // 5 + 1) * 5
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_accel.train",
            *SMOKE,
            f"trainer.max_steps={target}",
            f"ckpt_path={last}",
            f"hydra.run.dir={tmp_path / 'resumed'}",
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert resumed["global_step"] == target
    assert f"Restoring states from the checkpoint path at {last}" in done.stdout + done.stderr


MATRIX = [(s, t) for s in (signal.SIGTERM, signal.SIGINT) for t in ("rank0", "rank1", "group")]


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "target"), MATRIX, ids=[f"{s.name}-{t}" for s, t in MATRIX])
def test_signal_matrix(tmp_path, signum, target) -> None:
    """Each case of the matrix once, within the deadline; `tests/benchmarks/bench_signal_matrix.py` runs each 10
    times and prints the table of examples/runs_and_signals.md."""
    elapsed, code, step = interrupt_once(tmp_path, signum, target)  # every rank ended, or it fails
    print(f"{signum.name} to {target}: every rank ended in {elapsed:.1f} s, exit {code}, last.ckpt at step {step}")
    log = (tmp_path / "log.txt").read_text()
    assert elapsed < DEADLINE_S and code == 128 + signum, (elapsed, code, log[-3000:])
    assert "every rank stops at global step" in log
    _resume(tmp_path, step)


def _slurm_env(tmp_path: Path) -> dict[str, str]:
    """One SLURM task of job 4242, step 0, with an `scontrol` on PATH that records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NAME": "train",
        "SLURM_NODELIST": "localhost",
    }
    env = {**_env(), **slurm, "ACCEL_LOG_DIR": str(tmp_path / "outputs")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env


@pytest.mark.slow  # ~20 s; SIGTERM to a DDP rank runs by default
def test_slurm_requeue_signal_saves_the_hpc_checkpoint_requeues_and_the_requeued_job_resumes(tmp_path) -> None:
    """SIGUSR1 (what accel_slurm asks SLURM to send before the time limit) to a SLURM task: Lightning's HPC checkpoint
    in the run directory `slurm-4242.0`, `scontrol requeue 4242`, exit 138; the requeued job, same job and step ids,
    finds that directory and resumes from the checkpoint."""
    single = [
        "trainer=smoke",
        "trainer.accelerator=cpu",
        "data.max_chars=200000",
        "test=false",
        "callbacks.model_checkpoint.monitor=null",
        "callbacks.model_checkpoint.every_n_train_steps=5",
        "trainer.limit_val_batches=0",
    ]
    env = _slurm_env(tmp_path)
    run_dir = tmp_path / "outputs" / "runs" / "slurm-4242.0"
    command = [sys.executable, "-m", "lightning_accel.train", *single]
    with (tmp_path / "log.txt").open("w") as log:
        proc = subprocess.Popen(
            [*command, "trainer.max_steps=100000", "trainer.max_epochs=-1"],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        wait_until(
            lambda: _alive(proc, tmp_path / "log.txt") and (run_dir / "checkpoints" / "last.ckpt").exists(),
            180,
            "the first checkpoint",
            detail=lambda: (tmp_path / "log.txt").read_text()[-3000:],
        )
        proc.send_signal(signal.SIGUSR1)
        code = proc.wait(timeout=60)
    output = (tmp_path / "log.txt").read_text()
    assert code == 128 + signal.SIGUSR1, output[-3000:]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    hpc = torch.load(run_dir / "hpc_ckpt_1.ckpt", map_location="cpu", weights_only=True)
    step = hpc["global_step"]
    assert step >= 5

    env["SLURM_RESTART_COUNT"] = "1"
    done = subprocess.run(
        [*command, f"trainer.max_steps={step + 2}", "trainer.max_epochs=-1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hpc_ckpt_1.ckpt" in done.stdout + done.stderr  # Lightning: "Restoring states from the checkpoint path at"
    final = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert final["global_step"] == step + 2
