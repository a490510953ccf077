"""Hydra-safe launching of Lightning's DDP child ranks: one run or sweep directory, no nested sweeps.

Lightning starts ranks 1..N-1 by re-running the script with `sys.argv` (Lightning issue #11300). Under a Hydra
multirun that argv still holds `-m` and the sweep, so each child rank launches the whole sweep again into a second
sweep directory; and after the first job the launcher's environment variables (`LOCAL_RANK`, ...) stay set, so the
next job believes its ranks were started externally and waits for peers that never come.
`hydra_safe_launch` fixes both for any Hydra app: child ranks get the job's own overrides in run mode, pointed at
the job's output directory, and the environment is restored after each job.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from lightning_accel import _lightning
from lightning_accel.errors import ConfigError
from lightning_accel.files import directory_write_error
from lightning_accel.system.host import MAX_RUN_ID, external_run_id

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "MAX_RUN_ID",
    "check_output_root",
    "child_rank_command",
    "external_rank_job_name",
    "external_run_id",
    "hydra_safe_launch",
    "fused_resolver",
    "log_root",
    "on_cuda_resolver",
    "precision_resolver",
    "register_resolvers",
    "resolve_run_id",
    "unique_stamp",
]

_PROCESS_TOKEN = secrets.token_hex(3)  # one per process: two runs started in the same second get two directories

log = logging.getLogger(__name__)

# Set by Lightning's launcher in the parent process for the children to inherit.
_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
# Hydra command-line flags (with a value) that choose the primary config: kept for the child ranks.
_CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")
# Settings the child command sets itself, and launcher/sweeper choices that only the parent may use.
_PARENT_ONLY = (
    "hydra.run.dir",
    "hydra.output_subdir",
    "hydra.job.name",
    "hydra.mode",
    "hydra.sweep.",
    "hydra/launcher",
    "hydra/sweeper",
    "hydra.launcher.",
    "hydra.sweeper.",
)


def _config_flags(argv: Sequence[str]) -> list[str]:
    kept: list[str] = []
    args = iter(argv)
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in _CONFIG_FLAGS:
            kept.append(arg)
            if "=" not in arg:
                kept.append(next(args, ""))
    return kept


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("~+")


def _quote(value: str) -> str:
    escaped = value.replace("'", "\\'")
    return f"'{escaped}'"


def child_rank_command(local_rank: int) -> tuple[list[str], str]:
    """The command (and working directory) that starts DDP child rank `local_rank` of the current Hydra job.

    It re-runs the app in run mode with the job's own overrides (not the sweep's), writing into the job's output
    directory under the job name `<name>_rank<k>`, and without saving the config a second time.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd, to_absolute_path

    import __main__

    hydra_cfg = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    command += _config_flags(sys.argv[1:])
    command += [o for o in hydra_cfg.overrides.hydra if not _override_key(o).startswith(_PARENT_ONLY)]
    command += list(hydra_cfg.overrides.task)
    command += [
        f"hydra.run.dir={_quote(hydra_cfg.runtime.output_dir)}",
        "hydra.output_subdir=null",
        f"hydra.job.name={hydra_cfg.job.name}_rank{local_rank}",
        "hydra.mode=RUN",
    ]
    return command, get_original_cwd()


def _wait_for_children(trainer: pl.Trainer | None, timeout_s: float) -> None:
    """Wait for the child ranks the Trainer's launcher started, killing those still running after `timeout_s`.

    `ddp` starts them with `subprocess.Popen` (`wait`); `ddp_spawn`, `ddp_fork` and `ddp_notebook` with
    `multiprocessing` (`join`; Lightning has already joined them when the launch returns).
    """
    launcher = getattr(trainer.strategy, "launcher", None) if trainer is not None else None
    for proc in getattr(launcher, "procs", None) or ():
        if hasattr(proc, "wait"):  # subprocess.Popen
            try:
                proc.wait(timeout=timeout_s)
                continue
            except subprocess.TimeoutExpired:
                pass
        else:  # multiprocessing.Process
            proc.join(timeout=timeout_s)
            if not proc.is_alive():
                continue
        log.warning("Child rank process %d still runs %.0f s after the job ended; killing it.", proc.pid, timeout_s)
        proc.kill()


