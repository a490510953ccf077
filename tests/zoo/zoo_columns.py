"""The callbacks the zoo trains every module with, one column each, made fresh for each fit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from zoo_modules import BATCH

import lightning_accel.callbacks as callbacks

LR_FACTOR = 2
"""LRScaling's factor in the zoo: `linear` from a reference global batch of half the loader's."""


def default_set(val_key: str | None, output_dir: Path) -> list[pl.Callback]:
    """accel-train's default callbacks (`conf/callbacks/default.yaml`), composed as accel-train composes them, with
    the checkpoint watching the module's own validation key, as a user sets it
    (`callbacks.model_checkpoint.monitor=val_loss`), and its files in `output_dir`."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from lightning_accel.compose import instantiate_callbacks
    from lightning_accel.launch import register_resolvers

    GlobalHydra.instance().clear()
    register_resolvers()
    monitor = "null" if val_key is None else val_key
    overrides = [f"callbacks.model_checkpoint.monitor={monitor}", "callbacks.model_checkpoint.filename=best"]
    try:
        with initialize_config_module(config_module="lightning_accel.conf", version_base="1.3"):
            cfg = compose("train", overrides=overrides, return_hydra_config=True)
            with open_dict(cfg):
                cfg.hydra.runtime.output_dir = str(output_dir)
                cfg.hydra.job.num = 0
            HydraConfig.instance().set_config(cfg)
            return instantiate_callbacks(cfg)
    finally:
        GlobalHydra.instance().clear()


COLUMNS: dict[str, Callable[[Any], list[pl.Callback]]] = {
    "GPUMonitor": lambda ctx: [callbacks.GPUMonitor(print_report=False, plot=False, report_dir=str(ctx.tmp))],
    "StopOnSignal": lambda ctx: [callbacks.StopOnSignal()],
    "NonFiniteGuard": lambda ctx: [callbacks.NonFiniteGuard()],
    "SkippedStepGuard": lambda ctx: [callbacks.SkippedStepGuard()],
    "MicroBatchFinder()": lambda ctx: [callbacks.MicroBatchFinder()],
    "MicroBatchFinder(4)": lambda ctx: [callbacks.MicroBatchFinder(micro_batch_size=BATCH // 2)],
    "AccumulationScheduler({0: 2})": lambda ctx: [callbacks.AccumulationScheduler({0: 2})],
    "AccumulationScheduler(global_batch_size=16)": lambda ctx: [
        callbacks.AccumulationScheduler(global_batch_size=2 * BATCH)
    ],
    "DataLoaderTuner": lambda ctx: [
        callbacks.DataLoaderTuner(
            steps_per_trial=2, warmup_steps=1, max_workers=2, use_cache=False, print_table=False, verify_steps=0
        )
    ],
    "LRScaling": lambda ctx: [callbacks.LRScaling("linear", reference_global_batch=BATCH // LR_FACTOR)],
    "MatmulPrecision": lambda ctx: [callbacks.MatmulPrecision("high")],
    "Preflight": lambda ctx: [callbacks.Preflight(interference_s=0)],
    "RunStats": lambda ctx: [callbacks.RunStats()],
    "BenchMonitor": lambda ctx: [callbacks.BenchMonitor(warmup_batches=1)],
    "Compile": lambda ctx: [callbacks.Compile(backend="eager")],
    "Parallelize": lambda ctx: [callbacks.Parallelize()],
    "Float8Training": lambda ctx: [callbacks.Float8Training()],
    "default set": lambda ctx: default_set(ctx.entry.val_key, ctx.tmp),
}
