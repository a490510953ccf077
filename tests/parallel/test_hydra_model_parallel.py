"""accel-train with strategy=model_parallel on 2 CPU ranks: one run directory, and a multirun keeps one sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _run_logs import config_digests

# A few steps of a small GPT on 2 CPU processes under ModelParallelStrategy, parallelized by callbacks.parallelize.
MODEL_PARALLEL = [
    "trainer=smoke",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "strategy=model_parallel",
    "trainer.max_steps=6",
    "data.max_chars=100000",
    "model.n_embd=32",
    "model.n_head=4",
]


@pytest.mark.slow
def test_model_parallel_two_cpu_processes_share_one_run_directory(run_cli, tmp_path: Path) -> None:
    result = run_cli(MODEL_PARALLEL, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Parallelize: GPTLanguageModel: tp=0 modules, ac=0 blocks, compile=0 blocks, fsdp=2 blocks + root" in (
        result.stdout + result.stderr
    )
    runs = list((tmp_path / "outputs" / "runs").iterdir())
    assert len(runs) == 1, runs
    digests = config_digests(runs[0])
    assert set(digests) == {"train.log", "train_rank1.log"}
    assert len(set(digests.values())) == 1, digests
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["tested_weights"] == "best"
    assert Path(summary["best_checkpoint"]).is_dir()  # a sharded checkpoint: one file per rank
    assert len(list(Path(summary["best_checkpoint"]).glob("*.distcp"))) == 2


@pytest.mark.slow  # the DDP multirun case (tests/test_train.py) covers the same launcher path by default
def test_multirun_with_model_parallel_keeps_one_sweep_directory(run_cli, tmp_path: Path) -> None:
    """Job 0 shards with FSDP2 (dp=2), job 1 splits layers with tensor parallelism (tp=2); Lightning #11300 again."""
    result = run_cli(["-m", *MODEL_PARALLEL, "trainer.strategy.tensor_parallel_size=1,2"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "fsdp=2 blocks + root" in output and "tp=12 modules, ac=0 blocks, compile=0 blocks, fsdp=off" in output
    sweeps = list((tmp_path / "outputs" / "multiruns").iterdir())
    assert len(sweeps) == 1, sweeps
    assert not (tmp_path / "outputs" / "runs").exists()
    jobs = sorted(p for p in sweeps[0].iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1"]
    for job in jobs:
        found = config_digests(job)
        assert set(found) == {"train.log", "train_rank1.log"}, job
        assert len(set(found.values())) == 1
        assert json.loads((job / "summary.json").read_text())["world_size"] == 2
