"""accel-train: compose a Lightning run from Hydra presets, check it, then fit, test and summarise."""

from __future__ import annotations

import hashlib
import logging
import re
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_accel import compose
from lightning_accel.callbacks.run_stats import RunStats
from lightning_accel.compose import config_paths, instantiate_datamodule, split_data_config
from lightning_accel.errors import ConfigError, LightningAccelWarning, NothingLearnedError
from lightning_accel.launch import check_output_root, hydra_safe_launch, register_resolvers
from lightning_accel.presets import (
    RunShape,
    apply_ddp_grad_compression,
    check_combinations,
    check_config,
    effective_trainer_settings,
    run_shape,
)
from lightning_accel.summary import RunSummary, collect_summary, print_summary, write_summary

if TYPE_CHECKING:
    from lightning_accel.precision import ResolvedPrecision

__all__ = [
    "check_checkpoint_dir",
    "check_checkpoint_fits",
    "check_ckpt_path",
    "check_learned",
    "check_master_port",
    "config_digest",
    "main",
    "print_check",
    "run",
]

log = logging.getLogger("lightning_accel.train")
# The entry point's resolvers (conf/hydra/default.yaml uses ${accel_run_id:...}), registered when this module is
# imported: a launcher that runs the job in another process (hydra-submitit-launcher's SLURM tasks) unpickles
# `_hydra_main` by reference, which imports this module, and resolves the job's directories before calling it. Your
# own app needs none of this (the search-path plugin registers them); the helpers it uses are in `compose.py`.
register_resolvers()


