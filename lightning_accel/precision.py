"""Resolves a precision request (`amp`, `fp8` or a Lightning precision string) for the hardware a run will use."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_accel.errors import ConfigError, LightningAccelWarning
from lightning_accel.system.cpu import CpuInfo, read_cpu_info


def _rank_zero_warn(message: str, **kwargs: Any) -> None:
    """Lightning's rank-zero warning, imported when needed: `import lightning_accel` stays free of Lightning."""
    from lightning.pytorch.utilities import rank_zero_warn as warn

    if "stacklevel" in kwargs:
        kwargs["stacklevel"] += 1  # this wrapper's own frame
    warn(message, **kwargs)


__all__ = [
    "FLOAT32_MATMUL_PRECISIONS",
    "FP16_PRECISIONS",
    "LIGHTNING_PRECISIONS",
    "MODEL_PARALLEL_REFUSED",
    "PIPELINE_PRECISIONS",
    "PRECISION_CHOICES",
    "PRECISION_SENTINELS",
    "Hardware",
    "ResolvedPrecision",
    "apply_float32_matmul_precision",
    "resolve_precision",
]

PRECISION_SENTINELS = ("amp", "fp8")
"""Requests resolved per hardware: `amp` (the best mixed precision the device runs) and `fp8` (float8 training)."""
LIGHTNING_PRECISIONS = (
    "transformer-engine",
    "transformer-engine-float16",
    "16-true",
    "16-mixed",
    "bf16-true",
    "bf16-mixed",
    "32-true",
    "64-true",
)
LIGHTNING_SHORT_PRECISIONS = ("16", "32", "64", "bf16")
"""Lightning's older short spellings, still accepted by `Trainer(precision=...)`."""
PRECISION_CHOICES = PRECISION_SENTINELS + LIGHTNING_PRECISIONS + LIGHTNING_SHORT_PRECISIONS
"""Every `trainer.precision` a config may hold (checked before launch)."""
PIPELINE_PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16-true", "bf16", "16-true")
"""What `strategy=pipeline` runs: fp16 mixed precision needs a GradScaler around a backward the schedule runs
itself; Transformer Engine and fp8 are not wired through pipeline stages."""
FP16_PRECISIONS = ("16-mixed", "16", "16-true", "transformer-engine-float16")
"""float16 precisions: a CPU run of one is not what it says (`amp` resolves to bf16 there)."""
MODEL_PARALLEL_REFUSED = ("16-mixed", "16", "transformer-engine-float16")
"""What Lightning's ModelParallelStrategy refuses (it takes 32-true, bf16-mixed, bf16-true or 16-true)."""
FLOAT32_MATMUL_PRECISIONS = ("highest", "high", "medium")
"""Values of `torch.set_float32_matmul_precision`: `high` allows TF32 (or bf16x3), `medium` bf16 matmuls."""

