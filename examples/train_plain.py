"""Train the byte-level GPT example with a plain `lightning.Trainer`, no Hydra: `python examples/train_plain.py`."""

from __future__ import annotations

import argparse
import functools

import lightning as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

from lightning_accel import examples, schedules


def main() -> None:
    """Parse the flags, train, test and print the test bits per character."""
    parser = argparse.ArgumentParser(description=__doc__)
    # data
    parser.add_argument("--max_chars", type=int, default=2_500_000)  # corpus size in bytes of stdlib source
    parser.add_argument("--block_size", type=int, default=64)  # context length in bytes
    parser.add_argument("--batch_size", type=int, default=32)  # sequences per optimizer step
    # model
    parser.add_argument("--n_layer", type=int, default=2)  # transformer blocks
    parser.add_argument("--n_head", type=int, default=4)  # attention heads per block
    parser.add_argument("--n_embd", type=int, default=128)  # residual width
    parser.add_argument("--dropout", type=float, default=0.0)  # 0 for short runs; try 0.1 when overfitting
    # optimizer and schedule
    parser.add_argument("--lr", type=float, default=3e-3)  # peak AdamW learning rate
    parser.add_argument("--weight_decay", type=float, default=0.1)  # on matrices and embeddings only
    parser.add_argument("--warmup_steps", type=int, default=20)  # linear warm-up, then cosine decay to 0
    # run
    parser.add_argument("--max_epochs", type=int, default=1)  # one pass over the corpus
    parser.add_argument("--max_steps", type=int, default=-1)  # -1: no step limit, run max_epochs
    parser.add_argument("--val_check_interval", type=int, default=200)  # validate every this many steps
    parser.add_argument("--limit_val_batches", type=int, default=20)  # batches per validation
    parser.add_argument("--default_root_dir", default="outputs/train_plain")  # checkpoints and logs go here
    parser.add_argument("--seed", type=int, default=0)  # weights, shuffle and split
    args = parser.parse_args()

    L.seed_everything(args.seed)
    datamodule = examples.StdlibTextDataModule(
        block_size=args.block_size, batch_size=args.batch_size, max_chars=args.max_chars, seed=args.seed
    )
    model = examples.GPTLanguageModel(
        vocab_size=examples.StdlibTextDataModule.vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=args.dropout,
        optimizer=functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95)),
        lr_scheduler=functools.partial(schedules.cosine_schedule, warmup_steps=args.warmup_steps),
    )

    checkpoint = ModelCheckpoint(monitor="val/loss", mode="min", filename="best-{step}")
    callbacks = [
        LearningRateMonitor(logging_interval="step"),  # logs the scheduled learning rate every step
        checkpoint,  # keeps the weights with the lowest val/loss
        # add lightning_accel callbacks here, e.g. GPUMonitor()
    ]

    trainer = L.Trainer(
        accelerator="cpu",  # "auto" picks a GPU when there is one
        devices=1,
        precision="32-true",  # "bf16-mixed" on a recent GPU
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        val_check_interval=args.val_check_interval,
        check_val_every_n_epoch=None,  # count val_check_interval in steps across epochs
        limit_val_batches=args.limit_val_batches,
        callbacks=callbacks,
        default_root_dir=args.default_root_dir,
        log_every_n_steps=10,
    )
    trainer.fit(model, datamodule=datamodule)

    best = checkpoint.best_model_path or None  # no checkpoint when validation never ran
    results = trainer.test(model, datamodule=datamodule, ckpt_path=best)
    print(f"unigram baseline: {datamodule.unigram_bpc:.3f} bpc, uniform baseline: {datamodule.uniform_bpc:.3f} bpc")
    print(f"test bpc: {results[0]['test/bpc']:.3f} (checkpoint: {best or 'final weights'})")


if __name__ == "__main__":
    main()
