"""NVML access: the `pynvml` module GPUMonitor calls, its start and stop, and the devices a process sees."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_accel.errors import ConfigError

try:
    import pynvml  # nvidia-ml-py; called as `nvml.pynvml.nvmlX(...)` so tests can put a scripted fake in its place
except ImportError:  # pragma: no cover - a dependency; a broken install must not break training
    pynvml = None

__all__ = ["GpuDevice", "init_nvml", "inventory", "mig_sm_count", "resolve_devices", "shutdown_nvml", "unsupported"]

_UNSUPPORTED = frozenset({3, 4, 13})  # NVML_ERROR_NOT_SUPPORTED, _NO_PERMISSION, _FUNCTION_NOT_FOUND (nvml.h)


def unsupported(err: BaseException) -> bool:
    """A reading this device (or this driver, or this nvidia-ml-py) cannot give: dropped, not a failure."""
    return isinstance(err, AttributeError) or getattr(err, "value", None) in _UNSUPPORTED


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def init_nvml() -> str | None:
    """Initialise NVML; returns why it cannot be used, or None."""
    if pynvml is None:
        return "nvidia-ml-py (module `pynvml`) is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as err:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        return f"NVML is not available ({type(err).__name__}: {err})"
    return None


def shutdown_nvml() -> None:
    try:
        pynvml.nvmlShutdown()
    except Exception:  # shutting down after an NVML failure may fail again; nothing to do
        pass


@dataclass(frozen=True, slots=True)
class GpuDevice:
    """A device as one process sees it, resolved to NVML."""

    index: int
    """CUDA device ordinal in this process (`cuda:<index>`)."""
    nvml_index: int
    """NVML index (PCI order) of the GPU, or of a MIG device's parent GPU."""
    uuid: str
    name: str
    handle: Any
    parent: Any = None
    """A MIG device's parent GPU, whose power, temperature, clocks, PCIe and energy it shares."""
    gpu_instance_id: int | None = None
    why: str = ""
    """Why this process may not open the GPU (NO_PERMISSION in cgroup-restricted containers); empty when it may."""

    @property
    def accessible(self) -> bool:
        return not self.why


def _error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _mig_devices(gpu: Any) -> list[Any]:
    try:
        if pynvml.nvmlDeviceGetMigMode(gpu)[0] != 1:
            return []
        count = pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu)
    except Exception as err:
        if unsupported(err):
            return []
        raise
    found = []
    for slot in range(count):
        try:
            found.append(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, slot))
        except Exception as err:
            if getattr(err, "value", None) not in (2, 6, *_UNSUPPORTED):  # INVALID_ARGUMENT, NOT_FOUND: empty slot
                raise
    return found


def _inventory() -> list[GpuDevice]:
    """Every GPU in NVML order, each followed by its MIG devices (index -1 until a process ordinal is given)."""
    devices = []
    for nvml_index in range(pynvml.nvmlDeviceGetCount()):  # nvml.h: counts the GPUs this process may not open too
        try:
            gpu = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
        except Exception as err:  # NVMLError_NoPermission (cgroups, SLURM), _GpuIsLost, ...: this GPU only
            if getattr(err, "value", None) is None:
                raise
            devices.append(GpuDevice(-1, nvml_index, "", "", None, why=_error_text(err)))
            continue
        name = _text(pynvml.nvmlDeviceGetName(gpu))
        devices.append(GpuDevice(-1, nvml_index, _text(pynvml.nvmlDeviceGetUUID(gpu)), name, gpu))
        for mig in _mig_devices(gpu):
            instance = int(pynvml.nvmlDeviceGetGpuInstanceId(mig))
            uuid = _text(pynvml.nvmlDeviceGetUUID(mig))
            mig_name = _text(pynvml.nvmlDeviceGetName(mig))  # "<GPU name> MIG 1g.10gb": the profile sizes its peak
            devices.append(GpuDevice(-1, nvml_index, uuid, mig_name, mig, parent=gpu, gpu_instance_id=instance))
    return devices