def print_check(cfg: DictConfig, resolved: ResolvedPrecision) -> None:
    """What `accel-train check=true` prints: the Trainer arguments that differ from Lightning's defaults."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="accel-train check: the config is valid; nothing was built or launched")
    table.add_column("Trainer argument")
    table.add_column("value")
    table.add_column("Lightning's default")
    for key, (value, default) in effective_trainer_settings(cfg).items():
        table.add_row(key, repr(value), repr(default))
    console = Console()
    console.print(table)
    console.print(f"{resolved.describe()}; float32_matmul_precision={cfg.get('float32_matmul_precision')}")
    callbacks = sorted(name for name, node in (cfg.get("callbacks") or {}).items() if node is not None)
    loggers = sorted(name for name, node in (cfg.get("logger") or {}).items() if node is not None)
    console.print(f"callbacks: {', '.join(callbacks) or 'none'}; loggers: {', '.join(loggers) or 'none'}")


def config_digest(cfg: DictConfig) -> str:
    """sha256 of the resolved config: every rank of a run logs it, so equal configs can be checked."""
    return hashlib.sha256(OmegaConf.to_yaml(cfg, resolve=True).encode()).hexdigest()


def check_ckpt_path(cfg: DictConfig) -> str | None:
    """`ckpt_path` names a checkpoint this run can load (to resume with `fit`, or to test with `fit=false`): `last`
    needs the run directory's `last.ckpt`; a path must be a `torch.save` file (a zip archive) or a distributed
    checkpoint directory (with `.metadata`), and nothing in it may need more than tensors and plain types.

    Returns:
        The checkpoint to load (`last` resolved to its file), `best`/`hpc`/`registry` as they are, or None.

    Raises:
        ConfigError: naming the path, what it is, and the fix.
    """
    path = cfg.get("ckpt_path")
    if path is None or str(path) in ("best", "hpc", "registry"):
        return None if path is None else str(path)
    from lightning_accel.strategies.checkpoint_io import recover_directory

    if str(path) == "last":
        dirpath = OmegaConf.select(cfg, "callbacks.model_checkpoint.dirpath", default=None)
        if dirpath is None:
            return "last"
        last = Path(str(dirpath)) / "last.ckpt"
        recover_directory(last)  # a directory checkpoint whose swap a kill interrupted
        if not last.exists():
            raise ConfigError(f"`ckpt_path=last` finds no {last}: this run directory "
                              "holds no earlier run. Resume in the earlier run's directory "
                              "(`hydra.run.dir=<its directory> ckpt_path=last`) or pass its checkpoint file "
                              "(`ckpt_path=<dir>/checkpoints/last.ckpt`).")  # fmt: skip
        path = last  # checked below like any path: Lightning drops `weights_only` for some strategies
    import zipfile

    file = Path(str(path))
    recover_directory(file)
    if not file.exists():
        raise ConfigError(f"`ckpt_path={str(path)!r}` does not exist; pass a checkpoint file (`.../checkpoints/"
                          "last.ckpt`) or `ckpt_path=last` in the run directory to resume.")  # fmt: skip
    if not (file.is_dir() or file.is_file()):  # a FIFO or a device would block the first read
        raise ConfigError(f"`ckpt_path={str(path)!r}` is not a regular file or directory (a pipe, a socket or a "
                          "device); pass a checkpoint file or directory.")  # fmt: skip
    if file.is_dir() and not (file / ".metadata").is_file():
        raise ConfigError(f"`ckpt_path={str(path)!r}` is a directory but not a distributed checkpoint (no "
                          "`.metadata`); pass a checkpoint file or a directory a PipelineStrategy or "
                          "ModelParallelStrategy run saved.")  # fmt: skip
    if file.is_file() and not zipfile.is_zipfile(file):
        raise ConfigError(f"`ckpt_path={str(path)!r}` is not a checkpoint (not a torch.save archive: truncated, "
                          "corrupt or another kind of file); pass the run's `checkpoints/last.ckpt` or another "
                          "checkpoint.")  # fmt: skip
    from lightning_accel.strategies.dcp_checks import check_distributed_checkpoint, load_metadata

    # no pickle payload runs: a file (or any file of a distributed checkpoint: index, shards, meta.pt) needing more
    # than tensors and plain types is refused here, whatever torch's default `weights_only` is (False before 2.6)
    if file.is_dir():
        check_distributed_checkpoint(file)
    else:
        load_metadata(file, mmap=True)  # mapped, not read: every rank checks, before launch
    return str(file)


def check_checkpoint_dir(cfg: DictConfig) -> None:
    """The checkpoint directory can be written, before anything trains (a read-only one failed at the first save,
    after training); what killed saves left in it is removed.

    Raises:
        ConfigError: naming `callbacks.model_checkpoint.dirpath` and the error.
    """
    import tempfile

    from lightning_accel.strategies.checkpoint_io import remove_stale_temporaries

    dirpath = OmegaConf.select(cfg, "callbacks.model_checkpoint.dirpath", default=None)
    if dirpath is None or "://" in str(dirpath) or not cfg.get("fit", True):
        return
    try:
        Path(str(dirpath)).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=str(dirpath), prefix=".accel-write-check-"):
            pass
    except OSError as err:
        raise ConfigError(f"`callbacks.model_checkpoint.dirpath={dirpath}` cannot be written ({err.strerror or err}); "
                          "make it writable or point it elsewhere.") from None  # fmt: skip
    removed = remove_stale_temporaries(str(dirpath))
    if removed:
        log.info("removed what killed saves left in %s: %s", dirpath, ", ".join(p.name for p in removed))


def check_master_port(env: Any = None) -> None:
    """A `MASTER_PORT` of ours that another process holds is refused before launch (the ranks waited 125 s for a
    rendezvous that could not happen, then blamed it). Only for jobs this process launches: under torchrun or SLURM
    the launcher owns the port.

    Raises:
        ConfigError: naming `MASTER_PORT`, the port and the fix.
    """
    import os
    import socket

    env = os.environ if env is None else env
    port = env.get("MASTER_PORT")
    if not port or any(k in env for k in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_PROCID")):
        return
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"`MASTER_PORT={port}` is not a port number; unset it or use one within 1-65535.")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", int(port)))  # one node: the store listens here
        except OSError:
            raise ConfigError(f"`MASTER_PORT={port}` is taken by another process, so the ranks could not meet; unset "
                              "it (Lightning picks a free port) or choose a free one.") from None  # fmt: skip


def _trainer_setting_error(err: Exception, cfg: DictConfig, trainer: Any) -> ConfigError | None:
    """Lightning's own refusal of a Trainer setting before the first step (`val_check_interval` beyond the epoch,
    ...), as a ConfigError naming the config path and value, or None for any other error."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    if trainer.global_step > 0 or not isinstance(err, (ValueError, MisconfigurationException)):
        return None
    text = str(err).strip()
    for name in re.findall(r"`(\w+)`", text):
        if name in cfg.trainer:
            return ConfigError(f"`trainer.{name}={cfg.trainer.get(name)}`: {text.splitlines()[0]}")
    return None


def check_checkpoint_fits(model: Any, path: str | None) -> None:
    """The checkpoint to load holds the model's own parameters and shapes, checked before launch (another model
    configuration failed inside Lightning's load, with a traceback of key lists). A model with `strict_loading=False`
    is not checked.

    Raises:
        ConfigError: naming the checkpoint, what differs (a few names and shapes) and the fix.
    """
    if path is None or path in ("best", "last", "hpc", "registry") or not getattr(model, "strict_loading", True):
        return
    from lightning_accel.strategies.dcp_checks import checkpoint_shapes

    theirs = checkpoint_shapes(path)
    if theirs is None:  # a format whose parameters cannot be read without loading it
        return
    mine = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing = sorted(set(mine) - set(theirs))
    unexpected = sorted(set(theirs) - set(mine))
    different = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])
    if not (missing or unexpected or different):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} of the model's parameters are not in it ({', '.join(missing[:3])}, ...)")
    if unexpected:
        parts.append(f"it holds {len(unexpected)} the model lacks ({', '.join(unexpected[:3])}, ...)")
    if different:
        shown = ", ".join(f"{n} {theirs[n]} vs the model's {mine[n]}" for n in different[:3])
        parts.append(f"{len(different)} differ in shape ({shown})")
    raise ConfigError(f"`ckpt_path={path}` was saved by another model configuration: {'; '.join(parts)}. Resume with "
                      "the `model.*` settings it was trained with, or start a new run.")  # fmt: skip


