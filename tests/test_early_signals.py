"""SIGTERM before the training loop: during the DataLoaderTuner's trials, during MicroBatchFinder's sizing (its first
batch: the point named "search"), before the first step and during compile. Every rank of a 2-rank accel-train ends
non-zero within 30 s.

A marker callback (first in the callbacks, by its name) prints `PHASE <name>` when the phase begins; the test sends
SIGTERM to rank 0 (which forwards it to the rank it started) once the phase runs. Before the fix the signal came
before StopOnSignal's handler: during the tuner's trials rank 0 died of the signal itself and rank 1 with a gloo
traceback (once in 10 it stayed alive for minutes); during the search a single process exited 0 with no checkpoint.

`-m slow` runs each point once; `tests/benchmarks/bench_signal_matrix.py --early` runs each 10 times.
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
from _env import clean_env
from _wait import wait_until

DEADLINE_S = 30.0
BASE = [
    "trainer=smoke",
    "trainer.accelerator=cpu",
    "data.max_chars=200000",
    "strategy=ddp",
    "trainer.devices=2",
    "test=false",
    "trainer.max_steps=100000",
    "trainer.max_epochs=-1",
    "trainer.limit_val_batches=0",
    "+callbacks.aaa_phase._target_=phasemod.Phase",
]

_PHASE_CALLBACK = """
import sys

import lightning.pytorch as pl


class Phase(pl.Callback):
    def _say(self, trainer, phase):
        if trainer.is_global_zero:
            print(f"PHASE {phase}", file=sys.stderr, flush=True)

    def on_fit_start(self, trainer, pl_module):  # the DataLoaderTuner's trials follow, in its on_fit_start
        self._say(trainer, "fit_start")

    def on_train_start(self, trainer, pl_module):  # MicroBatchFinder's sizing follows, in the first batch
        self._say(trainer, "train_start")
"""

POINTS = {
    # (overrides, the marker, seconds to wait after it: inside the phase)
    "tuner": (
        [
            "'callbacks=[default,dataloader_tuner]'",
            "++callbacks.dataloader_tuner.max_tuning_time_s=60",
            "++callbacks.dataloader_tuner.use_cache=false",
        ],
        "fit_start",
        3.0,
    ),
    "search": (["micro_batch=auto", "data.batch_size=256"], "train_start", 0.5),
    "first_step": ([], "train_start", 0.0),
    "compile": (["compile=default"], "train_start", 3.0),
}


def interrupt_at(tmp_path: Path, point: str) -> tuple[float, int, str]:
    """Start a 2-rank run, SIGTERM rank 0 inside `point`; (seconds until every rank ended, rank 0's exit, log)."""
    overrides, marker, delay = POINTS[point]
    (tmp_path / "phasemod.py").write_text(_PHASE_CALLBACK)
    env = clean_env(PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    command = [
        sys.executable,
        "-m",
        "lightning_accel.train",
        *BASE,
        *[o.strip("'") for o in overrides],
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    log_path = tmp_path / "log.txt"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            wait_until(
                lambda: f"PHASE {marker}" in log_path.read_text() or proc.poll() is not None,
                240,
                f"the phase {marker}",
                detail=lambda: log_path.read_text()[-3000:],
            )
            assert proc.poll() is None, log_path.read_text()[-3000:]
            time.sleep(delay)
            ranks = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            ranks = [p for p in ranks if "lightning_accel.train" in " ".join(p.cmdline())]
            sent = time.monotonic()
            os.kill(proc.pid, signal.SIGTERM)
            gone, alive = psutil.wait_procs(ranks, timeout=DEADLINE_S + 30)
            elapsed = time.monotonic() - sent
            assert not alive, f"{point}: ranks {[p.pid for p in alive]} still run {elapsed:.0f} s after SIGTERM"
            code = next(p.returncode for p in gone if p.pid == proc.pid)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return elapsed, code, log_path.read_text()


@pytest.mark.slow  # ~25 s; signals during training run by default (test_train_signals.py)
def test_sigterm_during_the_dataloader_tuners_trials_ends_every_rank(tmp_path: Path) -> None:
    elapsed, code, log = interrupt_at(tmp_path, "tuner")
    print(f"tuner: every rank ended {elapsed:.1f} s after SIGTERM, exit {code}")
    assert code == 128 + signal.SIGTERM, log[-3000:]
    assert elapsed < DEADLINE_S + 15  # the -m slow matrix holds it to 30 s on a quiet machine


@pytest.mark.slow
@pytest.mark.parametrize("point", list(POINTS))
def test_sigterm_at_each_point_ends_every_rank(tmp_path: Path, point: str) -> None:
    """Each point once; `tests/benchmarks/bench_signal_matrix.py --early` runs each 10 times (the table of
    examples/runs_and_signals.md)."""
    elapsed, code, log = interrupt_at(tmp_path, point)
    assert code != 0 and elapsed < DEADLINE_S, (point, elapsed, code, log[-2000:])
