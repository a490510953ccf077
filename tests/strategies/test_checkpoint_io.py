"""AtomicCheckpointIO: a save that fails half-way leaves the previous checkpoint, and no stray file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_accel.strategies import AtomicCheckpointIO, atomic_torch_save


def _full_disk(obj: Any, handle: Any) -> None:
    handle.write(b"PK\x03\x04 half a checkpoint")  # what a full disk leaves: the start of a zip archive
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
    trainer = pl.Trainer(max_steps=2, plugins=[AtomicCheckpointIO()], default_root_dir=tmp_path, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(BoringModel())
    saved = list((tmp_path / "checkpoints").glob("*.ckpt"))
    assert len(saved) == 1
    resumed = pl.Trainer(max_steps=3, plugins=[AtomicCheckpointIO()], default_root_dir=tmp_path, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    resumed.fit(BoringModel(), ckpt_path=saved[0])
    assert resumed.global_step == 3


def test_the_default_trainer_config_uses_it(compose_train) -> None:
    from hydra.utils import instantiate

    cfg = compose_train([])
    assert [type(instantiate(p)) for p in cfg.trainer.plugins] == [AtomicCheckpointIO]
