"""Where a run writes and how its ranks meet: every output directory a callback or logger names, and `MASTER_PORT`,
checked before launch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig

from lightning_accel.errors import ConfigError

__all__ = ["OUTPUT_DIR_KEYS", "check_master_port", "check_output_dirs"]


OUTPUT_DIR_KEYS = (
    "dirpath",
    "save_dir",
    "report_dir",
    "runs_dir",
    "cache_dir",
    "prometheus_textfile_dir",
    "prometheus_file_sd_dir",
)
"""The settings of a callback or logger that name a directory it writes into (checked before launch)."""


def check_output_dirs(cfg: DictConfig) -> None:
    """Every directory a callback or logger of the run writes into, where the config names one (`logger.csv.save_dir`,
    `callbacks.gpu_monitor.report_dir`, `callbacks.nonfinite.dirpath`, ...), can be created and written, before
    launch: a logger's failed at the first step with a traceback; the others lost their output silently or late
    (a NaN checkpoint, a report at the end of the run). Nothing is created.

    Raises:
        ConfigError: naming the setting, the path in the way and what the OS said (`Read-only file system (EROFS)`).
    """
    from lightning_accel.files import directory_write_error

    for group in ("callbacks", "logger"):
        nodes = cfg.get(group) or {}
        for name, node in nodes.items() if isinstance(nodes, (DictConfig, Mapping)) else ():
            if not isinstance(node, (DictConfig, Mapping)) or (group, name) == ("callbacks", "model_checkpoint"):
                continue  # `check_checkpoint_dir` checks that one when the run fits
            for key in OUTPUT_DIR_KEYS:
                value = node.get(key)
                if not isinstance(value, str) or not value or "://" in value:
                    continue
                problem = directory_write_error(value)
                if problem is not None:
                    raise ConfigError(
                        f"`{group}.{name}.{key}={value}` cannot be written: {problem}; point it at a writable "
                        "directory."
                    )


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
            raise ConfigError(
                f"`MASTER_PORT={port}` is taken by another process, so the ranks could not meet; unset "
                "it (Lightning picks a free port) or choose a free one."
            ) from None
