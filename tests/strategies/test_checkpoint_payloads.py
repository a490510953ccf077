"""A pickle payload planted in any file of any checkpoint format the project writes never runs.

Each case first proves the plant is live: torch's own reader (what a resume, `consolidate_checkpoint` or Lightning
would call) runs it and creates a marker. Then every way of loading the project offers (accel-train's check before
launch, `check=true` and `fit=false` included, the strategies' `load_checkpoint`, `consolidate_checkpoint`) refuses
the checkpoint, naming the file, and a second marker is never created.

Formats: a pipeline checkpoint saved by `save_pipeline_checkpoint` (default suite, one process); under `-m slow`,
real 2-rank accel-train runs: `preset=pipeline`, `strategy=model_parallel` (FSDP2) and `strategy=model_parallel`
with `tensor_parallel_size=2` (FSDP2 x tensor parallel), every file of each directory (the index, each rank's shard,
meta.pt).
"""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from lightning_accel import examples
from lightning_accel.errors import ConfigError


class Payload:
    """Pickles into a call of `marker.touch()`: what a planted checkpoint would run on load."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


def _blob(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    return buffer.getvalue()


def plant(checkpoint: Path, file: str, marker: Path) -> None:
    """A payload in `file` of the checkpoint directory: the index replaced; meta.pt re-saved with it; a shard given
    an extra item, and one non-tensor item the index names pointed at it (torch would read it on load)."""
    if file == ".metadata":
        (checkpoint / file).write_bytes(pickle.dumps(Payload(marker)))
        return
    if file == "meta.pt":
        meta = torch.load(checkpoint / file, weights_only=True)
        meta["hyper_parameters"] = {"evil": Payload(marker)}
        torch.save(meta, checkpoint / file)
        return
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    index = pickle.loads((checkpoint / ".metadata").read_bytes())  # our own, trusted
    byte_items = {f for f, m in index.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata)}
    key = next(k for k in index.storage_data if k.fqn in byte_items)
    blob, shard = _blob(marker), checkpoint / file
    offset = shard.stat().st_size
    with shard.open("ab") as handle:
        handle.write(blob)
    index.storage_data[key] = _StorageInfo(file, offset, len(blob))
    (checkpoint / ".metadata").write_bytes(pickle.dumps(index))


def torch_runs_it(checkpoint: Path, file: str) -> None:
    """The control: torch's own reading of the planted file (what loading would do without the checks)."""
    if file == "meta.pt":
        torch.load(checkpoint / file, weights_only=False)
        return
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    _load_distributed_checkpoint(checkpoint)  # reads the index with pickle, every item with the default planner


def refused_everywhere(checkpoint: Path) -> None:
    """Every loader the project offers refuses the directory before unpickling anything in it."""
    from lightning_accel.checks import check_ckpt_path
    from lightning_accel.strategies import consolidate_checkpoint
    from lightning_accel.strategies.model_parallel import ModelParallelStrategy
    from lightning_accel.strategies.pipeline.checkpoint import load_pipeline_checkpoint

    for fit in (True, False):  # a resume, and `fit=false test=true ckpt_path=...`
        with pytest.raises(ConfigError, match="could run code|not loaded"):
            check_ckpt_path(OmegaConf.create({"ckpt_path": str(checkpoint), "fit": fit}))
    with pytest.raises(ConfigError):
        consolidate_checkpoint(checkpoint)
    one_rank = SimpleNamespace(broadcast=lambda x: x, barrier=lambda: None, global_rank=0, optimizers=[])
    with pytest.raises(ConfigError):
        load_pipeline_checkpoint(one_rank, torch.nn.Linear(2, 2), checkpoint)  # type: ignore[arg-type]
    strategy = ModelParallelStrategy()
    strategy.broadcast = lambda x, src=0: x  # type: ignore[method-assign]
    with pytest.raises(ConfigError):
        strategy.load_checkpoint(checkpoint)


