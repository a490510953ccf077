"""Tests of the GPT example: shapes, causality, tensor-parallel head slicing, learning and the optimizer setup."""

from __future__ import annotations

import copy
import functools
import math
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from lightning_accel import examples, schedules

Block, GPTLanguageModel, StdlibTextDataModule = examples.Block, examples.GPTLanguageModel, examples.StdlibTextDataModule
CausalSelfAttention = examples.gpt.CausalSelfAttention

TINY = {"block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32}


def test_structure_is_a_list_of_identical_blocks() -> None:
    model = GPTLanguageModel(**TINY)
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == 2
    assert all(type(block) is Block for block in model.blocks)
    attn = model.blocks[0].attn
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        assert isinstance(getattr(attn, name), nn.Linear)
    assert isinstance(model.blocks[0].mlp.fc, nn.Linear) and isinstance(model.blocks[0].mlp.proj, nn.Linear)
    assert model.hparams.n_embd == 32 and "optimizer" not in model.hparams


def test_forward_shape() -> None:
    model = GPTLanguageModel(**TINY)
    assert model(torch.randint(0, 256, (3, 16))).shape == (3, 16, 256)
    assert model(torch.randint(0, 256, (3, 5))).shape == (3, 5, 256)


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = GPTLanguageModel(**TINY).eval()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_attention_shards_with_fewer_local_heads_sum_to_the_full_output() -> None:
    torch.manual_seed(0)
    full = CausalSelfAttention(n_embd=32, n_head=4).eval()
    x = torch.randn(2, 8, 32)
    total = full.out_proj.bias.expand(2, 8, 32).clone()
    for rows in (slice(0, 16), slice(16, 32)):  # two tensor-parallel ranks with two heads each
        shard = copy.deepcopy(full)
        for name in ("q_proj", "k_proj", "v_proj"):  # column-wise: output features split
            linear = getattr(full, name)
            part = nn.Linear(32, 16)
            part.weight.data, part.bias.data = linear.weight.data[rows].clone(), linear.bias.data[rows].clone()
            setattr(shard, name, part)
        shard.out_proj = nn.Linear(16, 32, bias=False)  # row-wise: input features split, bias added once
        shard.out_proj.weight.data = full.out_proj.weight.data[:, rows].clone()
        total = total + shard(x)
    torch.testing.assert_close(total, full(x), rtol=1e-5, atol=1e-5)


def test_invalid_config_names_the_setting() -> None:
    with pytest.raises(ValueError, match="`model.n_embd=30` must be divisible by `model.n_head=4`"):
        GPTLanguageModel(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="`model.n_layer=0`"):
        GPTLanguageModel(n_layer=0)
    with pytest.raises(ValueError, match="`model.block_size=16`"):
        GPTLanguageModel(**TINY)(torch.zeros(1, 17, dtype=torch.long))


def test_overfits_one_batch() -> None:
    torch.manual_seed(0)
    model = GPTLanguageModel(**TINY)
    x = torch.randint(0, 256, (8, 17))
    batch = (x[:, :-1], x[:, 1:])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(50):
        loss = model._loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(256), rel=0.05)
    assert losses[-1] < 0.5 * losses[0]


def test_flops_per_batch_is_linear_in_batch_size_and_follows_the_formula() -> None:
    model = GPTLanguageModel(**TINY)
    embeddings = model.tok_emb.weight.numel() + model.pos_emb.weight.numel()
    assert model.num_params_nonembedding == sum(p.numel() for p in model.parameters()) - embeddings
    per_sequence = (6 * model.num_params_nonembedding + 12 * 2 * 32 * 16) * 16
    assert model.flops_per_batch(1) == per_sequence
    assert model.flops_per_batch(8) == 8 * model.flops_per_batch(1)


def test_weight_decay_applies_to_matrices_only() -> None:
    model = GPTLanguageModel(**TINY, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1))
    decay, no_decay = model.param_groups()
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert GPTLanguageModel(**TINY).param_groups()[0]["weight_decay"] == 0.0


def test_fit_with_cosine_schedule_logs_val_and_test_metrics(tmp_path: Path) -> None:
    L.seed_everything(0)
    dm = StdlibTextDataModule(block_size=16, batch_size=8, max_chars=20_000)
    model = GPTLanguageModel(
        **TINY,
        optimizer=functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.1),
        lr_scheduler=functools.partial(schedules.cosine_schedule, warmup_steps=2),
    )
    trainer = L.Trainer(
        max_steps=8,
        accelerator="cpu",
        limit_val_batches=2,
        val_check_interval=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm)
    config = trainer.lr_scheduler_configs[0]
    assert isinstance(config.scheduler, LambdaLR) and config.interval == "step"
    assert [g["weight_decay"] for g in trainer.optimizers[0].param_groups] == [0.1, 0.0]
    assert trainer.optimizers[0].param_groups[0]["lr"] < 3e-3  # decayed from the peak
    val_loss, val_bpc = trainer.callback_metrics["val/loss"], trainer.callback_metrics["val/bpc"]
    assert float(val_bpc) == pytest.approx(float(val_loss) / math.log(2))
    result = trainer.test(model, datamodule=dm, verbose=False)[0]
    assert result["test/bpc"] == pytest.approx(result["test/loss"] / math.log(2))
    assert result["test/bpc"] < 8.0


