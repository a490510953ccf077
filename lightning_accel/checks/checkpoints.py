"""The checkpoint a run would load (`ckpt_path`, the HPC checkpoint under SLURM), whether it fits the model, and the
checkpoint directory a run writes: checked before launch."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_accel.errors import ConfigError

log = logging.getLogger("lightning_accel.checks")

__all__ = ["check_checkpoint_dir", "check_checkpoint_fits", "check_ckpt_path", "check_hpc_checkpoint"]


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
            raise ConfigError(
                f"`ckpt_path=last` finds no {last}: this run directory "
                "holds no earlier run. Resume in the earlier run's directory "
                "(`hydra.run.dir=<its directory> ckpt_path=last`) or pass its checkpoint file "
                "(`ckpt_path=<dir>/checkpoints/last.ckpt`)."
            )
        path = last  # checked below like any path: Lightning drops `weights_only` for some strategies
    import zipfile

    file = Path(str(path))
    recover_directory(file)
    if not file.exists():
        raise ConfigError(
            f"`ckpt_path={str(path)!r}` does not exist; pass a checkpoint file (`.../checkpoints/"
            "last.ckpt`) or `ckpt_path=last` in the run directory to resume."
        )
    if not (file.is_dir() or file.is_file()):  # a FIFO or a device would block the first read
        raise ConfigError(
            f"`ckpt_path={str(path)!r}` is not a regular file or directory (a pipe, a socket or a "
            "device); pass a checkpoint file or directory."
        )
    if file.is_dir() and not (file / ".metadata").is_file():
        raise ConfigError(
            f"`ckpt_path={str(path)!r}` is a directory but not a distributed checkpoint (no "
            "`.metadata`); pass a checkpoint file or a directory a PipelineStrategy or "
            "ModelParallelStrategy run saved."
        )
    if file.is_file() and not zipfile.is_zipfile(file):
        raise ConfigError(
            f"`ckpt_path={str(path)!r}` is not a checkpoint (not a torch.save archive: truncated, "
            "corrupt or another kind of file); pass the run's `checkpoints/last.ckpt` or another "
            "checkpoint."
        )
    from lightning_accel.strategies.dcp_checks import check_distributed_checkpoint, load_metadata

    # no pickle payload runs: a file (or any file of a distributed checkpoint: index, shards, meta.pt) needing more
    # than tensors and plain types is refused here, whatever torch's default `weights_only` is (False before 2.6)
    if file.is_dir():
        check_distributed_checkpoint(file)
    else:
        load_metadata(file, mmap=True)  # mapped, not read: every rank checks, before launch
    return str(file)


def check_hpc_checkpoint(cfg: DictConfig) -> str | None:
    """The HPC checkpoint Lightning resumes from by itself, checked before launch like any `ckpt_path`: under SLURM
    with `ckpt_path=null` (or `ckpt_path=hpc`) Lightning loads the newest `hpc_ckpt_<n>.ckpt` in the run directory
    (`trainer.default_root_dir`), which a requeued job finds there.

    Returns:
        The HPC checkpoint Lightning will load, or None.

    Raises:
        ConfigError: naming the file, that it holds objects torch's `weights_only` load refuses (or is no checkpoint
            at all), and the fix.
    """
    import pickle

    import torch
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from lightning_accel.strategies.dcp_checks import refused_object

    asked = cfg.get("ckpt_path")
    if not cfg.get("fit", True) or not (asked == "hpc" or (asked is None and SLURMEnvironment.detect())):
        return None
    root = OmegaConf.select(cfg, "trainer.default_root_dir", default=None)
    folder = Path(str(root)) if root is not None and "://" not in str(root) else None
    versions = [] if folder is None or not folder.is_dir() else list(folder.glob("hpc_ckpt_*.ckpt"))
    numbered = [(int(p.stem.rsplit("_", 1)[1]), p) for p in versions if p.stem.rsplit("_", 1)[1].isdigit()]
    if not numbered:
        return None
    hpc = max(numbered)[1]
    resumed = f"which Lightning resumes from by itself under SLURM (`ckpt_path={asked or 'null'}`)"
    try:
        torch.load(hpc, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        raise ConfigError(
            f"the HPC checkpoint {hpc}, {resumed}, holds objects that torch's `weights_only` load refuses "
            f"({refused_object(err)}): loading it could run code, so it is not loaded. If this job did not save it, "
            f"or you do not trust it, move it out of {hpc.parent} (the job then starts afresh, or resumes with "
            "`ckpt_path=last`); if you made it and trust it, load it once with `torch.load(path, weights_only=False)` "
            "and save its tensors and plain values again."
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as err:  # truncated, or not torch's archive
        raise ConfigError(
            f"the HPC checkpoint {hpc}, {resumed}, is not a readable torch checkpoint ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else 'no detail'}); move it out of {hpc.parent} (the job then "
            "starts afresh, or resumes with `ckpt_path=last`)."
        ) from None
    return str(hpc)


def check_checkpoint_dir(cfg: DictConfig) -> None:
    """The checkpoint directory can be written, before anything trains (a read-only one failed at the first save,
    after training); what killed saves left in it is removed.

    Raises:
        ConfigError: naming `callbacks.model_checkpoint.dirpath`, the path and what the OS said.
    """
    from lightning_accel.files import directory_write_error
    from lightning_accel.strategies.checkpoint_io import remove_stale_temporaries

    dirpath = OmegaConf.select(cfg, "callbacks.model_checkpoint.dirpath", default=None)
    if dirpath is None or "://" in str(dirpath) or not cfg.get("fit", True):
        return
    problem = directory_write_error(str(dirpath))
    if problem is not None:
        raise ConfigError(
            f"`callbacks.model_checkpoint.dirpath={dirpath}` cannot be written: {problem}; make it writable or "
            "point it elsewhere."
        )
    removed = remove_stale_temporaries(str(dirpath))
    if removed:
        log.info("removed what killed saves left in %s: %s", dirpath, ", ".join(p.name for p in removed))


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
    raise ConfigError(
        f"`ckpt_path={path}` was saved by another model configuration: {'; '.join(parts)}. Resume with "
        "the `model.*` settings it was trained with, or start a new run."
    )
