"""`python -m lightning_accel.gpu_check`: on a CPU machine every CUDA part is skipped with its reason, one report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_accel import gpu_check

CUDA_PARTS = (
    "nvml_vs_torch",
    "gpu_monitor_overhead",
    "gpt_precision",
    "mfu",
    "fsdp",
    "model_parallel",
    "fp8",
    "micro_batch",
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skips of a machine without CUDA")
def test_on_a_cpu_machine_each_cuda_part_is_skipped_with_its_reason(tmp_path: Path) -> None:
    report = tmp_path / "gpu_check.md"
    done = subprocess.run([sys.executable, "-m", "lightning_accel.gpu_check", "--out", str(report)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    text = report.read_text()
    assert text.startswith("# lightning_accel GPU check") and "- torch: " in text
    for name in CUDA_PARTS:
        assert f"| {name} | SKIP | no CUDA device (torch {torch.__version__}" in text, name
    assert "| doctor | " in text and done.returncode in (0, 1)
    assert set(gpu_check.PARTS) == {*CUDA_PARTS, "doctor"}


def test_the_check_imports_no_hydra() -> None:
    code = ("import sys, lightning_accel.gpu_check; "
            "sys.exit(any(m == 'hydra' or m.startswith('hydra.') for m in sys.modules))")  # fmt: skip
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_a_part_that_breaks_is_a_fail_and_the_others_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> gpu_check.Part:
        raise RuntimeError("boom")

    monkeypatch.setitem(gpu_check.PARTS, "mfu", broken)
    parts = {p.name: p for p in gpu_check.run_checks(["mfu", "fp8"])}
    assert parts["mfu"].status == "FAIL" and "RuntimeError: boom" in parts["mfu"].detail
    assert parts["fp8"].status in ("SKIP", "PASS")
    assert "| mfu | FAIL | RuntimeError: boom |" in gpu_check.render(list(parts.values()))


@pytest.mark.gpu
def test_micro_batch_finder_on_a_real_gpu_recovers_from_real_cuda_out_of_memory() -> None:
    """Under a 3 GiB cap: the search rules sizes out by real CUDA OOM or measured peak, an allocator OOM at step 3 is
    recovered by halving, and the weights equal a fixed micro-batch of 8's (1e-3)."""
    (part,) = gpu_check.run_checks(["micro_batch"])
    assert part.status == "PASS", (part.detail, part.figures)
