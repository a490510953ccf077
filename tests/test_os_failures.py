"""Every OS failure named: a full disk, a read-only directory, a file where a directory belongs, a directory
where a file belongs, permission denied. The error names the file, the operation and the errno in words, the exit
code is the documented one, and there is no traceback.

The path probe tries every file or directory option of accel-train, accel-tune, accel-bench and accel-doctor with a
file, a directory, a missing path and a read-only one: in process where a command has a `main(argv)`, with a few
subprocess runs for the exit code.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _env import clean_env
from _tools import REQUIRE_ENV

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


@pytest.mark.slow
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


# --- the path probe: every file or directory option with a file, a directory, a missing path and a read-only one ----

KINDS = ("file", "directory", "missing", "read-only")


@pytest.fixture(scope="module")
def read_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A read-only directory holding an empty directory `sub` and a checkpoint `last.ckpt`: a tmpfs mounted read-only
    where this process may mount one (root ignores permissions), else a directory without write permission."""
    folder = tmp_path_factory.mktemp("read-only")
    mount = shutil.which("mount") or "mount"
    as_root = os.geteuid() == 0
    if as_root and not (
        shutil.which(mount)
        and subprocess.run([mount, "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)]).returncode == 0
    ):
        reason = "root may write anywhere, and cannot mount a read-only file system here"
        if os.environ.get(REQUIRE_ENV) == "1":  # CI never passes by skipping the read-only cases
            pytest.fail(f"{reason}: {REQUIRE_ENV}=1 requires them to run", pytrace=False)
        pytest.skip(reason)
    (folder / "sub").mkdir()
    torch.save({"global_step": 1, "state_dict": {}}, folder / "last.ckpt")
    if as_root:
        subprocess.run([mount, "-o", "remount,ro", str(folder)], check=True)
    else:
        for path in (folder / "sub", folder):
            path.chmod(0o555)
    yield folder
    if as_root:
        subprocess.run(["umount", "-l", str(folder)], check=True)
    else:
        for path in (folder / "sub", folder):
            path.chmod(0o755)


def _path(kind: str, tmp_path: Path, read_only: Path) -> Path:
    """The path of `kind`: a file that exists, an empty directory, a path two levels below nothing, a read-only
    directory (for a checkpoint: a checkpoint file inside one)."""
    if kind == "file":
        (tmp_path / "a-file").write_text("not a directory\n")
        return tmp_path / "a-file"
    if kind == "directory":
        (tmp_path / "a-dir").mkdir(exist_ok=True)
        return tmp_path / "a-dir"
    if kind == "missing":
        return tmp_path / "missing" / "deeper"
    return read_only / "sub"


_REFUSED = {
    "file": ("File exists (EEXIST)", "Not a directory (ENOTDIR)"),  # the option's path, or a folder below it
    "read-only": ("Read-only file system (EROFS)", "Permission denied (EACCES)"),
}


def _refused_as(kind: str, message: str) -> None:
    """The OS's words and the errno's name, and for a file, that it is one."""
    assert any(words in message for words in _REFUSED[kind]), message
    assert kind != "file" or "is a file, not a directory" in message, message


TRAIN_DIRS = [
    ([], "callbacks.model_checkpoint.dirpath"),
    ([], "logger.csv.save_dir"),
    ([], "callbacks.nonfinite.dirpath"),
    ([], "callbacks.gpu_monitor.report_dir"),
    ([], "callbacks.gpu_monitor.runs_dir"),
    ([], "callbacks.gpu_monitor.prometheus_textfile_dir"),
    (["callbacks=[default,dataloader_tuner]"], "callbacks.dataloader_tuner.cache_dir"),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("extra", "key"), TRAIN_DIRS, ids=[key for _, key in TRAIN_DIRS])
def test_accel_train_directory_options(compose_train, tmp_path, read_only, extra, key: str, kind: str) -> None:
    """A logger's directory failed at the first step with a traceback; the callbacks' lost their output silently or
    late (a NaN checkpoint, the GPU report at the end, the heartbeats)."""
    from lightning_accel.errors import ConfigError
    from lightning_accel.train import plan_run

    path = _path(kind, tmp_path, read_only)
    cfg = compose_train([*SMOKE, *extra, f"{key}={path}"])
    if kind in ("directory", "missing"):
        plan_run(cfg)
        assert not (tmp_path / "missing").exists()  # nothing created before launch
        return
    with pytest.raises(ConfigError) as refused:
        plan_run(cfg)
    assert str(refused.value).startswith(f"`{key}={path}` cannot be written: "), refused.value
    _refused_as(kind, str(refused.value))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("key", ["hydra.run.dir", "paths.log_dir", "ACCEL_LOG_DIR"])
def test_accel_train_run_directory(tmp_path, read_only, key: str, kind: str) -> None:
    from lightning_accel.errors import ConfigError
    from lightning_accel.launch import check_output_root

    path = _path(kind, tmp_path, read_only)
    argv, env = ([], {"ACCEL_LOG_DIR": str(path)}) if key == "ACCEL_LOG_DIR" else ([f"{key}={path}"], {})
    if kind in ("directory", "missing"):
        check_output_root(argv, env)
        return
    with pytest.raises(ConfigError) as refused:
        check_output_root(argv, env)
    assert str(refused.value).startswith(f"`{key}={path}`: runs cannot be written under"), refused.value
    assert any(w in str(refused.value) for w in ("(EEXIST)", "(EROFS)", "(EACCES)")), refused.value


@pytest.mark.parametrize("kind", KINDS)
def test_accel_train_ckpt_path(compose_train, tmp_path, read_only, kind: str) -> None:
    """A checkpoint is read, not written: one in a read-only directory loads."""
    from lightning_accel.checks import check_ckpt_path
    from lightning_accel.errors import ConfigError

    path = read_only / "last.ckpt" if kind == "read-only" else _path(kind, tmp_path, read_only)
    cfg = compose_train([*SMOKE, f"ckpt_path={path}"])
    if kind == "read-only":
        assert check_ckpt_path(cfg) == str(path)
        return
    expected = {
        "file": "is not a checkpoint",
        "directory": "is a directory but not a distributed",
        "missing": "does not",
    }
    with pytest.raises(ConfigError, match=expected[kind]):
        check_ckpt_path(cfg)


class _Called(Exception):
    """The command got past its checks to the work itself (stubbed)."""


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("flag", ["--out", "--config-dir"])
def test_accel_tune_out_and_config_dir(tmp_path, read_only, monkeypatch, capsys, flag: str, kind: str) -> None:
    """`--out <a file>` ended in FileExistsError, `--config-dir <a file>` in NotADirectoryError after the whole
    search."""
    from lightning_accel import tune
    from lightning_accel.autotune import autopilot

    def search(*args: object, **kwargs: object) -> None:
        raise _Called

    monkeypatch.setattr(tune, "detect_space", lambda overrides, out: (None, "gpt"))
    monkeypatch.setattr(autopilot, "tune", search)
    path = _path(kind, tmp_path, read_only)
    other = "--config-dir" if flag == "--out" else "--out"
    argv = ["--quick", flag, str(path), other, str(tmp_path / "other"), "trainer.accelerator=cpu"]
    if kind in ("directory", "missing"):
        with pytest.raises(_Called):
            tune.main(argv)
        return
    assert tune.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"accel-tune: error: `{flag}={path}` cannot be written: "), err
    _refused_as(kind, err)


def test_accel_tune_a_directory_where_the_preset_file_goes(tmp_path, monkeypatch, capsys) -> None:
    from lightning_accel import tune

    monkeypatch.setattr(tune, "detect_space", lambda overrides, out: (None, "gpt"))
    (tmp_path / "conf" / "preset" / "tuned_gpt.yaml").mkdir(parents=True)
    argv = [
        "--quick",
        "--out",
        str(tmp_path / "out"),
        "--config-dir",
        str(tmp_path / "conf"),
        "trainer.accelerator=cpu",
    ]
    assert tune.main(argv) == 2
    err = capsys.readouterr().err
    assert f"cannot write preset {tmp_path / 'conf' / 'preset' / 'tuned_gpt.yaml'}: Is a directory (EISDIR)" in err


@pytest.mark.parametrize("kind", KINDS)
def test_accel_bench_out(tmp_path, read_only, monkeypatch, capsys, kind: str) -> None:
    from lightning_accel import bench, benchmark

    def stages(*args: object, **kwargs: object) -> None:
        raise _Called

    monkeypatch.setattr(benchmark, "run_bench", stages)
    path = _path(kind, tmp_path, read_only)
    argv = ["--quick", "--out", str(path), "--ladder", "baseline", "trainer.accelerator=cpu"]
    if kind in ("directory", "missing"):
        with pytest.raises(_Called):
            bench.main(argv)
        return
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"accel-bench: error: `--out={path}` cannot be written: "), err
    _refused_as(kind, err)


