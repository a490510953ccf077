"""AtomicCheckpointIO: a save that fails half-way leaves the previous checkpoint, and no stray file."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_accel.strategies import AtomicCheckpointIO, atomic_torch_save


def _full_disk(obj: Any, file: Any) -> None:
    file.write(b"PK\x03\x04 half a checkpoint")  # what a full disk leaves: the start of a zip archive
    raise OSError(28, "No space left on device")


def test_a_save_on_a_full_disk_leaves_the_old_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "checkpoints" / "last.ckpt"
    atomic_torch_save({"step": 1}, path)
    monkeypatch.setattr(torch, "save", _full_disk)
    with pytest.raises(OSError, match="No space"):
        atomic_torch_save({"step": 2}, path)
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]  # no temporary file left behind


def test_lightnings_own_save_leaves_a_truncated_file_and_the_plugin_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    def half(checkpoint: dict[str, Any], filepath: Any) -> None:  # Lightning's write, cut by a full disk
        Path(filepath).write_bytes(b"PK\x03\x04 half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("lightning.fabric.plugins.io.torch_io._atomic_save", half)
    plain = tmp_path / "plain.ckpt"
    with pytest.raises(OSError):
        TorchCheckpointIO().save_checkpoint({"step": 1}, plain)
    assert plain.exists()  # what the probe found: a file that looks like a checkpoint
    atomic = tmp_path / "atomic.ckpt"
    monkeypatch.setattr(torch, "save", _full_disk)
    with pytest.raises(OSError):
        AtomicCheckpointIO().save_checkpoint({"step": 1}, atomic)
    assert not atomic.exists() and list(tmp_path.iterdir()) == [plain]


def test_a_trainer_with_the_plugin_saves_and_resumes(tmp_path: Path) -> None:
    trainer = pl.Trainer(
        max_steps=2,
        plugins=[AtomicCheckpointIO()],
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())
    saved = list((tmp_path / "checkpoints").glob("*.ckpt"))
    assert len(saved) == 1
    resumed = pl.Trainer(
        max_steps=3,
        plugins=[AtomicCheckpointIO()],
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    resumed.fit(BoringModel(), ckpt_path=saved[0])
    assert resumed.global_step == 3


def test_the_default_trainer_config_uses_it(compose_train) -> None:
    from hydra.utils import instantiate

    cfg = compose_train([])
    assert [type(instantiate(p)) for p in cfg.trainer.plugins] == [AtomicCheckpointIO]


def _dir(path: Path, text: str) -> Path:
    path.mkdir()
    (path / "shard").write_text(text)
    return path


def test_replace_directory_swaps_in_one_step_where_the_file_system_can(tmp_path: Path, monkeypatch) -> None:
    """With renameat2(RENAME_EXCHANGE) the target never stops existing: no plain rename runs at all."""
    import os

    from lightning_accel.strategies import checkpoint_io

    a, b = _dir(tmp_path / "a", "a"), _dir(tmp_path / "b", "b")
    can_exchange = checkpoint_io._exchange(a, b)  # this file system (tmpfs, ext4, xfs, btrfs can; some cannot)
    assert (a / "shard").read_text() == ("b" if can_exchange else "a")
    last, new = _dir(tmp_path / "last.ckpt", "old"), _dir(tmp_path / ".last.ckpt.saving-1", "new")
    renames: list[tuple[str, str]] = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: renames.append((str(a), str(b))) or real_replace(a, b))
    checkpoint_io.replace_directory(new, last)
    assert (last / "shard").read_text() == "new" and not new.exists()
    assert len(renames) == (0 if can_exchange else 2), renames  # one step, or the recoverable two-rename fallback


def test_a_kill_between_the_fallback_renames_is_recovered(tmp_path: Path, monkeypatch) -> None:
    """Where no exchange exists (another OS, a network file system): a kill after the old one was moved aside leaves
    `.last.ckpt.old-<id>`; the next save or load moves it back, and stale staging directories are removed."""
    from lightning_accel.strategies import checkpoint_io

    monkeypatch.setattr(checkpoint_io, "_exchange", lambda a, b: False)
    last, new = _dir(tmp_path / "last.ckpt", "old"), _dir(tmp_path / ".last.ckpt.saving-1", "new")
    checkpoint_io.replace_directory(new, last)  # the fallback, uninterrupted
    assert (last / "shard").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]

    last.rename(tmp_path / ".last.ckpt.old-dead")  # what SIGKILL between the two renames leaves
    _dir(tmp_path / ".last.ckpt.saving-2", "half")
    assert checkpoint_io.recover_directory(last)
    checkpoint_io.remove_stale_staging(last)
    assert (last / "shard").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert not checkpoint_io.recover_directory(last)  # nothing to do when it is there


# --- a full disk named: the file, the errno in words, and the checkpoint that still stands -----------------


class _FillingFile:
    """A file whose writes fail with ENOSPC once `budget` bytes are written, as a full disk's do."""

    def __init__(self, handle: Any, budget: list[int]) -> None:
        self.handle, self.budget = handle, budget

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if size > self.budget[0]:
            self.budget[0] = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.budget[0] -= size
        return self.handle.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)

    def __enter__(self) -> _FillingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.close()


