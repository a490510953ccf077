"""Real training jobs for the end-to-end tests: `accel-train` on this machine's CPUs, each with a fake NVML of two
H100s with GPM (`_fake_train`), publishing into a runs directory; started in a process group of their own so a test
can SIGKILL a whole DDP job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from _dash_server import TESTS
from _env import clean_env

# A small GPT on the standard library's text, paced by a slow "storage" (read_delay_ms per window), no test stage.
TINY = [
    "trainer.accelerator=cpu",
    "data.max_chars=100000",
    "data.block_size=32",
    "data.batch_size=8",
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "trainer.max_epochs=1000",
    "trainer.max_steps=100000",
    "trainer.val_check_interval=1.0",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=50",
    "trainer.enable_progress_bar=false",
    "test=false",
    "~callbacks.model_checkpoint",
    "~callbacks.model_summary",
    "callbacks.gpu_monitor.device_indices=[0,1]",
    "callbacks.gpu_monitor.interval_s=0.25",
    "callbacks.gpu_monitor.publish_interval_s=0.5",
]
DDP2 = ["strategy=ddp", "trainer.devices=2"]


@contextmanager
def job(
    cwd: Path, runs: Path, gpus: str, overrides: Sequence[str], env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """`accel-train TINY + overrides` with fake GPUs `GPU-<gpus>0...`, `GPU-<gpus>1...`; killed (the whole group) if
    it still runs at the end."""
    cwd.mkdir(parents=True, exist_ok=True)
    full_env = clean_env(
        PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        ACCEL_RUNS_DIR=str(runs),
        ACCEL_FAKE_GPUS=gpus,
        ACCEL_LOG_DIR=str(cwd / "outputs"),
        XDG_CACHE_HOME=str(cwd / "cache"),
        PYTHONFAULTHANDLER="1",
        **(env or {}),
    )
    log = open(cwd / "job.log", "w")  # noqa: SIM115 - closed below, after the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "_fake_train", *TINY, *overrides],
        cwd=cwd,
        env=full_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            kill(proc)
        log.close()


def kill(proc: subprocess.Popen[str], sig: int = signal.SIGKILL) -> None:
    """`sig` to the job's whole process group (every rank), and wait for its leader."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def log_of(cwd: Path) -> str:
    path = cwd / "job.log"
    return path.read_text()[-4000:] if path.exists() else ""
