"""read_cpu_info over fake /proc trees: x86 with and without bf16 flags, aarch64, and a missing file."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_accel.system import CpuInfo, native_bf16_flag, read_cpu_info

X86_BLOCK = """processor\t: {n}
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse sse2 avx avx2 avx512f {extra}
bugs\t\t: spectre_v1

"""
ARM_BLOCK = """processor\t: {n}
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 {extra}
CPU implementer\t: 0x41
CPU part\t: 0xd40

"""


def _tree(tmp_path: Path, text: str) -> Path:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "cpuinfo").write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("extra", "flag"),
    [("avx512_bf16 amx_tile", "avx512_bf16"), ("amx_bf16 amx_tile avx512_bf16", "amx_bf16"), ("avx512_vnni", None)],
)
def test_x86_flags(tmp_path: Path, extra: str, flag: str | None) -> None:
    info = read_cpu_info(_tree(tmp_path, X86_BLOCK.format(n=0, extra=extra)))
    assert info.found and info.architecture == "x86_64"
    assert info.model_name == "Intel(R) Xeon(R) Platinum 8480+"
    assert info.bf16_flag == flag
    assert info.has_native_bf16 is (flag is not None)
    if flag:
        assert f"`{flag}`" in info.describe_bf16()
    else:
        assert "no native bf16" in info.describe_bf16() and "`avx512_bf16`" in info.describe_bf16()


def test_only_the_first_processor_block_is_read(tmp_path: Path) -> None:
    text = X86_BLOCK.format(n=0, extra="") + X86_BLOCK.format(n=1, extra="avx512_bf16")
    assert read_cpu_info(_tree(tmp_path, text)).bf16_flag is None


@pytest.mark.parametrize(("extra", "flag"), [("bf16 i8mm sve2", "bf16"), ("sve svebf16x", None)])
def test_aarch64_features(tmp_path: Path, extra: str, flag: str | None) -> None:
    info = read_cpu_info(_tree(tmp_path, ARM_BLOCK.format(n=0, extra=extra)))
    assert info.architecture == "aarch64"
    assert info.model_name == "0xd40"
    assert info.bf16_flag == flag
    # An x86 flag name means nothing on aarch64, and the other way round.
    assert native_bf16_flag(frozenset({"avx512_bf16"}), "aarch64") is None
    assert native_bf16_flag(frozenset({"bf16"}), "x86_64") is None


def test_missing_file_is_not_an_error(tmp_path: Path) -> None:
    info = read_cpu_info(tmp_path)
    assert info == CpuInfo(path=str(tmp_path / "proc" / "cpuinfo"), found=False)
    assert not info.has_native_bf16
    assert "could not be read" in info.describe_bf16()


def test_file_without_flags_is_unknown(tmp_path: Path) -> None:
    info = read_cpu_info(_tree(tmp_path, "processor\t: 0\nmodel name\t: mystery\n"))
    assert info.found and info.architecture == "unknown" and not info.has_native_bf16
    assert "`amx_bf16`" in info.describe_bf16() and "`bf16`" in info.describe_bf16()


def test_this_machine_reads_without_error() -> None:
    info = read_cpu_info()
    assert isinstance(info.has_native_bf16, bool)