@pytest.mark.parametrize("kind", KINDS)
def test_accel_doctor_root(tmp_path, read_only, capsys, kind: str) -> None:
    """The root the facts are read under (hidden `--root`, `ACCEL_DOCTOR_ROOT`): read, never written."""
    from lightning_accel import doctor

    path = _path(kind, tmp_path, read_only)
    argv = ["--root", str(path), "--json", "--check", "cpus", "--check", "memory"]
    if kind in ("file", "missing"):
        with pytest.raises(SystemExit) as usage:
            doctor.main(argv, env={})
        assert usage.value.code == 2 and "is not a directory" in capsys.readouterr().err
        return
    assert doctor.main(argv, env={}) in (0, 1)  # an empty tree: every fact unknown, judged as such


@pytest.mark.parametrize("kind", KINDS)
def test_the_gpu_check_out(tmp_path, read_only, monkeypatch, capsys, kind: str) -> None:
    """A read-only `--out` failed after every part had run (minutes of GPU time), with a traceback."""
    from lightning_accel import gpu_check
    from lightning_accel.gpu_check import check_runner

    def parts(*args: object, **kwargs: object) -> None:
        raise _Called

    monkeypatch.setattr(check_runner, "run_checks", parts)  # where `main` looks it up
    path = _path(kind, tmp_path, read_only)
    if kind in ("directory", "missing"):
        with pytest.raises(_Called):
            gpu_check.main(["--out", str(path), "--parts", "doctor"])
        return
    with pytest.raises(SystemExit) as usage:
        gpu_check.main(["--out", str(path), "--parts", "doctor"])
    err = capsys.readouterr().err
    assert usage.value.code == 2 and f"--out {path} cannot be written: " in err, err
    _refused_as(kind, err)


@pytest.mark.slow
def test_the_exit_codes_from_the_command_line(tmp_path, read_only) -> None:
    """Two subprocess runs for the exit code and the absent traceback: `accel-tune --config-dir <a file>` and
    `accel-train logger.csv.save_dir=<read-only>`."""
    (tmp_path / "a-file").write_text("x")
    tuned = _run(
        [
            "--quick",
            "--config-dir",
            str(tmp_path / "a-file"),
            "--out",
            str(tmp_path / "out"),
            "trainer.accelerator=cpu",
        ],
        tmp_path,
        module="lightning_accel.tune",
    )
    assert tuned.returncode == 2 and "Traceback" not in tuned.stderr, tuned.stderr[-3000:]
    assert "`--config-dir=" in tuned.stderr and "Not a directory (ENOTDIR)" in tuned.stderr
    trained = _run([*SMOKE, f"logger.csv.save_dir={read_only / 'sub'}", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert trained.returncode == 2 and "Traceback" not in trained.stderr, trained.stderr[-3000:]
    assert f"accel-train: error: `logger.csv.save_dir={read_only / 'sub'}` cannot be written" in trained.stderr
