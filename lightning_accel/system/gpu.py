"""GPU facts from NVML, without a CUDA context: driver and the CUDA version it supports, GPUs, MIG, NVLink topology."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from lightning_accel.telemetry import nvml  # NVML calls go through `nvml.pynvml`, where tests put a scripted fake

__all__ = ["GpuInfo", "GpuLink", "NvmlFacts", "VisibleDevice", "read_nvml"]

_T = TypeVar("_T")
# nvmlDeviceGetTopologyCommonAncestor levels, named as `nvidia-smi topo -m` names them.
_TOPOLOGY = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
_P2P_CAPS_INDEX_NVLINK, _P2P_STATUS_OK, _MAX_NVLINKS = 2, 0, 36  # nvml.h: NVML_NVLINK_MAX_LINKS


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuInfo:
    """One physical GPU as NVML lists it."""

    index: int
    """NVML index (PCI bus order)."""
    name: str
    uuid: str
    capability: tuple[int, int] | None = None
    """CUDA compute capability (8.0 = Ampere A100, 9.0 = Hopper); None when NVML does not say."""
    memory_total_bytes: int | None = None
    mig_enabled: bool = False
    mig_devices: int = 0
    """MIG devices created on it."""
    nvlinks: int | None = None
    """Active NVLink links; None where the GPU has no NVLink or NVML does not report it."""
    why: str = ""
    """Why this process may not open the GPU (`NVMLError_NoPermission: ...` under cgroups); empty when it may."""

    @property
    def accessible(self) -> bool:
        """False for a GPU NVML counts but this process may not open (its name and UUID are then unknown)."""
        return not self.why


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuLink:
    """How two GPUs reach each other: `NV` (NVLink) or the PCIe path (`PIX`, `PXB`, `PHB`, `NODE`, `SYS`)."""

    a: int
    b: int
    kind: str


@dataclass(frozen=True, kw_only=True, slots=True)
class VisibleDevice:
    """A device behind a CUDA ordinal of this process (under `CUDA_VISIBLE_DEVICES`)."""

    uuid: str
    gpu: int
    """NVML index of the GPU (a MIG device's parent)."""
    mig: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class NvmlFacts:
    """What NVML says about the driver and the GPUs; `available=False` with `why` on machines without them."""

    available: bool
    why: str = ""
    """Why NVML could not be used (no driver, no library, ...)."""
    driver_version: str = ""
    """The kernel driver, e.g. `550.54.15`."""
    cuda_driver_version: tuple[int, int] | None = None
    """The newest CUDA version the driver supports (`nvmlSystemGetCudaDriverVersion`: 12040 -> (12, 4))."""
    gpus: tuple[GpuInfo, ...] = ()
    visible: tuple[VisibleDevice, ...] = ()
    """The devices behind CUDA ordinals 0, 1, ... of this process."""
    topology: tuple[GpuLink, ...] = ()
    """Every pair of GPUs, once."""

    def visible_gpus(self) -> list[GpuInfo]:
        """The GPU behind each visible device (a MIG device's parent), in CUDA ordinal order."""
        by_index = {gpu.index: gpu for gpu in self.gpus}
        return [by_index[device.gpu] for device in self.visible if device.gpu in by_index]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _maybe(function: Callable[..., _T], *args: Any) -> _T | None:
    """`function(*args)`, or None for a reading this GPU, driver or nvidia-ml-py does not have."""
    try:
        return function(*args)
    except Exception as err:
        if nvml.unsupported(err) or getattr(err, "value", None) == 2:  # NVML_ERROR_INVALID_ARGUMENT: no such link
            return None
        raise


def _cuda_version(value: int | None) -> tuple[int, int] | None:
    return None if not value else (int(value) // 1000, int(value) % 1000 // 10)


def _nvlinks(handle: Any) -> int | None:
    active, supported = 0, False
    for link in range(_MAX_NVLINKS):
        state = _maybe(nvml.pynvml.nvmlDeviceGetNvLinkState, handle, link)
        if state is None:
            break
        supported, active = True, active + int(state == 1)
    return active if supported else None


def _gpu(index: int, handle: Any, mig_devices: int) -> GpuInfo:
    capability = _maybe(nvml.pynvml.nvmlDeviceGetCudaComputeCapability, handle)
    memory = _maybe(nvml.pynvml.nvmlDeviceGetMemoryInfo, handle)
    mig_mode = _maybe(nvml.pynvml.nvmlDeviceGetMigMode, handle)
    return GpuInfo(
        index=index,
        name=_text(nvml.pynvml.nvmlDeviceGetName(handle)),
        uuid=_text(nvml.pynvml.nvmlDeviceGetUUID(handle)),
        capability=None if capability is None else (int(capability[0]), int(capability[1])),
        memory_total_bytes=None if memory is None else int(memory.total),
        mig_enabled=bool(mig_mode and mig_mode[0] == 1),
        mig_devices=mig_devices,
        nvlinks=_nvlinks(handle),
    )


def _link(a: Any, b: Any) -> str:
    p2p = _maybe(nvml.pynvml.nvmlDeviceGetP2PStatus, a, b, _P2P_CAPS_INDEX_NVLINK)
    if p2p == _P2P_STATUS_OK:
        return "NV"
    level = _maybe(nvml.pynvml.nvmlDeviceGetTopologyCommonAncestor, a, b)
    return _TOPOLOGY.get(int(level), str(level)) if level is not None else "?"


def _read(visible: str | None) -> NvmlFacts:
    driver = _maybe(nvml.pynvml.nvmlSystemGetDriverVersion)
    cuda = _maybe(nvml.pynvml.nvmlSystemGetCudaDriverVersion)
    inventory = nvml._inventory()  # every GPU, each followed by its MIG devices
    handles = {d.nvml_index: d.handle for d in inventory if d.parent is None and d.accessible}
    migs = {index: sum(1 for d in inventory if d.parent is not None and d.nvml_index == index) for index in handles}
    gpus = tuple(
        _gpu(d.nvml_index, d.handle, migs[d.nvml_index])
        if d.accessible
        else GpuInfo(index=d.nvml_index, name="", uuid="", why=d.why)
        for d in inventory
        if d.parent is None
    )
    seen = tuple(
        VisibleDevice(uuid=d.uuid, gpu=d.nvml_index, mig=d.parent is not None)
        for d in nvml._visible(inventory, visible)
    )
    pairs = itertools.combinations(handles, 2)
    topology = tuple(GpuLink(a=a, b=b, kind=_link(handles[a], handles[b])) for a, b in pairs)
    return NvmlFacts(
        available=True,
        driver_version=_text(driver or ""),
        cuda_driver_version=_cuda_version(cuda),
        gpus=gpus,
        visible=seen,
        topology=topology,
    )


def read_nvml(env: Mapping[str, str] | None = None) -> NvmlFacts:
    """Driver, CUDA driver version, GPUs and their links from NVML; never creates a CUDA context, never raises.

    Args:
        env: the environment whose `CUDA_VISIBLE_DEVICES` says which devices this process sees; None: `os.environ`.

    Example::

        facts = read_nvml()
        facts.cuda_driver_version  # (12, 4): torch wheels built for CUDA <= 12.4 run on this driver
    """
    env = os.environ if env is None else env
    why = nvml.init_nvml()
    if why is not None:
        return NvmlFacts(available=False, why=why)
    try:
        return _read(env.get("CUDA_VISIBLE_DEVICES"))
    except Exception as err:  # a GPU fallen off the bus, a broken driver: a fact to report, not a crash
        return NvmlFacts(available=False, why=f"NVML failed ({type(err).__name__}: {err})")
    finally:
        nvml.shutdown_nvml()
