"""Host facts around a training process: the /dev/shm size, InfiniBand/RoCE ports, the NCCL variables set and the
run id a launcher shares between ranks."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_accel.errors import ConfigError

__all__ = [
    "MAX_RUN_ID",
    "IbPort",
    "ShmInfo",
    "external_run_id",
    "hostname",
    "read_infiniband",
    "read_nccl_env",
    "read_shm",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ShmInfo:
    """The shared-memory file system DataLoader workers hand batches through."""

    path: str
    size_bytes: int
    """Total size (Docker's default is 64 MiB)."""
    free_bytes: int
    """Space left for unprivileged writers."""


@dataclass(frozen=True, kw_only=True, slots=True)
class IbPort:
    """One port of an RDMA device under `/sys/class/infiniband`."""

    device: str
    """The device (`mlx5_0`), as `NCCL_IB_HCA` names it."""
    port: int
    state: str
    """`ACTIVE`, `DOWN`, `INIT`, `ARMED`, ... (the text after `4: ` in the `state` file)."""
    link_layer: str = ""
    """`InfiniBand`, or `Ethernet` for RoCE."""
    rate: str = ""
    """As the kernel reports it, e.g. `200 Gb/sec (4X HDR)`."""

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""


def read_shm(root: str | os.PathLike[str] = "/", statvfs: Callable[[str], Any] | None = None) -> ShmInfo | None:
    """Size and free space of `<root>/dev/shm`; None where it does not exist (macOS, Windows).

    Args:
        root: the file-system root.
        statvfs: `os.statvfs` or a stand-in for tests; None: `os.statvfs`.
    """
    path = Path(root, "dev", "shm")
    if not path.is_dir():
        return None
    try:
        stat = (statvfs or os.statvfs)(str(path))
    except OSError:
        return None
    block = stat.f_frsize or stat.f_bsize
    return ShmInfo(path=str(path), size_bytes=block * stat.f_blocks, free_bytes=block * stat.f_bavail)


def read_infiniband(root: str | os.PathLike[str] = "/") -> tuple[IbPort, ...]:
    """Every port of every RDMA device under `<root>/sys/class/infiniband` (InfiniBand and RoCE); empty when none."""
    ports = []
    base = Path(root, "sys", "class", "infiniband")
    try:
        devices = sorted(p for p in base.iterdir() if p.is_dir())
    except OSError:
        return ()
    for device in devices:
        try:
            port_dirs = sorted((p for p in (device / "ports").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
        except OSError:
            continue
        for port in port_dirs:
            state = _read(port / "state")
            ports.append(
                IbPort(
                    device=device.name,
                    port=int(port.name),
                    state=state.partition(":")[2].strip() or state or "UNKNOWN",
                    link_layer=_read(port / "link_layer"),
                    rate=_read(port / "rate"),
                )
            )
    return tuple(ports)


def read_nccl_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The `NCCL_*` variables set in `env` (None: `os.environ`), sorted by name."""
    env = os.environ if env is None else env
    return {key: env[key] for key in sorted(env) if key.startswith("NCCL_")}


def hostname() -> str:
    """This node's host name, to name it in a report."""
    return socket.gethostname()


MAX_RUN_ID = 200
"""The longest run id (`ACCEL_RUN_ID` & co, characters) a run directory is named after."""


def external_run_id(default: str, env: Mapping[str, str] | None = None) -> str:
    """The id every rank of an externally launched job shares, else `default` (a unique stamp).

    torchrun gives every rank the same `TORCHELASTIC_RUN_ID` (a fresh one per `--standalone` launch, else the
    `--rdzv-id`), so ranks started a second apart still write into one run directory; `ACCEL_RUN_ID` wins over it.
    Inside a SLURM job step (srun sets `SLURM_STEP_ID`) the id is `slurm-<job>.<step>`: every task of the step shares
    it, and a requeued job, which keeps its job id and runs its steps again, finds its run directory and Lightning's
    `hpc_ckpt_<n>.ckpt` in it, and resumes. The id names one directory: characters other than letters, digits, `.`,
    `_` and `-` become `_` (`../../x` -> `.._.._x`, never a path outside the log directory), and an id of dots alone
    is refused.

    Raises:
        ConfigError: for an id that is empty or only dots after that.
    """
    env = os.environ if env is None else env
    candidates = [(key, env.get(key, "")) for key in ("ACCEL_RUN_ID", "TORCHELASTIC_RUN_ID")]
    if env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID") is not None:
        candidates.append(("SLURM_JOB_ID", f"slurm-{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}"))
    for key, value in candidates:
        if value and value != "none":
            safe = re.sub(r"[^A-Za-z0-9._-]", "_", value)
            if len(safe) > MAX_RUN_ID:  # a file name is at most 255 bytes; the run directory adds a stamp and more
                raise ConfigError(
                    f"`{key}` is {len(safe)} characters long; a run id names one directory, so keep it "
                    f"to {MAX_RUN_ID} (e.g. the job id)."
                )
            if not safe.strip("."):
                raise ConfigError(
                    f"`{key}={value!r}` cannot name a run directory; use letters, digits, `.`, `_` or "
                    "`-` (e.g. the job id)."
                )
            return safe
    return default