_LEGACY = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}  # Lightning's old spellings
_BF16_CAPABILITY = (8, 0)  # Ampere: first CUDA GPUs with bf16 tensor cores
_FP8_CAPABILITY = (8, 9)  # Ada Lovelace and Hopper: first CUDA GPUs with fp8 tensor cores
_FP8_PACKAGES = {"transformer_engine": "pip install transformer-engine[pytorch]", "torchao": "pip install torchao"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """The facts a precision choice depends on; `Hardware.probe()` reads them, tests build them by hand."""

    cpu: CpuInfo
    """What `/proc/cpuinfo` says (native bf16 instructions or not)."""
    cuda_capability: tuple[int, int] | None = None
    """Compute capability of the first visible CUDA device; None when no CUDA device is visible."""
    cuda_name: str = ""
    """Name of that device, for messages."""
    mps: bool = False
    """Whether Apple's MPS backend is available."""

    @classmethod
    def probe(cls, root: str = "/", cuda: bool = True) -> Hardware:
        """Read this machine's facts without initialising CUDA, so fork-based launchers still work afterwards.

        Args:
            root: the file-system root for `system.read_cpu_info`.
            cuda: look for CUDA devices; False skips NVML and the driver entirely.
        """
        capability, name = _probe_cuda() if cuda else (None, "")
        return cls(cpu=read_cpu_info(root), cuda_capability=capability, cuda_name=name, mps=_mps_available())

    def describe_cuda(self) -> str:
        """The first CUDA device and its compute capability, or that there is none, for messages."""
        if self.cuda_capability is None:
            return "no CUDA device"
        return f"{self.cuda_name or 'a CUDA device'} with compute capability {'.'.join(map(str, self.cuda_capability))}"


@dataclass(frozen=True, kw_only=True, slots=True)
class ResolvedPrecision:
    """A precision request turned into what `Trainer(precision=...)` takes, with the reason for the choice."""

    requested: str
    """The request as given (`amp`, `fp8`, `16-mixed`, ...)."""
    value: str
    """The Lightning precision string to run with."""
    device: str
    """The device type the choice was made for: `cuda`, `mps`, `cpu` or `tpu`."""
    reason: str
    """Why this value, in one sentence, for the run log."""
    float8_training: bool = False
    """The choice needs torchao's float8 `nn.Linear`: the Trainer takes a `callbacks.Float8Training`
    (`lightning_accel.compose.precision_callbacks` builds it). The resolution names the callback and does not build
    it, so `precision` imports nothing of `callbacks`."""

    def describe(self) -> str:
        """`precision 'amp' -> 'bf16-mixed' on cpu: <reason>`, the line `accel-train` logs."""
        return f"precision {self.requested!r} -> {self.value!r} on {self.device}: {self.reason}"


def resolve_precision(
    requested: str | int,
    accelerator: str = "auto",
    *,
    hardware: Hardware | None = None,
    package_available: Callable[[str], bool] | None = None,
    setting: str = "precision",
) -> ResolvedPrecision:
    """Turn `amp`, `fp8` or a Lightning precision string into the precision this hardware runs.

    `amp` gives `bf16-mixed` on CUDA GPUs with bf16 (compute capability 8.0+), `16-mixed` on older CUDA GPUs and
    on MPS, `bf16-mixed` on CPUs with native bf16 instructions and `32-true` (with one warning) on other CPUs.
    `fp8` needs a CUDA GPU of compute capability 8.9+ and gives Lightning's `transformer-engine` precision when
    Transformer Engine is installed, else `bf16-mixed` plus a `Float8Training` callback when torchao is. Lightning
    strings pass through, except `16-mixed` on CPU, which becomes `bf16-mixed` with a warning, and bf16 on a CUDA
    GPU without bf16, an error.

    Args:
        requested: `amp`, `fp8`, or a Lightning precision (`32-true`, `bf16-mixed`, `16`, ...).
        accelerator: the Trainer's accelerator; `auto` means CUDA if visible, else MPS if available, else CPU.
        hardware: the machine's facts; None probes this machine.
        package_available: says whether a module is importable; None asks `importlib.util.find_spec`.
        setting: the setting's name in messages.

    Raises:
        ConfigError: for an unknown value, bf16 on a CUDA GPU without bf16, fp8 without a capable GPU or package,
            `amp` on TPU, or a CUDA accelerator with no CUDA device visible.

    Example::

        from lightning_accel.compose import precision_callbacks

        resolved = resolve_precision("amp")
        trainer = Trainer(precision=resolved.value, callbacks=precision_callbacks(resolved))
    """
    text = str(requested).strip()
    value = _LEGACY.get(text, text)
    if value not in PRECISION_SENTINELS + LIGHTNING_PRECISIONS:
        options = ", ".join(f"`{p}`" for p in PRECISION_SENTINELS + LIGHTNING_PRECISIONS)
        raise ConfigError(f"`{setting}={requested!r}` is not a precision; use one of {options}.")
    accelerator = str(accelerator).lower()
    if hardware is None:
        hardware = Hardware.probe(cuda=accelerator not in ("cpu", "mps", "tpu"))
    available = package_available or _package_available
    device = _device_type(accelerator, hardware)
    if device == "cuda" and hardware.cuda_capability is None:
        raise ConfigError(
            f"`accelerator={accelerator!r}` asks for a CUDA GPU but none is visible; use `accelerator='cpu'` or "
            "`accelerator='auto'`.",
            setting="accelerator",
        )

    def done(value: str, reason: str, float8_training: bool = False) -> ResolvedPrecision:
        return ResolvedPrecision(
            requested=text, value=value, device=device, reason=reason, float8_training=float8_training
        )

    if value == "amp":
        return _resolve_amp(setting, device, hardware, done)
    if value == "fp8":
        return _resolve_fp8(setting, device, hardware, available, done)
    if device == "cpu" and value == "16-mixed":
        slow = "" if hardware.cpu.has_native_bf16 else f"; note that {hardware.cpu.describe_bf16()}, so bf16 is slow"
        _rank_zero_warn(
            f"`{setting}={text!r}` (fp16 autocast with loss scaling) does not run on CPU; using 'bf16-mixed' "
            f"instead{slow}. Set `precision='bf16-mixed'` or `precision='amp'` to silence this.",
            category=LightningAccelWarning,
            stacklevel=5,  # the caller of resolve_precision
        )
        return done("bf16-mixed", "fp16 autocast does not run on CPU; bf16 autocast needs no loss scaling")
    capability = hardware.cuda_capability if device == "cuda" else None
    if capability is not None and value.startswith("bf16") and capability < _BF16_CAPABILITY:
        raise ConfigError(
            f"`{setting}={text!r}` needs a CUDA GPU with bf16 (compute capability 8.0 or newer); found "
            f"{hardware.describe_cuda()}. Use `precision='16-mixed'` (fp16 autocast with loss scaling) or "
            "`precision='amp'` (picks per hardware)."
        )
    return done(value, "set explicitly")


def apply_float32_matmul_precision(value: str | None, setting: str = "float32_matmul_precision") -> str | None:
    """Call `torch.set_float32_matmul_precision(value)`; None leaves the setting alone.

    Args:
        value: `highest` (true fp32 matmuls), `high` (TF32 on CUDA), `medium` (bf16 matmuls), or None.
        setting: the setting's name in messages.

    Returns:
        The setting before the call, so a caller can restore it; None when nothing was changed.

    Raises:
        ConfigError: for any other value.
    """
    if value is None:
        return None
    if value not in FLOAT32_MATMUL_PRECISIONS:
        options = ", ".join(f"`{v}`" for v in FLOAT32_MATMUL_PRECISIONS)
        raise ConfigError(f"`{setting}={value!r}` is not supported; use one of {options}, or null to leave it alone.")
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(value)
    return previous


_Done = Callable[..., ResolvedPrecision]


def _resolve_amp(setting: str, device: str, hardware: Hardware, done: _Done) -> ResolvedPrecision:
    if device == "cuda":
        assert hardware.cuda_capability is not None, "resolve_precision checks that a CUDA device is visible"
        cuda = hardware.describe_cuda()
        if hardware.cuda_capability >= _BF16_CAPABILITY:
            return done("bf16-mixed", f"{cuda} supports bf16; bf16 autocast needs no loss scaling")
        return done("16-mixed", f"{cuda} has no bf16; fp16 autocast with dynamic loss scaling")
    if device == "mps":
        return done("16-mixed", "MPS runs fp16 autocast")
    if device == "cpu":
        if hardware.cpu.has_native_bf16:
            return done("bf16-mixed", hardware.cpu.describe_bf16())
        why = f"{hardware.cpu.describe_bf16()}, so bf16 autocast would be emulated and slower than fp32"
        _rank_zero_warn(
            f"`{setting}='amp'` resolved to '32-true' on this CPU: {why}. "
            "Set `precision='bf16-mixed'` to use bf16 anyway, or `precision='32-true'` to silence this.",
            category=LightningAccelWarning,
            stacklevel=6,  # the caller of resolve_precision
        )
        return done("32-true", why)
    raise ConfigError(
        f"`{setting}='amp'` picks a precision for CUDA, MPS and CPU only, not `{device}`; use `precision='bf16-true'` "
        "or another concrete precision."
    )


def _resolve_fp8(
    setting: str, device: str, hardware: Hardware, available: Callable[[str], bool], done: _Done
) -> ResolvedPrecision:
    installed = [name for name in _FP8_PACKAGES if available(name)]
    if device != "cuda" or hardware.cuda_capability is None or hardware.cuda_capability < _FP8_CAPABILITY:
        found = hardware.describe_cuda() if device == "cuda" else f"no CUDA device (the run uses `{device}`)"
        packages = "" if installed else " (it also needs `transformer-engine` or `torchao`, neither is installed)"
        raise ConfigError(
            f"`{setting}='fp8'` needs a CUDA GPU with compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
            f"found {found}{packages}. Use `precision='amp'` or `precision='bf16-mixed'`."
        )
    cuda = hardware.describe_cuda()
    if "transformer_engine" in installed:
        return done("transformer-engine", f"Transformer Engine is installed; fp8 matmuls on {cuda}")
    if "torchao" in installed:
        reason = f"torchao is installed (Transformer Engine is not); bf16 autocast and float8 nn.Linear on {cuda}"
        return done("bf16-mixed", reason, float8_training=True)
    commands = " or ".join(f"`{command}`" for command in _FP8_PACKAGES.values())
    raise ConfigError(
        f"`{setting}='fp8'` needs `transformer-engine` or `torchao`, and neither is installed; install one with "
        f"{commands}, or use `precision='amp'`."
    )


def _device_type(accelerator: str, hardware: Hardware) -> str:
    if accelerator in ("auto", "gpu"):
        if hardware.cuda_capability is not None:
            return "cuda"
        if hardware.mps:
            return "mps"
        return "cpu" if accelerator == "auto" else "cuda"
    return accelerator


def _package_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def _probe_cuda() -> tuple[tuple[int, int] | None, str]:
    """Capability and name of CUDA device 0 of this process through NVML (no CUDA context), else through torch.

    NVML is read through `lightning_accel.telemetry.nvml`, which maps `CUDA_VISIBLE_DEVICES` (indices, GPU and MIG
    UUIDs) as CUDA does; torch's own NVML path gives up on MIG UUIDs, and asking the CUDA runtime instead would
    initialise CUDA and break a fork-based launch after it. torch is asked only when NVML cannot be used at all.
    """
    from lightning_accel.telemetry import nvml

    if nvml.init_nvml() is None:
        try:
            [device] = nvml.resolve_devices([0], os.environ.get("CUDA_VISIBLE_DEVICES"))
            major, minor = nvml.pynvml.nvmlDeviceGetCudaComputeCapability(device.handle)
            return (int(major), int(minor)), device.name
        except ValueError:  # NVML works and this process sees no device
            return None, ""
        except Exception:  # an NVML too old for a call, a device lost: ask torch below
            pass
        finally:
            nvml.shutdown_nvml()
    if torch.cuda.device_count() == 0:  # NVML-based in torch: does not initialise CUDA
        return None, ""
    return torch.cuda.get_device_capability(0), torch.cuda.get_device_name(0)
