"""Facts about the CPU read from `/proc/cpuinfo`: its model and whether it has native bf16 instructions."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["BF16_FLAGS", "CpuInfo", "native_bf16_flag", "read_cpu_info"]

# Flags that prove native bf16 arithmetic, in the order they are reported. x86: AVX512-BF16 (Cooper Lake, Sapphire
# Rapids, Zen 4) and AMX-BF16 (Sapphire Rapids and later); aarch64: the Armv8.6 BF16 extension (Graviton 3, Neoverse).
BF16_FLAGS: dict[str, tuple[str, ...]] = {"x86_64": ("amx_bf16", "avx512_bf16"), "aarch64": ("bf16",)}


@dataclass(frozen=True, kw_only=True, slots=True)
class CpuInfo:
    """What `/proc/cpuinfo` says about the first processor."""

    path: str
    """The file that was read (or looked for)."""
    found: bool
    """Whether that file could be read; False on macOS, Windows and containers that hide `/proc`."""
    architecture: str = "unknown"
    """`x86_64` when the file lists `flags`, `aarch64` when it lists `Features`, else `unknown`."""
    model_name: str = ""
    """`model name` (x86) or `CPU part` (aarch64); empty when not listed."""
    flags: frozenset[str] = field(default_factory=frozenset)
    """The instruction-set flags (x86 `flags`, aarch64 `Features`)."""

    @property
    def bf16_flag(self) -> str | None:
        """The flag that proves native bf16 instructions, or None when there is none."""
        return native_bf16_flag(self.flags, self.architecture)

    @property
    def has_native_bf16(self) -> bool:
        """Whether the CPU has native bf16 instructions (so bf16 autocast is not emulated)."""
        return self.bf16_flag is not None

    def describe_bf16(self) -> str:
        """One clause saying whether the CPU has native bf16 and how that was found, for logs and warnings."""
        if not self.found:
            return f"{self.path} could not be read, so native bf16 support is unknown"
        if self.bf16_flag is not None:
            return f"the CPU lists `{self.bf16_flag}` in {self.path} (native bf16 instructions)"
        known = BF16_FLAGS.get(self.architecture) or tuple(flag for flags in BF16_FLAGS.values() for flag in flags)
        wanted = " or ".join(f"`{flag}`" for flag in known)
        return f"the CPU has no native bf16 instructions (no {wanted} in {self.path})"


def native_bf16_flag(flags: frozenset[str] | set[str], architecture: str) -> str | None:
    """The first flag among `BF16_FLAGS[architecture]` present in `flags`, or None.

    Args:
        flags: instruction-set flags as listed in `/proc/cpuinfo`.
        architecture: `x86_64` or `aarch64`; any other value finds no flag.
    """
    return next((flag for flag in BF16_FLAGS.get(architecture, ()) if flag in flags), None)


def read_cpu_info(root: str | os.PathLike[str] = "/") -> CpuInfo:
    """Read `<root>/proc/cpuinfo`; a missing or unreadable file gives `CpuInfo(found=False)`, never an error.

    Only the first processor's block is read: Linux lists the same flags for every core.

    Args:
        root: the file-system root to read under; tests pass a folder holding a fake `proc/cpuinfo`.

    Example::

        info = read_cpu_info()
        info.has_native_bf16, info.bf16_flag  # (True, 'amx_bf16') on a Sapphire Rapids Xeon
    """
    path = Path(root, "proc", "cpuinfo")
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return CpuInfo(path=str(path), found=False)
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the end of the first processor's block
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    if "flags" in fields:
        architecture, flags = "x86_64", fields["flags"]
    elif "features" in fields:
        architecture, flags = "aarch64", fields["features"]
    else:
        architecture, flags = "unknown", ""
    model_name = fields.get("model name") or fields.get("cpu part", "")
    return CpuInfo(
        path=str(path), found=True, architecture=architecture, model_name=model_name, flags=frozenset(flags.split())
    )