def _check_every_file(clean: Path, tmp_path: Path) -> list[str]:
    files = [".metadata", *sorted(p.name for p in clean.glob("*.distcp")), "meta.pt"]
    assert len(files) >= 3, files
    for file in files:
        case = tmp_path / f"case-{file.strip('.')}"
        shutil.copytree(clean, case)
        live, marker = tmp_path / f"live-{file}", tmp_path / f"ran-{file}"
        control = tmp_path / f"control-{file}"
        shutil.copytree(clean, control)
        plant(control, file, live)
        try:  # the payload returns None where torch expects its object: torch fails after running it
            torch_runs_it(control, file)
        except BaseException:  # noqa: B036 - torch's CheckpointException is a BaseException
            pass
        assert live.exists(), f"the plant in {file} is not live: torch's own reader did not run it"
        plant(case, file, marker)
        refused_everywhere(case)
        assert not marker.exists(), f"the payload in {file} ran"
    return files


def test_a_payload_in_any_file_of_a_pipeline_checkpoint_never_runs(tmp_path: Path) -> None:
    """The pipeline's own save (one process): index, shard and meta.pt, each planted in turn."""
    from lightning_accel.strategies.pipeline.checkpoint import optimizer_state_dict, save_pipeline_checkpoint

    model = examples.GPTLanguageModel(n_layer=1, n_embd=32, n_head=2, block_size=8)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 256, (2, 8))).sum().backward()
    optimizer.step()
    one_rank = SimpleNamespace(broadcast=lambda x: x, barrier=lambda: None, global_rank=0)
    checkpoint = {
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer_state_dict(model, optimizer)],
        "epoch": 0,
        "global_step": 1,
    }
    clean = tmp_path / "clean.ckpt"
    save_pipeline_checkpoint(one_rank, checkpoint, clean)  # type: ignore[arg-type]
    from lightning_accel.strategies.dcp_checks import check_distributed_checkpoint

    check_distributed_checkpoint(clean)  # the real, clean checkpoint passes
    assert _check_every_file(clean, tmp_path) == [".metadata", "__0_0.distcp", "meta.pt"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pipeline", "model_parallel", "model_parallel_tp"])
def test_a_payload_in_any_file_of_a_real_two_rank_checkpoint_never_runs(run_cli, tmp_path: Path, kind: str) -> None:
    overrides = {
        "pipeline": ["preset=pipeline"],
        "model_parallel": ["strategy=model_parallel"],
        "model_parallel_tp": ["strategy=model_parallel", "trainer.strategy.tensor_parallel_size=2"],
    }[kind]
    run_dir = tmp_path / "run"
    result = run_cli(
        [
            *overrides,
            "trainer=smoke",
            "trainer.accelerator=cpu",
            "trainer.devices=2",
            "data.max_chars=200000",
            "trainer.max_steps=2",
            "test=false",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    clean = run_dir / "checkpoints" / "last.ckpt"
    files = _check_every_file(clean, tmp_path)
    assert sum(f.endswith(".distcp") for f in files) == 2, files  # one shard per rank


def test_consolidating_refuses_a_distributed_checkpoint_whose_shard_is_truncated(tmp_path: Path) -> None:
    from lightning_accel.strategies.dcp_checks import check_distributed_checkpoint
    from lightning_accel.strategies.pipeline.checkpoint import save_pipeline_checkpoint

    one_rank = SimpleNamespace(broadcast=lambda x: x, barrier=lambda: None, global_rank=0)
    save_pipeline_checkpoint(
        one_rank,
        {"state_dict": {"w": torch.ones(2)}, "epoch": 0, "note": "x"},  # type: ignore[arg-type]
        tmp_path / "c.ckpt",
    )
    shard = tmp_path / "c.ckpt" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(ConfigError, match="truncated|shorter"):
        check_distributed_checkpoint(tmp_path / "c.ckpt")
