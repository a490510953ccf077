"""What GPUMonitor reads about its job, outside the Trainer's hooks: the publishing settings checked, the run id every
rank shares, the job's facts in the heartbeat, the fit's steps, why it stopped, and this rank's CUDA device (its peak
memory, its UUIDs)."""

from __future__ import annotations

import math
import os
import secrets
import signal
import time
import warnings
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_accel.errors import ConfigError, LightningAccelWarning
from lightning_accel.system.host import external_run_id, hostname
from lightning_accel.telemetry.alerts import AlertThresholds
from lightning_accel.telemetry.health import HealthReader
from lightning_accel.telemetry.heartbeat import current_user
from lightning_accel.telemetry.heartbeat_alerts import HeartbeatAlerts, HeartbeatAlertSettings
from lightning_accel.telemetry.publisher import JobInfo, process_command

__all__ = [
    "allocated_pct",
    "check_publishing",
    "cuda_uuids",
    "health_reader",
    "heartbeat_checks",
    "job_info",
    "shared_run_id",
    "total_steps",
    "warn_publishing",
    "why_stopped",
]


def check_publishing(interval_s: Any, port: Any, addr: Any, file_sd_dir: Any) -> None:
    if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s >= 0.2:
        raise ConfigError(
            f"`publish_interval_s={interval_s!r}` must be a number of seconds >= 0.2 (2.0: a heartbeat every 2 s)."
        )
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
        raise ConfigError(
            f"`prometheus_port={port!r}` must be a TCP port 0-65535 (0: a free one), or None for no /metrics server."
        )
    if not isinstance(addr, str) or not addr:
        raise ConfigError(f"`prometheus_addr={addr!r}` must be an address to bind, e.g. '127.0.0.1' or '0.0.0.0'.")
    if file_sd_dir is not None and port is None:
        raise ConfigError(
            f"`prometheus_file_sd_dir={str(file_sd_dir)!r}` writes a scrape target of the /metrics "
            "server, but `prometheus_port=None` serves none; set `prometheus_port=0` (a free port)."
        )


def warn_publishing(message: str) -> None:
    warnings.warn(f"GPUMonitor: {message}. Training goes on.", LightningAccelWarning, stacklevel=2)


def heartbeat_checks(
    trainer: pl.Trainer, thresholds: AlertThresholds, log_metrics: bool, hung_after_steps: float | None
) -> HeartbeatAlerts:
    """The heartbeat's own alerts: the window alerts' thresholds where `log_metrics` does not check those already,
    the hung-job alert, and the non-finite losses the Trainer's NonFiniteGuard (if any) counts."""
    callbacks: list[Any] = getattr(trainer, "callbacks", [])
    guard = next((c for c in callbacks if isinstance(getattr(c, "nonfinite_losses", None), int)), None)
    settings = HeartbeatAlertSettings(
        max_throttle_pct=None if log_metrics else thresholds.max_throttle_pct,
        min_memory_headroom_pct=None if log_metrics else thresholds.min_memory_headroom_pct,
        hung_after_steps=hung_after_steps,
    )
    return HeartbeatAlerts(settings, nonfinite=None if guard is None else (lambda: int(guard.nonfinite_losses)))


def health_reader(devices: Sequence[Any]) -> HealthReader | None:
    """The node's card-health reader (XID events, ECC, remapped rows, a lost card) for the publisher's thread; None
    without cards, or where it cannot start (warned: training goes on)."""
    if not devices:
        return None
    try:
        return HealthReader(devices)
    except Exception as err:  # NVML refused the event sets: health is left out, nothing else
        warn_publishing(f"no card health in the heartbeat ({type(err).__name__}: {err})")
        return None


def shared_run_id(trainer: pl.Trainer) -> str:
    """The id every rank of the run shares: the launcher's (`ACCEL_RUN_ID`, torchrun's, a SLURM step's), else one
    rank zero draws (`<host>-<time>-<pid>-<token>`) and broadcasts."""
    try:
        run_id = external_run_id("")
    except ConfigError:  # an id of dots alone: accel-train refuses it before this; here, draw one
        run_id = ""
    if run_id:
        return run_id
    drawn = f"{hostname()}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(2)}"  # 2 fits a second
    return str(trainer.strategy.broadcast(drawn)) if trainer.world_size > 1 else drawn


def job_info(trainer: pl.Trainer, run_id: str, name: str, gpus: list[dict[str, Any]]) -> JobInfo:
    """The job's fixed facts in this node's heartbeat: who runs it and where, its ranks on this node with their
    devices (and UUIDs, from the watched `gpus`), and the node's share of the run's ranks."""
    node_devices = getattr(trainer.strategy, "parallel_devices", None) or [trainer.strategy.root_device]
    uuids = {gpu["index"]: gpu["uuid"] for gpu in gpus}
    ranks = [
        {
            "rank": trainer.node_rank * len(node_devices) + local,
            "local_rank": local,
            "device": str(device),
            "uuid": uuids.get(device.index or 0) if device.type == "cuda" else None,
        }
        for local, device in enumerate(node_devices)
    ]
    return JobInfo(
        run_id=run_id,
        name=name,
        host=hostname(),
        user=current_user(),
        pid=os.getpid(),
        command=process_command(),
        node_rank=trainer.node_rank,
        num_nodes=trainer.num_nodes,
        rank=trainer.global_rank,
        ranks=ranks,
        slurm_job_id=os.environ.get("SLURM_JOB_ID") or None,
        gpus=gpus,
        node_share=len(node_devices) / max(trainer.world_size, 1),
    )


def total_steps(trainer: pl.Trainer) -> int | None:
    """The optimizer steps the fit will take, or None when unbounded or unknown."""
    try:
        total = trainer.estimated_stepping_batches
    except Exception:  # an iterable without a length, a strategy that cannot say
        return None
    return int(total) if isinstance(total, (int, float)) and math.isfinite(total) else None


def why_stopped(exception: BaseException, step: int) -> str:
    signum = getattr(exception, "signum", None)
    if isinstance(signum, int):
        return f"stopped by {signal.Signals(signum).name} at step {step}"
    return f"{type(exception).__name__} at step {step}: {str(exception)[:300]}"


def allocated_pct(device: torch.device) -> tuple[int, float]:
    """(this rank's CUDA device index, the peak share of its memory the run's tensors took); (-1, nan) off CUDA."""
    if device.type != "cuda":
        return -1, math.nan
    try:
        index = device.index or 0
        total = torch.cuda.get_device_properties(index).total_memory
        return index, 100.0 * torch.cuda.max_memory_allocated(index) / total
    except Exception:  # monitoring never stops training
        return -1, math.nan


def cuda_uuids(indices: Sequence[int]) -> list[str] | None:
    """The UUIDs CUDA reports for these ordinals (exact whatever CUDA_DEVICE_ORDER says), or None."""
    try:
        return [str(torch.cuda.get_device_properties(index).uuid) for index in indices]
    except Exception:  # no CUDA, or a torch without `uuid`: CUDA_VISIBLE_DEVICES decides
        return None
