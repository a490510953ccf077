"""SIGKILL in the middle of a checkpoint save (a file, and a pipeline's distributed-checkpoint directory): the previous
`last.ckpt` stays whole and the run resumes from it. Full disks are covered by the seams in tests/strategies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from _env import clean_env

from lightning_accel.strategies import consolidate_checkpoint

_KILLER = '''
import contextlib
import os
import signal

import lightning.pytorch as pl


class KillDuringSave(pl.Callback):
    """On global rank `rank`, the `at`-th save of last.ckpt writes part of its data, then this process gets SIGKILL."""

    def __init__(self, rank: int = 0, at: int = 2) -> None:
        self.rank, self.at, self.seen = rank, at, 0

    def setup(self, trainer, pl_module, stage):
        if trainer.global_rank != self.rank:
            return
        import torch
        import torch.distributed.checkpoint as dcp

        def wrap(real, target_of, counts, half):
            def save(*args, **kwargs):
                if counts(str(target_of(*args, **kwargs))):
                    self.seen += 1
                    if self.seen == self.at:
                        half(*args, **kwargs)
                        os.kill(os.getpid(), signal.SIGKILL)
                return real(*args, **kwargs)
            return save

        def file_target(obj, f, *a, **k):
            name = getattr(f, "name", f)  # os.fdopen's handle is named by its descriptor
            if isinstance(name, int):
                return os.readlink(f"/proc/self/fd/{name}")
            # a buffer (distributed checkpoint's planner torch.saves each object into a BytesIO) is no file
            return os.fspath(name) if isinstance(name, (str, bytes, os.PathLike)) else ""

        def file_half(obj, f, *a, **k):  # torch.save takes a path or an open file
            with open(f, "wb") if isinstance(f, (str, os.PathLike)) else contextlib.nullcontext(f) as out:
                out.write(b"PK\\x03\\x04 half a checkpoint")
                out.flush()

        def dir_target(state, checkpoint_id=None, **k):
            return checkpoint_id

        def dir_half(state, checkpoint_id=None, **k):
            with open(os.path.join(str(checkpoint_id), "__0_0.distcp"), "wb") as f:
                f.write(b"half a shard")

        # a file checkpoint: torch.save into `.last.ckpt.<id>.tmp`; a pipeline one: dcp.save into
        # `.last.ckpt.saving-<id>` (its meta.pt, written there too, is not counted)
        torch.save = wrap(torch.save, file_target, lambda t: "last.ckpt" in t and ".saving-" not in t, file_half)
        dcp.save = wrap(dcp.save, dir_target, lambda t: "last.ckpt.saving-" in t, dir_half)
'''

COMMON = [
    "trainer.accelerator=cpu",
    "data.max_chars=200000",
    "test=false",
    "trainer.limit_val_batches=0",
    "callbacks.model_checkpoint.monitor=null",
    "callbacks.model_checkpoint.save_top_k=0",
    "callbacks.model_checkpoint.every_n_train_steps=5",
    "trainer.max_epochs=-1",
]


def _env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "killmod.py").write_text(_KILLER)
    env = clean_env()
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    return env


def _killed_run(tmp_path: Path, args: list[str], killed_rank: int = 0) -> Path:
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "lightning_accel.train",
        *COMMON,
        *args,
        "trainer.max_steps=1000",
        "+callbacks.killer._target_=killmod.KillDuringSave",
        f"hydra.run.dir={run_dir}",
    ]
    with (tmp_path / "log.txt").open("w") as log:
        proc = subprocess.Popen(
            command, cwd=tmp_path, env=_env(tmp_path), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=240)
        finally:
            survivors = [p for p in psutil.process_iter() if _in_group(p, proc.pid)]
            for p in survivors:  # a rank left waiting on the killed one: what a scheduler would clean up
                p.kill()
            psutil.wait_procs(survivors, timeout=30)
    # rank 0 killed: the run's exit is the kill; rank 1 killed: rank 0 fails on the closed connection
    assert code == -signal.SIGKILL if killed_rank == 0 else code not in (0, None), (tmp_path / "log.txt").read_text()[
        -3000:
    ]
    return run_dir / "checkpoints" / "last.ckpt"


def _in_group(process: psutil.Process, pgid: int) -> bool:
    try:
        return os.getpgid(process.pid) == pgid
    except (ProcessLookupError, psutil.Error):
        return False


def _resume(tmp_path: Path, args: list[str], last: Path, steps: int) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_accel.train",
            *COMMON,
            *args,
            f"trainer.max_steps={steps}",
            f"ckpt_path={last}",
            f"hydra.run.dir={tmp_path / 'resumed'}",
        ],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow  # ~20 s; the atomic save is tested in process by default
def test_sigkill_while_saving_a_checkpoint_file_leaves_the_previous_one_which_resumes(tmp_path: Path) -> None:
    args = ["trainer=smoke"]
    last = _killed_run(tmp_path, args)
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 5  # the save at step 10 died
    assert not [p for p in last.parent.iterdir() if p.suffix == ".ckpt" and p != last]
    _resume(tmp_path, args, last, steps=7)
    resumed = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert resumed["global_step"] == 7


@pytest.mark.slow  # ~20-40 s each on 2 cores; the file format runs by default
@pytest.mark.parametrize("rank", [0, 1])
def test_sigkill_while_saving_a_pipeline_checkpoint_leaves_the_previous_one_which_resumes(
    tmp_path: Path, rank: int
) -> None:
    args = ["trainer=smoke", "preset=pipeline", "trainer.devices=2"]
    last = _killed_run(tmp_path, [*args, f"+callbacks.killer.rank={rank}"], killed_rank=rank)
    assert torch.load(last / "meta.pt", map_location="cpu", weights_only=True)["global_step"] == 5
    assert consolidate_checkpoint(last)  # every shard of the step-5 save is there
    _resume(tmp_path, args, last, steps=7)
    resumed = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=True)
    assert resumed["global_step"] == 7