@pytest.fixture
def small_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on a 1 MiB file system: a real tmpfs where this process may mount one (root, with the right to
    mount), else one whose files' writes fail with ENOSPC past 1 MiB (`Path.open` hands out a filling file)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mount = shutil.which("mount")
    mounted = (
        bool(mount)
        and os.geteuid() == 0
        and (
            subprocess.run(
                [str(mount), "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True
            ).returncode
            == 0
        )
    )
    if not mounted:
        budget, real_open = [1 << 20], Path.open

        def filling_open(self: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            handle = real_open(self, mode, *args, **kwargs)
            return _FillingFile(handle, budget) if "w" in mode and self.is_relative_to(folder) else handle

        monkeypatch.setattr(Path, "open", filling_open)
    try:
        yield folder
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], check=True)


def test_a_checkpoint_that_fills_the_disk_names_the_cause_and_the_last_good_one_stays_loadable(
    small_disk: Path,
) -> None:
    """It said "unexpected pos 128 vs 0" (torch's zip writer), never "No space left on device" nor which file."""
    last = small_disk / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 5, "w": torch.ones(1000)}, last)  # 4 kB: fits
    with pytest.raises(OSError) as failed:
        AtomicCheckpointIO().save_checkpoint({"global_step": 9, "w": torch.ones(1 << 19)}, last)  # 2 MiB: does not
    message = str(failed.value)
    assert failed.value.errno == errno.ENOSPC
    assert message.startswith(f"cannot write checkpoint {last}: No space left on device (ENOSPC)"), message
    assert f"{last} (global step 5) still stands" in message
    assert torch.load(last, weights_only=True)["global_step"] == 5
    assert [p.name for p in small_disk.iterdir()] == ["last.ckpt"]  # the part written is gone

    with pytest.raises(OSError, match="No space left on device") as other:
        atomic_torch_save({"global_step": 9, "w": torch.ones(1 << 19)}, small_disk / "step9.ckpt")
    assert f"nothing was written to {small_disk / 'step9.ckpt'}; {last} (global step 5) still stands" in str(
        other.value
    )


def test_a_file_where_the_checkpoint_directory_belongs_is_named(tmp_path: Path) -> None:
    (tmp_path / "ckpt").write_text("a file")
    with pytest.raises(OSError) as failed:
        atomic_torch_save({"global_step": 1}, tmp_path / "ckpt" / "last.ckpt")
    assert str(failed.value).startswith(f"cannot create directory {tmp_path / 'ckpt'}: File exists (EEXIST)")
    (tmp_path / "dir.ckpt").mkdir()
    with pytest.raises(OSError, match=r"cannot write checkpoint .*dir\.ckpt: Is a directory \(EISDIR\)"):
        atomic_torch_save({"global_step": 1}, tmp_path / "dir.ckpt")