@contextmanager
def hydra_safe_launch(trainer: pl.Trainer | None = None, child_timeout_s: float = 120.0) -> Iterator[None]:
    """Run `trainer.fit`/`trainer.test` inside this to launch DDP child ranks correctly from a Hydra app.

    Outside a Hydra app it changes nothing. On exit it waits for the child ranks of `trainer` (up to
    `child_timeout_s`), restores the launcher's environment variables and destroys the process group, so the next
    job of a multirun starts clean.

    Example::

        @hydra.main(config_path="conf", config_name="config", version_base="1.3")
        def main(cfg):
            trainer = hydra.utils.instantiate(cfg.trainer)
            with hydra_safe_launch(trainer):
                trainer.fit(model)
    """
    saved = {key: os.environ.get(key) for key in _LAUNCH_ENV}
    undo = ExitStack()
    try:
        undo.callback(_lightning.patch_hydra_subprocess_cmd(child_rank_command, "launching DDP child ranks from Hydra"))
        yield
    finally:
        undo.close()
        _wait_for_children(trainer, child_timeout_s)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def resolve_run_id(stamp: Any) -> str:
    """`${accel_run_id:STAMP}`: the external run id, else `unique_stamp(STAMP)`."""
    return external_run_id(unique_stamp(stamp))


def unique_stamp(stamp: Any) -> str:
    """`stamp` (a time to the second) and a token drawn once per process: runs started in the same second, on one
    machine or on several sharing a file system, get different directories, and every lookup in one process agrees."""
    return f"{stamp!s}_{_PROCESS_TOKEN}"


def external_rank_job_name(default: str, env: Mapping[str, str] | None = None) -> str:
    """`default`, or `<default>_rank<k>` on rank k > 0 of an externally launched job (torchrun's `RANK`, SLURM's
    `SLURM_PROCID` when it runs several tasks), so each rank logs into its own file of the shared run directory."""
    env = os.environ if env is None else env
    rank = env.get("RANK") or (env.get("SLURM_PROCID") if int(env.get("SLURM_NTASKS", "1") or 1) > 1 else None)
    return f"{default}_rank{rank}" if rank and rank != "0" else default


_NO_RUN_FLAGS = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "--shell-completion", "-sc")


def _override(argv: Sequence[str], key: str) -> str | None:
    for arg in reversed(argv):
        name, sep, value = arg.partition("=")
        if sep and name.lstrip("+~") == key:
            return value.strip("'\"")
    return None


