"""Every OS failure named (issue 37): a full disk, a read-only directory, a file where a directory belongs, a directory
where a file belongs, permission denied. The error names the file, the operation and the errno in words, the exit
code is the documented one, and there is no traceback.

The path probe tries every file or directory option of accel-train, accel-tune, accel-bench and accel-doctor with a
file, a directory, a missing path and a read-only one: in process where a command has a `main(argv)`, with a few
subprocess runs for the exit code.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from _env import clean_env

SMOKE = ["trainer=smoke", "trainer.accelerator=cpu", "data.max_chars=200000", "test=false"]


def _run(args: list[str], cwd: Path, module: str = "lightning_accel.train", **env: str) -> subprocess.CompletedProcess:
    pythonpath = os.pathsep.join([str(cwd), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(PYTHONPATH=pythonpath, **env),
    )


# A callback for `+callbacks.fill=...`: from global step `after` on, every file opened for writing under `folder`
# fails with ENOSPC past its first 128 bytes, as on a full disk (the same on any machine: no mount needed).
_FILL = """
import errno
import os
from pathlib import Path

import lightning.pytorch as pl


class Full:
    def __init__(self, handle):
        self.handle, self.left = handle, 128

    def write(self, data):
        size = memoryview(data).nbytes
        if size > self.left:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.left -= size
        return self.handle.write(data)

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.close()


class FillDisk(pl.Callback):
    def __init__(self, folder, after):
        self.folder, self.after, self.filled = Path(folder), after, False

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.after and not self.filled:
            self.filled, real, folder = True, Path.open, self.folder

            def full_open(path, mode="r", *args, **kwargs):
                handle = real(path, mode, *args, **kwargs)
                return Full(handle) if "w" in mode and path.is_relative_to(folder) else handle

            Path.open = full_open
"""


def test_a_disk_that_fills_during_training_is_named_with_the_checkpoint_that_stands(tmp_path: Path) -> None:
    """It ended in a traceback saying "unexpected pos 128 vs 0", never "No space left on device" nor which file."""
    (tmp_path / "fillmod.py").write_text(_FILL)
    run = tmp_path / "run"
    done = _run(
        [
            *SMOKE,
            "callbacks.model_checkpoint.monitor=null",
            "callbacks.model_checkpoint.every_n_train_steps=5",
            "trainer.max_steps=12",
            "trainer.limit_val_batches=0",
            "+callbacks.fill._target_=fillmod.FillDisk",
            f"+callbacks.fill.folder={run / 'checkpoints'}",
            "+callbacks.fill.after=6",
            f"hydra.run.dir={run}",
        ],
        tmp_path,
    )
    last = run / "checkpoints" / "last.ckpt"
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "accel-train: error: rank 0 failed at global step 10: cannot write checkpoint " in done.stderr
    assert "No space left on device (ENOSPC)" in done.stderr
    assert f"{last} (global step 5) still stands" in done.stderr
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 5
    assert not list(last.parent.glob(".*.tmp"))