def _weights_only(method: Any) -> dict[str, bool]:
    """`weights_only=True` for Lightning's checkpoint loads where it takes the argument (Lightning >= 2.5): every
    checkpoint a run resumes or tests (`last`, `best`, SLURM's `hpc`) is loaded without running pickled code."""
    import inspect

    return {"weights_only": True} if "weights_only" in inspect.signature(method).parameters else {}


def _drop_logger_callbacks(callbacks: list[Any]) -> list[Any]:
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.utilities import rank_zero_warn

    kept = [cb for cb in callbacks if not isinstance(cb, LearningRateMonitor)]
    if len(kept) != len(callbacks):
        rank_zero_warn(
            "`logger=none` leaves LearningRateMonitor nothing to log to; it is removed "
            "(add a logger, or `~callbacks.lr_monitor` to silence this).",
            category=LightningAccelWarning,
        )
    return kept


def run(cfg: DictConfig) -> RunSummary | None:
    """See `_run`; what the job sets in `os.environ` (NCCL variables) is removed when it ends, however it ends."""
    with ExitStack() as job_env:
        return _run(cfg, job_env)


def _run(cfg: DictConfig, job_env: ExitStack) -> RunSummary | None:
    """Check the composed config, build data, model, callbacks, loggers and Trainer, fit, test and summarise.

    Returns the summary on global rank zero, None on the other ranks.

    Raises:
        ConfigError: for a setting that cannot work, before any Trainer exists or any process is spawned.
    """
    started = time.perf_counter()
    check_config(cfg)
    resolved = compose.apply_precision(cfg)
    check_combinations(cfg)  # again, now with the precision resolved for this machine
    shape = run_shape(cfg)
    compression = apply_ddp_grad_compression(cfg)
    if compression:
        log.info(compression)
    compose.apply_nccl(cfg, job_env)
    ckpt = check_ckpt_path(cfg)
    if ckpt is not None and Path(ckpt).is_dir() and shape.family not in ("pipeline", "model_parallel", "fsdp",
                                                                         "deepspeed"):  # fmt: skip
        raise ConfigError(f"`ckpt_path={ckpt}` is a distributed checkpoint directory (saved by a pipeline or model-"
                          f"parallel run), which `strategy={shape.family}` cannot load; resume it with the strategy "
                          "that saved it (e.g. `preset=pipeline trainer.devices=2`), or join it into one file with "
                          "`lightning_accel.strategies.consolidate_checkpoint(path, out)` and pass `out`.")
    check_checkpoint_dir(cfg)
    if (shape.distributed or (shape.world_size or 1) > 1) and shape.num_nodes == 1:
        check_master_port()
    callbacks = compose.instantiate_callbacks(cfg)  # their own argument checks, before anything is built or spawned
    split_data_config(OmegaConf.to_container(cfg.data, resolve=True))  # a data setting its target does not take
    if cfg.get("check", False):
        print_check(cfg, resolved)
        return None
    import lightning.pytorch as pl

    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = instantiate_datamodule(cfg.data)  # loader settings it does not take go to its DataLoaders
    model = instantiate(cfg.model)
    check_checkpoint_fits(model, check_ckpt_path(cfg))
    loggers = compose.instantiate_named(cfg.get("logger"))
    if not loggers:
        callbacks = _drop_logger_callbacks(callbacks)
    callbacks += [cb for cb in resolved.callbacks if not any(type(have) is type(cb) for have in callbacks)]
    stats = RunStats()
    with config_paths(cfg):  # a strategy's argument error names `trainer.strategy.<argument>`
        trainer: pl.Trainer = instantiate(cfg.trainer, callbacks=[*callbacks, stats], logger=loggers or False)
    run_dir = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else str(trainer.default_root_dir)
    log.info("resolved config sha256=%s run_dir=%s", config_digest(cfg), run_dir)

    try:
        with config_paths(cfg):
            summary = _fit_and_test(cfg, trainer, model, datamodule, stats, shape, started, run_dir)
    except (ConfigError, NothingLearnedError):
        raise
    except Exception as err:  # name the rank: under DDP the other ranks only see a closed connection
        named = _trainer_setting_error(err, cfg, trainer)
        if named is not None:
            raise named from None
        if isinstance(err, FileNotFoundError) and not Path(run_dir).exists():
            raise NothingLearnedError(f"the run directory {run_dir} was removed while the run was going (at global "
                                      f"step {trainer.global_step}: {err}); its checkpoints and logs went with it. "
                                      "Start the run again in a directory that stays.") from None  # fmt: skip
        message = f"rank {trainer.global_rank} failed at global step {trainer.global_step}: {type(err).__name__}: {err}"
        log.error(message)
        print(f"accel-train: error: {message}", file=sys.stderr, flush=True)
        raise
    if summary is None:
        return None
    write_summary(summary, Path(run_dir) / "summary.json")
    print_summary(summary)
    return summary