@pytest.mark.slow
def test_train_plain_script_runs(tmp_path: Path) -> None:
    script = Path(__file__).parents[2] / "examples" / "train_plain.py"
    args = ["--max_steps", "12", "--max_chars", "60000", "--n_embd", "32", "--val_check_interval", "6"]
    args += ["--warmup_steps", "2"]
    args += ["--limit_val_batches", "2", "--default_root_dir", str(tmp_path)]
    run = subprocess.run(
        [sys.executable, str(script), *args], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    found = re.search(r"test bpc: (\d+\.\d+) \(checkpoint: (.+)\)", run.stdout)
    assert found is not None, run.stdout[-2000:]
    assert 0.0 < float(found.group(1)) < 8.0
    assert found.group(2).endswith(".ckpt")


def test_a_simulated_device_memory_limit_raises_oom_that_micro_batch_finder_sizes_to(tmp_path: Path) -> None:
    """`device_memory_samples=2`: a training forward of 4 sequences raises torch.OutOfMemoryError (evaluation does
    not), and MicroBatchFinder finds micro-batch 2 for batches of 4."""
    from lightning_accel.callbacks import MicroBatchFinder

    model = GPTLanguageModel(block_size=16, n_layer=1, n_head=2, n_embd=16, device_memory_samples=2)
    tokens = torch.randint(0, 256, (4, 16))
    with pytest.raises(torch.OutOfMemoryError, match="device_memory_samples=2"):
        model(tokens)
    model.eval()
    assert model(tokens).shape == (4, 16, 256)
    with pytest.raises(ValueError, match="device_memory_samples=0"):
        GPTLanguageModel(device_memory_samples=0)
    data = torch.randint(0, 256, (16, 17), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(list(zip(data[:, :-1], data[:, 1:], strict=True)), batch_size=4)
    finder = MicroBatchFinder()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[finder],
    )
    trainer.fit(GPTLanguageModel(block_size=16, n_layer=1, n_head=2, n_embd=16, device_memory_samples=2), loader)
    assert finder.found == 2 and trainer.global_step == 2


def test_vocab_multiple_of_pads_the_embedding_and_the_logits() -> None:
    model = GPTLanguageModel(**{**TINY, "vocab_size": 250}, vocab_multiple_of=64)
    assert model.padded_vocab_size == 256 and model.tok_emb.num_embeddings == 256 and model.lm_head.out_features == 256
    assert model(torch.randint(0, 250, (2, 16))).shape == (2, 16, 256)
    assert GPTLanguageModel(**TINY, vocab_multiple_of=64).padded_vocab_size == 256  # already a multiple: unchanged
    with pytest.raises(ValueError, match="vocab_multiple_of=0"):
        GPTLanguageModel(**TINY, vocab_multiple_of=0)


def test_attention_goes_through_scaled_dot_product_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flash / memory-efficient kernels on a GPU come from `F.scaled_dot_product_attention`, causal, no mask."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    GPTLanguageModel(**TINY)(torch.randint(0, 256, (2, 16)))
    assert len(calls) == TINY["n_layer"] and all(c["is_causal"] and "attn_mask" not in c for c in calls)


def test_gpt2_small_config_has_gpt2_small_shape(compose_train) -> None:
    from hydra.utils import instantiate

    cfg = compose_train(["model=gpt2_small"])
    model = instantiate(cfg.model)
    hp = model.hparams
    assert (hp.n_layer, hp.n_head, hp.n_embd, hp.block_size) == (12, 12, 768, 1024)
    assert model.padded_vocab_size % 64 == 0 and cfg.data.block_size == 1024
    assert 84e6 < model.num_params_nonembedding < 86e6  # GPT-2 small's 85M outside the embeddings
    assert hp.n_embd // hp.n_head == 64  # flash attention's head size


@pytest.mark.slow  # ~25 s: 124M parameters on the CPU; its shape is checked by default
def test_gpt2_small_trains_a_few_steps_on_cpu(run_cli, tmp_path: Path) -> None:
    """The GPU-sized config runs end to end here at a short context and batch: 3 optimizer steps, validation, test."""
    run_dir = tmp_path / "run"
    result = run_cli(
        [
            "model=gpt2_small",
            "trainer=smoke",
            "trainer.accelerator=cpu",
            "trainer.max_steps=3",
            "trainer.val_check_interval=3",
            "trainer.limit_val_batches=1",
            "trainer.limit_test_batches=1",
            "data.batch_size=2",
            "data.block_size=128",
            "~callbacks.model_checkpoint",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["train_samples"] == 3 * 2 and math.isfinite(summary["metrics"]["test/loss"])
