"""Software facts: what torch was built against (CUDA, cuDNN, NCCL) and the installed versions of our requirements."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
from dataclasses import dataclass

__all__ = ["DISTRIBUTION", "PackageVersion", "TorchBuild", "compile_problem", "read_packages", "read_torch_build"]

DISTRIBUTION = "lightning_accel"
"""The distribution whose requirements `read_packages` reads."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TorchBuild:
    """The torch in this environment and the libraries it was built with; read without initialising CUDA."""

    version: str = ""
    cuda: str | None = None
    """`torch.version.cuda`, the CUDA runtime torch ships (`12.8`); None for CPU-only and ROCm builds."""
    hip: str | None = None
    """`torch.version.hip` on ROCm builds."""
    cudnn: int | None = None
    """`torch.backends.cudnn.version()` (90100 = 9.1.0); None when torch has no cuDNN."""
    nccl: tuple[int, ...] | None = None
    """`torch.cuda.nccl.version()` without its build suffix ((2, 21, 5)); None when torch was built without NCCL."""

    @property
    def cudnn_text(self) -> str:
        """cuDNN as `9.1.0`, or `none`."""
        if self.cudnn is None:
            return "none"
        major, rest = divmod(self.cudnn, 10000) if self.cudnn >= 10000 else divmod(self.cudnn, 1000)
        return f"{major}.{rest // 100}.{rest % 100}"


@dataclass(frozen=True, kw_only=True, slots=True)
class PackageVersion:
    """One requirement of lightning_accel and what is installed."""

    name: str
    required: str
    """The version specifier from our metadata (`>=2.4`); empty when any version does."""
    installed: str | None = None
    """The installed version; None when the package is missing."""


def read_torch_build() -> TorchBuild:
    """torch's version and its CUDA, cuDNN and NCCL versions; creates no CUDA context (forking launchers still work)."""
    try:
        import torch
    except ImportError:
        return TorchBuild()
    try:
        cudnn = torch.backends.cudnn.version()
    except Exception:  # a broken cuDNN install: report it as missing
        cudnn = None
    try:
        raw = torch.cuda.nccl.version()
        nccl = _nccl_tuple(raw) if isinstance(raw, tuple) else _nccl_int(int(raw))
    except Exception:  # CPU-only builds have no `torch._C._nccl_version`
        nccl = None
    return TorchBuild(
        version=torch.__version__,
        cuda=torch.version.cuda,
        hip=getattr(torch.version, "hip", None),
        cudnn=cudnn,
        nccl=nccl,
    )


def _nccl_tuple(raw: tuple[object, ...]) -> tuple[int, ...]:
    """`(major, minor, patch)` or, when the build has one, `(major, minor, patch, suffix)` with a str suffix."""
    return tuple(int(part) for part in raw if isinstance(part, int))


def _nccl_int(value: int) -> tuple[int, int, int]:
    """NCCL's integer version: 2.9+ encodes major*10000 + minor*100 + patch, older major*1000 + minor*100 + patch."""
    if value >= 10000:
        return value // 10000, value % 10000 // 100, value % 100
    return value // 1000, value % 1000 // 100, value % 100


def read_packages(distribution: str = DISTRIBUTION) -> tuple[PackageVersion, ...]:
    """The base requirements of `distribution` (extras left out) with the installed version of each.

    Returns an empty tuple when `distribution` is not installed (no metadata to read requirements from).
    """
    try:
        requires = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return ()
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pragma: no cover - packaging comes with lightning
        return ()
    found = []
    for line in requires:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # an extra (`dev`, `plot`, ...) or another platform's dependency
        try:
            installed: str | None = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        found.append(PackageVersion(name=requirement.name, required=str(requirement.specifier), installed=installed))
    return tuple(found)


def compile_problem(backend: str = "inductor", on_cuda: bool = False) -> str | None:
    """Why `torch.compile` cannot run here, or None: dynamo unsupported on this Python, or inductor without the
    compiler it builds kernels with (a C++ compiler on the CPU; a C compiler for Triton's launcher on CUDA)."""
    import torch

    dynamo = getattr(torch, "_dynamo", None)
    if dynamo is not None and hasattr(dynamo, "is_dynamo_supported") and not dynamo.is_dynamo_supported():
        return "torch.compile (dynamo) does not support this Python/torch combination"
    if backend != "inductor":
        return None
    if on_cuda:
        names = [os.environ.get("CC"), "cc", "gcc", "clang"]
        kind = "a C compiler (Triton builds its kernel launcher with it)"
    else:
        names = [os.environ.get("CXX"), "g++", "c++", "clang++"]
        kind = "a C++ compiler (inductor builds CPU kernels with it)"
    if any(name and shutil.which(name) for name in names):
        return None
    return f"inductor needs {kind} and none is on PATH (install gcc/g++, e.g. `apt install build-essential`)"
