"""Energy counters: NVML's total energy of a set of GPUs, or RAPL's CPU package energy; no Lightning imports.

`open_energy_meter` returns a meter that reads cumulative joules, or the reason there is none. A meter pauses and
resumes (`pause`, `resume`) so that only the segments you measure count (accel-bench leaves validation passes out).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lightning_accel.telemetry import nvml

__all__ = ["EnergyMeter", "open_energy_meter", "rapl_domains"]


@dataclass
class _Rapl:
    """One RAPL package domain: a microjoule counter that wraps at `max_energy_range_uj`."""

    path: Path
    wrap_uj: int
    last_uj: int = 0
    total_uj: int = 0

    def read_j(self) -> float:
        now = int((self.path / "energy_uj").read_text())
        if now < self.last_uj:  # wrapped past max_energy_range_uj
            self.total_uj += self.wrap_uj - self.last_uj + now
        elif self.last_uj:
            self.total_uj += now - self.last_uj
        self.last_uj = now
        return self.total_uj / 1e6


def rapl_domains(root: str | os.PathLike[str] = "/") -> tuple[list[Path], str]:
    """The readable top-level RAPL package domains (`intel-rapl:N`), or none and why."""
    base = Path(root) / "sys" / "class" / "powercap"
    if not base.is_dir():
        return [], f"no RAPL on this machine: {base} does not exist"
    domains = sorted(p for p in base.iterdir() if re.fullmatch(r"intel-rapl:\d+", p.name))
    if not domains:
        return [], f"no RAPL package domain under {base}"
    readable = []
    for domain in domains:
        try:
            int((domain / "energy_uj").read_text())
            readable.append(domain)
        except (OSError, ValueError):
            continue
    if not readable:
        return [], f"RAPL counters under {base} are not readable by this user: root only since Linux 5.10"
    return readable, ""


@dataclass
class EnergyMeter:
    """Cumulative energy of its devices in joules, counting only the time it is running (it starts running)."""

    source: str
    """What it reads, in words ("NVML total energy of 2 GPU(s)", "RAPL package-0, package-1")."""
    read_j: Callable[[], float]
    """The devices' cumulative energy counter, in joules (any origin)."""
    joules: float = 0.0
    """Energy counted so far over the running segments."""
    close: Callable[[], None] = lambda: None
    """Releases what the meter holds (NVML)."""
    _since: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._since = self.read_j()

    def pause(self) -> float:
        """Stop counting (a no-op when paused); returns the energy counted so far."""
        if self._since is not None:
            self.joules += max(0.0, self.read_j() - self._since)
            self._since = None
        return self.joules

    def resume(self) -> None:
        if self._since is None:
            self._since = self.read_j()


def _nvml_meter(cuda_indices: Sequence[int]) -> tuple[EnergyMeter | None, str]:
    reason = nvml.init_nvml()
    if reason:
        return None, reason
    try:
        devices = nvml.resolve_devices(list(cuda_indices), os.environ.get("CUDA_VISIBLE_DEVICES"))
    except Exception as err:
        nvml.shutdown_nvml()
        return None, f"the GPUs could not be resolved in NVML ({type(err).__name__}: {err})"
    # a MIG device shares its parent's energy counter: count each physical GPU once
    handles = list({d.nvml_index: d.parent if d.parent is not None else d.handle for d in devices}.values())

    def read_j() -> float:
        return sum(int(nvml.pynvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in handles) / 1000.0

    try:
        meter = EnergyMeter(
            source=f"NVML total energy of {len(handles)} GPU(s)", read_j=read_j, close=nvml.shutdown_nvml
        )
    except Exception as err:
        nvml.shutdown_nvml()
        why = "not supported by this GPU or driver (Volta or newer)" if nvml.unsupported(err) else f"{err}"
        return None, f"NVML total energy counter: {why}"
    if any(d.parent is not None for d in devices):
        meter.source += " (whole GPUs: a MIG slice shares its GPU's counter)"
    return meter, ""


def open_energy_meter(
    cuda_indices: Sequence[int] | None = None, root: str | os.PathLike[str] = "/"
) -> tuple[EnergyMeter | None, str]:
    """A running meter over the GPUs at `cuda_indices` (NVML), or over the CPU packages (RAPL) when None; or None
    and why not (no NVML energy counter, no readable RAPL)."""
    if cuda_indices is not None:
        return _nvml_meter(cuda_indices)
    domains, reason = rapl_domains(root)
    if not domains:
        return None, reason
    counters = []
    for domain in domains:
        try:
            wrap = int((domain / "max_energy_range_uj").read_text())
        except (OSError, ValueError):
            wrap = 2**32
        counters.append(_Rapl(domain, wrap))

    def read_j() -> float:
        return sum(counter.read_j() for counter in counters)

    names = []
    for domain in domains:
        try:
            names.append((domain / "name").read_text().strip())
        except OSError:
            names.append(domain.name)
    return EnergyMeter(
        source=f"RAPL {', '.join(names)} (whole CPU packages: other processes included)", read_j=read_j
    ), ""