def check_output_root(argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    """Fail with the setting's name when the directory runs are written under cannot be created or written.

    Hydra creates the run directory before the app runs, so without this an unwritable `paths.log_dir` ends in
    chained tracebacks that never name it. Checked: `hydra.run.dir` (or `hydra.sweep.dir` with `-m`) when given on
    the command line, else `paths.log_dir`, else `$ACCEL_LOG_DIR`, else `outputs`; a part after `${` is left to
    Hydra. Nothing is checked for `--help`, `--cfg` and the like.

    Raises:
        ConfigError: naming the setting, the directory and the error.
    """
    env = os.environ if env is None else env
    log_root(env)
    external_run_id("check", env)  # ACCEL_RUN_ID & co: refused here, before Hydra resolves the run directory
    if any(arg in _NO_RUN_FLAGS or arg.startswith("--cfg=") for arg in argv):
        return
    multirun = any(arg in ("-m", "--multirun") for arg in argv)
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    value = _override(argv, key)
    if value is None:
        key, value = "paths.log_dir", _override(argv, "paths.log_dir")
    if value is None and env.get("ACCEL_LOG_DIR"):
        key, value = "ACCEL_LOG_DIR", env["ACCEL_LOG_DIR"]
    if value is None:
        key, value = "paths.log_dir", "outputs"
    if key == "paths.log_dir" and value == "outputs" and any(a.split("=", 1)[0].lstrip("+~") == "paths" for a in argv):
        return  # another `paths` config chooses the log directory
    if "${" in value:  # resolved by Hydra later; only a prefix that already exists as a file is wrong for sure
        head = value.split("${", 1)[0]
        prefix = head.rstrip("/") if head.endswith("/") else os.path.dirname(head)
        while prefix and not os.path.lexists(prefix) and os.path.dirname(prefix) != prefix:
            prefix = os.path.dirname(prefix)
        if prefix and os.path.exists(prefix) and not os.path.isdir(prefix):
            raise ConfigError(
                f"`{key}={value}`: {prefix!r} is a file, not a directory; point `paths.log_dir` (or "
                "ACCEL_LOG_DIR) at a writable directory."
            )
        return
    problem = directory_write_error(value)
    if problem is not None:
        raise ConfigError(
            f"`{key}={value}`: runs cannot be written under {value!r}: {problem}; point `paths.log_dir` (or "
            "ACCEL_LOG_DIR) at a writable directory."
        )


def log_root(env: Mapping[str, str] | None = None) -> str:
    """Where runs, benches and tunes go: `$ACCEL_LOG_DIR`, else `outputs` (relative to the working directory).

    Raises:
        ConfigError: for an `ACCEL_LOG_DIR` that is set but empty (`conf/paths` would read it as "" and write runs
            under `/runs` at the file system's root).
    """
    env = os.environ if env is None else env
    value = env.get("ACCEL_LOG_DIR")
    if value is not None and not value.strip():
        raise ConfigError(
            f"`ACCEL_LOG_DIR={value!r}` is set but empty: runs would be written under `/runs` at the "
            "file system's root; unset it (`unset ACCEL_LOG_DIR`) or set it to a directory."
        )
    return value or "outputs"


def precision_resolver(requested: Any, accelerator: Any = "auto") -> str:
    """`${accel_precision:amp,${trainer.accelerator}}`: the Lightning precision string `amp` (or any request) means on
    this machine, so a Trainer built from the config needs no `apply_precision` call (conf/precision/amp.yaml)."""
    from lightning_accel.precision import resolve_precision

    accelerator = str(accelerator) if accelerator is not None else "auto"
    return resolve_precision(str(requested), accelerator, setting="trainer.precision").value


def on_cuda_resolver(accelerator: Any = "auto") -> bool:
    """`${accel_on_cuda:${trainer.accelerator}}`: whether the run is on CUDA (`gpu`/`cuda`, or `auto` with a visible
    CUDA device), e.g. `data.pin_memory` in the amp and ddp presets: pinned host batches, which Lightning copies to
    the GPU with `non_blocking=True`, on CUDA only (pinning without a GPU only costs)."""
    name = str(accelerator) if accelerator is not None else "auto"
    if name in ("gpu", "cuda"):
        return True
    if name == "auto":
        from lightning_accel.shape import runs_on_cuda

        return runs_on_cuda(OmegaConf.create({"trainer": {"accelerator": "auto"}}))
    return False


def fused_resolver(accelerator: Any = "auto") -> bool | None:
    """`${accel_fused:${trainer.accelerator}}`: `fused=True` for the example models' AdamW when the run is on CUDA
    (one kernel for the whole update), None elsewhere (torch's default, the foreach implementation)."""
    return True if on_cuda_resolver(accelerator) else None


def register_resolvers() -> None:
    """`${accel_run_id:STAMP}`, `${accel_unique:STAMP}` and `${accel_job_name:DEFAULT}` for conf/hydra/default.yaml
    (idempotent)."""
    if not OmegaConf.has_resolver("accel_run_id"):
        # cached in the config, like Hydra's `now`: a submitit job (another process, another token) that resolves
        # the sweep directory again from the pickled config gets the same one, and so does its requeue
        OmegaConf.register_new_resolver("accel_run_id", resolve_run_id, use_cache=True)
    if not OmegaConf.has_resolver("accel_precision"):
        OmegaConf.register_new_resolver("accel_precision", precision_resolver, use_cache=True)
    if not OmegaConf.has_resolver("accel_unique"):
        OmegaConf.register_new_resolver("accel_unique", unique_stamp, use_cache=True)
    if not OmegaConf.has_resolver("accel_fused"):
        OmegaConf.register_new_resolver("accel_fused", fused_resolver, use_cache=True)
    if not OmegaConf.has_resolver("accel_on_cuda"):
        OmegaConf.register_new_resolver("accel_on_cuda", on_cuda_resolver, use_cache=True)
    if not OmegaConf.has_resolver("accel_job_name"):
        OmegaConf.register_new_resolver("accel_job_name", lambda default: external_rank_job_name(str(default)))