def inventory() -> list[GpuDevice]:
    """Every device of this machine in NVML order, each GPU followed by its MIG devices (`index` is -1: no process
    ordinal; a GPU this process may not open has `why`). NVML must be initialised."""
    return _inventory()


def mig_sm_count(device: GpuDevice) -> int | None:
    """SMs of a MIG device (`nvmlDeviceGetAttributes`); None for a whole GPU or when NVML does not say."""
    if device.parent is None:
        return None
    try:
        return int(pynvml.nvmlDeviceGetAttributes(device.handle).multiprocessorCount) or None
    except Exception as err:
        if unsupported(err):
            return None
        raise


def _strip(uuid: str) -> str:
    return uuid.split("-", 1)[1] if uuid[:4] in ("GPU-", "MIG-") else uuid


def _visible(inventory: list[GpuDevice], visible: str | None) -> list[GpuDevice]:
    """The devices behind CUDA ordinals 0, 1, ... under `CUDA_VISIBLE_DEVICES=visible` (None: unset).

    Unset: every GPU in NVML (PCI) order, a MIG-enabled GPU contributing its MIG devices. Set: a comma list of GPU
    indices, GPU UUIDs or MIG UUIDs (`GPU-...`, `MIG-...`, also unique prefixes); as in CUDA, the list ends at the
    first entry that names no device. Indices count the GPUs this process may open in NVML (PCI) order, as CUDA
    counts them under `CUDA_DEVICE_ORDER=PCI_BUS_ID`: CUDA does not enumerate a GPU it may not open.
    """
    inventory = [d for d in inventory if d.accessible]
    gpus = [d for d in inventory if d.parent is None]
    if visible is None:
        seen = []
        for gpu in gpus:
            migs = [d for d in inventory if d.parent is not None and d.nvml_index == gpu.nvml_index]
            seen.extend(migs or [gpu])
        return seen
    seen = []
    for token in (t.strip() for t in visible.split(",")):
        if token.lstrip("-").isdigit():
            number = int(token)
            if not 0 <= number < len(gpus):
                break
            seen.append(gpus[number])
            continue
        wanted = _strip(token)
        matches = [
            d
            for d in inventory
            if wanted and _strip(d.uuid).startswith(wanted) and (token[:4] != "MIG-" or d.parent is not None)
        ]
        if len(matches) != 1:
            break
        seen.append(matches[0])
    return seen


def resolve_devices(
    indices: Sequence[int], visible: str | None = None, uuids: Sequence[str] | None = None
) -> list[GpuDevice]:
    """The NVML devices behind CUDA ordinals `indices` of this process.

    Args:
        indices: CUDA device ordinals (`cuda:<i>`) as this process sees them.
        visible: the value of `CUDA_VISIBLE_DEVICES` in this process (None: unset).
        uuids: the UUIDs CUDA reports for `indices` (`torch.cuda.get_device_properties(i).uuid`), when CUDA is up;
            they name the device whatever `CUDA_DEVICE_ORDER` is. Missing or unknown ones fall back to `visible`.

    Raises:
        ValueError: for an ordinal that names no device, with what is visible.
    """
    inventory = _inventory()
    seen = _visible(inventory, visible)
    resolved = []
    for position, index in enumerate(indices):
        device = None
        if uuids is not None and position < len(uuids):
            wanted = _strip(str(uuids[position]))
            device = next((d for d in inventory if d.accessible and wanted and _strip(d.uuid) == wanted), None)
        if device is None:
            if not 0 <= index < len(seen):
                shown = "unset" if visible is None else repr(visible)
                raise ConfigError(
                    f"`device_indices` entry {index} names no GPU: CUDA_VISIBLE_DEVICES is {shown}, which leaves "
                    f"{len(seen)} of the {len(inventory)} NVML device(s) visible; use indices below {len(seen)}."
                )
            device = seen[index]
        resolved.append(
            GpuDevice(
                index, device.nvml_index, device.uuid, device.name, device.handle, device.parent, device.gpu_instance_id
            )
        )
    return resolved
