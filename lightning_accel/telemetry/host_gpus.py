"""This machine's GPUs as gpustat shows them, for accel-dash: one reading of each card, and the processes on it with
their users where NVML and /proc let us see them; no Lightning imports."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from lightning_accel.telemetry import nvml
from lightning_accel.telemetry.readings import DeviceReader

__all__ = ["HostGPUs"]

_READINGS = ("utilization", "memory", "power", "temperature", "gpm")
_MIB = 2**20


def _process(pid: int, used_bytes: Any) -> dict[str, Any]:
    """A process on a GPU: its user and name where this user may read them ("?" where not)."""
    import psutil

    user = name = "?"
    try:
        process = psutil.Process(pid)
        user, name = process.username(), process.name()
    except Exception:  # gone, another PID namespace (containers), or not ours to read
        pass
    memory = used_bytes / _MIB if isinstance(used_bytes, int) and 0 < used_bytes < 2**63 else None
    return {"pid": pid, "user": user, "name": name, "memory_mib": memory}


class HostGPUs:
    """Reads every GPU of this machine (whole GPUs and MIG devices) through NVML, keeping NVML open between reads
    (GPM activity needs two samples: the first read of a card has none).

    `read()` never raises: without NVML it returns [] and `problem` says why; a card that fails is left out.
    """

    def __init__(self) -> None:
        self.problem: str | None = None
        self._readers: list[DeviceReader] | None = None
        self._initialised = False
        self._lock = threading.Lock()

    def _open(self) -> None:
        problem = nvml.init_nvml()
        if problem is not None:
            self.problem, self._readers = problem, []
            return
        self._initialised = True
        readers = []
        try:
            for device in nvml.inventory():
                if device.accessible:
                    readers.append(DeviceReader(dataclasses.replace(device, index=device.nvml_index), _READINGS))
        except Exception as err:
            self.problem = f"NVML failed ({type(err).__name__}: {err})"
        self._readers = readers

    def read(self) -> list[dict[str, Any]]:
        """One entry per card: `index` (NVML), `uuid`, `name`, `mig` (a MIG device), `latest` (the readings of
        `telemetry.readings.METRICS` it gives: utilisation, memory, power, temperature, GPM activity) and
        `processes` (`pid`, `user`, `name`, `memory_mib`)."""
        with self._lock:
            if self._readers is None:
                self._open()
            cards = []
            for reader in self._readers or []:
                device = reader.device
                try:
                    latest = reader.read()
                    running = nvml.pynvml.nvmlDeviceGetComputeRunningProcesses(device.handle)
                except Exception as err:
                    if not nvml.unsupported(err):
                        continue  # this card failed now; the others are still worth showing
                    running = []
                processes = [_process(int(p.pid), getattr(p, "usedGpuMemory", None)) for p in running]
                cards.append(
                    {
                        "index": device.nvml_index,
                        "uuid": device.uuid,
                        "name": device.name,
                        "mig": device.parent is not None,
                        "latest": {k: round(v, 3) for k, v in latest.items()},
                        "processes": processes,
                    }
                )
            return cards

    def close(self) -> None:
        with self._lock:
            for reader in self._readers or []:
                reader.close()
            if self._initialised:
                nvml.shutdown_nvml()
            self._readers, self._initialised = None, False