def check_learned(trainer: Any, stats: RunStats) -> None:
    """A fit that finished without learning is an error, not a result: every `training_step` returned None, every
    loss was NaN/inf (so NonFiniteGuard dropped every update), or the loss it ended on is NaN/inf.

    Raises:
        NothingLearnedError: saying which, with the numbers and the usual causes.
    """
    import math

    from lightning_accel.callbacks import NonFiniteGuard

    if stats.batches and stats.batches_without_loss == stats.batches:
        raise NothingLearnedError(f"every one of the {stats.batches} training batches ran a `training_step` that "
                                  "returned None, so nothing was trained (Lightning skips the backward of a step "
                                  "without a loss); return the loss from `training_step`.")  # fmt: skip
    guard = next((cb for cb in trainer.callbacks if isinstance(cb, NonFiniteGuard)), None)
    if guard is not None and stats.batches and guard.nonfinite_losses >= stats.batches:
        raise NothingLearnedError(f"all {stats.batches} training batches had a non-finite loss and NonFiniteGuard "
                                  "dropped every update: the weights are the initial ones. Lower "
                                  "`model.optimizer.lr`, check the data for NaN/inf, or try `precision=fp32`.")
    losses = {key: float(value) for key, value in trainer.callback_metrics.items() if "loss" in key}
    bad = {key: value for key, value in losses.items() if not math.isfinite(value)}
    if bad:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(bad.items()))
        raise NothingLearnedError(f"the fit ended with a non-finite loss ({shown}): the weights are NaN/inf or the "
                                  "data is. Lower `model.optimizer.lr` or use `gradient_clip_val`, check the data for "
                                  "NaN/inf, or try `precision=fp32`.")  # fmt: skip


def _fit_and_test(
    cfg: DictConfig,
    trainer: Any,
    model: Any,
    datamodule: Any,
    stats: RunStats,
    shape: RunShape,
    started: float,
    run_dir: str,
) -> RunSummary | None:
    """Fit, then test the best checkpoint; the summary on global rank zero, None elsewhere."""
    metrics: dict[str, float] = {}
    tested = "final"
    with hydra_safe_launch(trainer):
        if cfg.get("fit", True):
            trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"), **_weights_only(trainer.fit))
            metrics.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")})
            check_learned(trainer, stats)
        if cfg.get("test", True):
            best = getattr(trainer.checkpoint_callback, "best_model_path", "")
            tested, ckpt = ("best", "best") if best else ("final", None)
            if not cfg.get("fit", True) and cfg.get("ckpt_path") is not None:  # test the weights asked for
                ckpt = check_ckpt_path(cfg)  # checked before launch: here `last` is resolved to its file again
                tested = f"checkpoint {ckpt}"
            results = trainer.test(model, datamodule=datamodule, ckpt_path=ckpt, verbose=False,
                                   **_weights_only(trainer.test))  # fmt: skip
            metrics.update({k: float(v) for k, v in (results[0] if results else {}).items()})
        log.info("rank %d finished: %s", trainer.global_rank, metrics)
        if not trainer.is_global_zero:
            return None
        return collect_summary(
            trainer, datamodule, stats, shape, metrics, time.perf_counter() - started, run_dir, tested
        )


@hydra.main(version_base="1.3", config_path="pkg://lightning_accel.conf", config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except ConfigError as err:
        print(f"accel-train: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except NothingLearnedError as err:
        print(f"accel-train: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None


def main() -> None:
    """Console entry point of `accel-train` (also `python -m lightning_accel.train`)."""
    try:
        check_output_root(sys.argv[1:])  # Hydra creates the run directory before `run` can check anything
    except ConfigError as err:
        print(f"accel-train: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    _hydra_main()


_MOVED = {"apply_precision", "instantiate_named", "instantiate_callbacks", "apply_nccl"}


def __getattr__(name: str) -> Any:
    """`lightning_accel.train.apply_precision` & co moved to `lightning_accel.compose` (no `@hydra.main` there)."""
    if name in _MOVED:
        import warnings

        from lightning_accel import compose

        message = f"`lightning_accel.train.{name}` moved to `lightning_accel.compose.{name}`; import it from there."
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return getattr(compose, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    main()
