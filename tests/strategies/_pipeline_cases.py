"""GPT-tiny runs under PipelineStrategy for tests/strategies/test_pipeline.py, on 2 (or 4) ranks under torchrun.

`python -m torch.distributed.run --standalone --nproc-per-node N _pipeline_cases.py OUT_DIR CASE...` runs the named
cases on every rank; each rank writes OUT_DIR/rank<k>.json, one record per case: its result, `{"error": traceback}`
when it raised, or `{"not_run": reason}` when an earlier case left a rank stuck and the launch ended. `reference()`
is the single-process run in plain PyTorch the cases are held to: the same model, data, AdamW, cosine schedule and
gradient clipping, one step per batch, in fp32.

Cases: `gpipe`, `1f1b`, `interleaved_1f1b` (20 steps, validation after each epoch); `resume` (1f1b with a checkpoint
after epoch 1, step 10, then a second Trainer resumed from it; rank 0 also consolidates the step-20 checkpoint into
the plain GPT's state dict and measures its validation loss); `accumulate` (1f1b, 2 batches per optimizer step),
`accumulation_scheduler` (the same through AccumulationScheduler, interleaved 1F1B); `bf16-mixed`, `bf16-true`
(1f1b under those precisions); `split_points` (gpipe, stages of 1 and 3 blocks); any other schedule name (the
zero-bubble ones). With 4 ranks every case runs as pp=2 x dp=2 (`data_parallel_size=2`, gradients all-reduced);
`fsdp_resume`, `fsdp_interleaved` and `fsdp_accumulation_scheduler` (2 micro-batches of the replica's 2 samples)
shard each stage with FSDP2 instead. `raises_mid_epoch`: a 1f1b fit that raises at batch 2 on every rank, for what
the strategy's patch leaves behind.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _byte_data import byte_sequences
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_accel import examples, schedules
from lightning_accel.callbacks import AccumulationScheduler
from lightning_accel.strategies.pipeline import PipelineStrategy, consolidate_checkpoint

SEED = 0
BATCH = 8  # sequences per optimizer step (with dp=2: 4 per replica)
MICRO = 4  # micro-batches per batch (per replica)
BATCHES_PER_EPOCH = 10
EPOCHS = 2  # 20 optimizer steps; the checkpoint is written after epoch 1 (step 10)
VAL_BATCHES = 2
BLOCK_SIZE = 16
MODEL = {"block_size": BLOCK_SIZE, "n_layer": 4, "n_head": 4, "n_embd": 32, "dropout": 0.0}
LR = 3e-3
WEIGHT_DECAY = 0.1
CLIP = 0.5  # active on most steps, so the norm must be the one over all stages


def dataset(n: int, seed: int = SEED) -> TensorDataset:
    return byte_sequences(n, BLOCK_SIZE, seed)


def train_set() -> TensorDataset:
    return dataset(BATCH * BATCHES_PER_EPOCH)


def val_set() -> TensorDataset:
    return dataset(BATCH * VAL_BATCHES, seed=SEED + 1)


def make_model() -> examples.GPTLanguageModel:
    torch.manual_seed(SEED)  # every rank and the reference start from the same weights
    return examples.GPTLanguageModel(
        **MODEL,
        optimizer=functools.partial(torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY),
        lr_scheduler=functools.partial(schedules.cosine_schedule, min_lr_ratio=0.1),
    )


@torch.no_grad()
def val_loss(model: examples.GPTLanguageModel) -> float:
    x, y = val_set().tensors
    return sum(model._loss((x[i : i + BATCH], y[i : i + BATCH])).item() for i in range(0, len(x), BATCH)) / VAL_BATCHES


def reference(steps: int = EPOCHS * BATCHES_PER_EPOCH) -> dict[str, Any]:
    """The single-process run in plain PyTorch: per-step losses, clipped steps, and val loss after each epoch."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.param_groups(), lr=LR)
    scheduler = schedules.cosine_schedule(optimizer, total_steps=steps, min_lr_ratio=0.1)
    x, y = train_set().tensors
    losses, clipped, val = [], 0, []
    for step in range(steps):
        rows = slice(step % BATCHES_PER_EPOCH * BATCH, (step % BATCHES_PER_EPOCH + 1) * BATCH)
        loss = model._loss((x[rows], y[rows]))
        loss.backward()
        clipped += int(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item() > CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if (step + 1) % BATCHES_PER_EPOCH == 0:
            val.append(val_loss(model))
    return {"losses": losses, "clipped": clipped, "val": val}


class Recorder(pl.Callback):
    """What callbacks see: the logged train loss of every step and val loss of every epoch (averaged over replicas)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.val: list[float] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = trainer.callback_metrics["train/loss"].detach().clone()
        dp = pl_module.device_mesh["data_parallel"]
        torch.distributed.all_reduce(loss, group=dp.get_group())
        self.losses.append(loss.item() / dp.size())

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.val.append(trainer.callback_metrics["val/loss"].item())


def run_case(
    root: str,
    *,
    schedule: str,
    dp: int = 1,
    data_parallel: str = "replicate",
    accumulate: int = 1,
    checkpoint: bool = False,
    resume_from: str | None = None,
    precision: str = "32-true",
    scheduler: bool = False,
    split_points: list[str] | None = None,
    micro: int = MICRO,
    val_extra: int = 0,
) -> dict[str, Any]:
    world = int(os.environ["WORLD_SIZE"])
    recorder = Recorder()
    callbacks: list[pl.Callback] = [recorder]
    if scheduler:  # the project's callback sets the accumulation per window instead of the Trainer
        callbacks.append(AccumulationScheduler({0: accumulate}))
    if checkpoint:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=f"{root}/ckpt",
                filename="epoch{epoch}",
                save_top_k=-1,
                every_n_epochs=1,
                save_on_train_epoch_end=True,
                auto_insert_metric_name=False,
            )
        )
    strategy = PipelineStrategy(
        schedule=schedule,
        n_microbatches=micro,
        data_parallel_size=dp,
        data_parallel=data_parallel,
        split_points=split_points,
    )  # type: ignore[arg-type]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=EPOCHS,
        precision=precision,
        accumulate_grad_batches=1 if scheduler else accumulate,
        gradient_clip_val=CLIP,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=checkpoint,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    dp_rank = int(os.environ["RANK"]) % dp  # the mesh is (pipeline_parallel, data_parallel), row-major

    def loader(data: TensorDataset, batch_size: int) -> DataLoader:
        sampler = DistributedSampler(data, num_replicas=dp, rank=dp_rank, shuffle=False) if dp > 1 else None
        return DataLoader(data, batch_size=batch_size, sampler=sampler)

    val_data = val_set() if not val_extra else dataset(BATCH * VAL_BATCHES + val_extra, seed=SEED + 1)
    train, val = loader(train_set(), BATCH // dp // accumulate), loader(val_data, BATCH // dp)
    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, train, val, ckpt_path=resume_from)
    return {
        "losses": recorder.losses,
        "val": recorder.val,
        "global_step": trainer.global_step,
        "local_stages": strategy.local_stages,
        "n_params": sum(p.numel() for p in model.parameters()),
        "dtensor_params": sum(type(p).__name__ == "DTensor" for p in model.parameters()),
    }


def run_resume(root: str, dp: int, data_parallel: str = "replicate") -> dict[str, Any]:
    results = {"full": run_case(f"{root}/full", schedule="1f1b", dp=dp, data_parallel=data_parallel, checkpoint=True)}
    results["checkpoint_is_directory"] = Path(f"{root}/full/ckpt/epoch0.ckpt").is_dir()
    checkpoint = f"{root}/full/ckpt/epoch0.ckpt"
    results["resumed"] = run_case(
        f"{root}/resumed", schedule="1f1b", dp=dp, data_parallel=data_parallel, resume_from=checkpoint
    )
    torch.distributed.barrier()
    if int(os.environ["RANK"]) == 0:
        state = consolidate_checkpoint(f"{root}/full/ckpt/epoch1.ckpt", out=f"{root}/consolidated.pt")
        plain = make_model()
        plain.load_state_dict(torch.load(f"{root}/consolidated.pt")["state_dict"])
        results["consolidated_keys_match"] = sorted(state) == sorted(plain.state_dict())
        results["consolidated_val"] = val_loss(plain)
    return results


class RaisesMidEpoch(pl.Callback):
    """Notes whether the strategy's clipping patch is on the precision plugin while training, then raises (on every
    rank, after batch 2's collectives)."""

    def __init__(self) -> None:
        self.patched_while_training = False

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.patched_while_training = "clip_grad_by_norm" in trainer.precision_plugin.__dict__
        if batch_idx == 2:
            raise RuntimeError("mid-epoch failure")


def run_raises_mid_epoch(root: str, dp: int) -> dict[str, Any]:
    """A fit that raises at batch 2, with the strategy's `teardown` held back (Lightning calls it after an exception
    too): what the patch left on the precision plugin once `on_exception` alone has run."""
    strategy = PipelineStrategy(schedule="1f1b", n_microbatches=MICRO, data_parallel_size=dp)
    held_back = strategy.teardown
    strategy.teardown = lambda: None  # type: ignore[method-assign]
    hook = RaisesMidEpoch()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=strategy,
        max_epochs=1,
        gradient_clip_val=CLIP,
        callbacks=[hook],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        use_distributed_sampler=False,
    )
    raised = ""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(make_model(), DataLoader(train_set(), batch_size=BATCH // dp))
    except RuntimeError as err:
        raised = str(err)
    left = "clip_grad_by_norm" in trainer.precision_plugin.__dict__
    held_back()
    return {
        "raised": raised,
        "global_step": trainer.global_step,
        "patched_while_training": hook.patched_while_training,
        "patch_left_after_on_exception": left,
    }


def run_named(name: str, root: str, dp: int) -> dict[str, Any]:
    """The case called `name` (see the module docstring)."""
    if name == "resume":
        return run_resume(f"{root}/resume", dp)
    if name == "raises_mid_epoch":
        return run_raises_mid_epoch(f"{root}/raises", dp)
    if name == "short_val":  # the last validation batch of 3 samples: fewer micro-batches than 1F1B's stages
        return run_case(f"{root}/short_val", schedule="1f1b", dp=dp, val_extra=3)
    if name == "accumulate":
        return run_case(f"{root}/acc", schedule="1f1b", dp=dp, accumulate=2)
    if name == "accumulation_scheduler":
        return run_case(f"{root}/acc_s", schedule="interleaved_1f1b", dp=dp, accumulate=2, scheduler=True)
    if name == "split_points":  # uneven: 1 block, then 3
        return run_case(f"{root}/split", schedule="gpipe", dp=dp, split_points=["blocks.1"])
    if name == "fsdp_accumulation_scheduler":
        return run_case(
            f"{root}/fsdp_acc", schedule="1f1b", dp=dp, data_parallel="fsdp", accumulate=2, scheduler=True, micro=2
        )
    if name in ("bf16-mixed", "bf16-true"):
        return run_case(f"{root}/{name}", schedule="1f1b", dp=dp, precision=name)
    if name == "fsdp_resume":
        return run_resume(f"{root}/fsdp", dp, data_parallel="fsdp")
    if name == "fsdp_interleaved":
        return run_case(f"{root}/fsdp_il", schedule="interleaved_1f1b", dp=dp, data_parallel="fsdp")
    return run_case(f"{root}/{name}", schedule=name, dp=dp)


SYNC_TIMEOUT_S = 90.0  # the ranks end a healthy case within seconds of each other; longer: one is stuck


def all_ranks_done(out: Path, case: str, rank: int, world: int) -> bool:
    """Mark `case` done on this rank and wait (polling, with a deadline) until every rank has; False when one does
    not arrive in time (stuck in a collective its partner left by raising). Files, not the process group: it may
    be the thing that is broken."""
    marks = out / "done"
    marks.mkdir(exist_ok=True)
    (marks / f"{case}.{rank}").touch()
    deadline = time.monotonic() + SYNC_TIMEOUT_S
    while time.monotonic() < deadline:
        if all((marks / f"{case}.{r}").exists() for r in range(world)):
            return True
        time.sleep(0.01)
    return False


def write_results(out: Path, rank: int, results: dict[str, Any]) -> None:
    """This rank's records so far, replaced whole: a rank killed later leaves those of the cases it finished."""
    path = out / f"rank{rank}.json"
    partial = path.with_suffix(".json.tmp")
    partial.write_text(json.dumps(results))
    os.replace(partial, path)


def main(out: Path, cases: list[str]) -> None:
    """Run `cases` in turn; each case's record is its result or `{"error": traceback}`, so a case that raises fails
    only its own tests. When a rank does not finish a case (a rank that raised left its partner waiting in a
    collective), the remaining cases are recorded as not run and this process exits, which ends the launch."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dp = world // 2
    root = str(out / "runs")
    results: dict[str, Any] = {}
    for index, case in enumerate(cases):
        try:
            results[case] = run_named(case, root, dp)
        except Exception:
            results[case] = {"error": traceback.format_exc()}
        write_results(out, rank, results)
        if not all_ranks_done(out, case, rank, world):
            reason = f"not run: a rank did not finish case {case!r} within {SYNC_TIMEOUT_S:.0f} s, so the launch ended"
            results.update({later: {"not_run": reason} for later in cases[index + 1 :]})
            write_results(out, rank, results)
            sys.stderr.flush()
            os._exit(1)  # torchrun stops the stuck rank


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
    if torch.distributed.is_initialized():  # an orderly end: a group torn down at interpreter exit can abort a rank
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
