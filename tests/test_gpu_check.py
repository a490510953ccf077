"""`python -m lightning_accel.gpu_check [--full]`: on a CPU machine every CUDA part is skipped with its reason, one
report; the ladder's verdict, JSON and PNG from a bench.json of the real schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_accel import gpu_check
from lightning_accel.benchmark.bench_report import to_json
from lightning_accel.benchmark.results import StageResult
from lightning_accel.gpu_check.ladder_part import run_ladder

CUDA_PARTS = (
    "nvml_vs_torch",
    "gpu_monitor_overhead",
    "gpt_precision",
    "mfu",
    "fsdp",
    "model_parallel",
    "fp8",
    "micro_batch",
    "health",
)
FULL_CUDA_PARTS = ("gpu_monitor", "tune", "ladder")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skips of a machine without CUDA")
def test_full_on_a_cpu_machine_skips_each_cuda_part_with_its_reason(tmp_path: Path) -> None:
    out = tmp_path / "check"
    done = subprocess.run(
        [sys.executable, "-m", "lightning_accel.gpu_check", "--full", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = (out / "gpu_check.md").read_text()
    assert text.startswith("# lightning_accel GPU check") and "- torch: " in text and "- driver: " in text
    for name in (*CUDA_PARTS, *FULL_CUDA_PARTS):
        assert f"| {name} | SKIP | 0 | no CUDA device (torch {torch.__version__}" in text, name
    assert "| doctor | " in text and done.returncode in (0, 1)
    assert "no ladder stage ran: gpu_check.png not drawn" in text and not (out / "gpu_check.png").exists()
    report = json.loads((out / "gpu_check.json").read_text())
    assert [p["name"] for p in report["parts"]] == [*CUDA_PARTS[:4], "doctor", *CUDA_PARTS[4:], *FULL_CUDA_PARTS]
    assert set(gpu_check.PARTS) == {*CUDA_PARTS, "doctor"} and set(gpu_check.FULL_PARTS) == set(FULL_CUDA_PARTS)


def test_each_part_has_a_module_of_its_own() -> None:
    """Part `x` is `check_x` in `lightning_accel/gpu_check/x_part.py`, and no module holds two parts."""
    import importlib

    every = {**gpu_check.PARTS, **gpu_check.FULL_PARTS}
    assert list(every) == [*CUDA_PARTS[:4], "doctor", *CUDA_PARTS[4:], *FULL_CUDA_PARTS]
    for name, check in every.items():
        module = importlib.import_module(f"lightning_accel.gpu_check.{name}_part")
        assert check is getattr(module, f"check_{name}") and check.__module__ == module.__name__, name
    assert len({check.__module__ for check in every.values()}) == len(every)


def test_out_must_be_a_folder(tmp_path: Path) -> None:
    (tmp_path / "file.md").write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "lightning_accel.gpu_check", "--parts", "fp8", "--out", str(tmp_path / "file.md")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--out" in done.stderr and "is a file" in done.stderr


def test_the_check_imports_no_hydra() -> None:
    code = (
        "import sys, lightning_accel.gpu_check; "
        "sys.exit(any(m == 'hydra' or m.startswith('hydra.') for m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_a_part_that_breaks_is_a_fail_and_the_others_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(ctx: gpu_check.CheckContext) -> gpu_check.Part:
        raise RuntimeError("boom")

    monkeypatch.setitem(gpu_check.PARTS, "mfu", broken)
    parts = {p.name: p for p in gpu_check.run_checks(["mfu", "fp8"])}
    assert parts["mfu"].status == "FAIL" and "RuntimeError: boom" in parts["mfu"].detail
    assert parts["fp8"].status in ("SKIP", "PASS")
    assert "| mfu | FAIL | 0 | RuntimeError: boom |" in gpu_check.render(list(parts.values()), {"device": "x"})


def _stage(
    name: str,
    samples_per_s: float,
    speedup: float | None,
    *,
    mfu: float | None = None,
    quality: str = "pass",
    delta: float | None = 0.3,
    status: str = "ok",
) -> StageResult:
    return StageResult(
        name=name,
        status=status,
        samples_per_s=samples_per_s,
        speedup=speedup,
        mfu=mfu,  # type: ignore[arg-type]
        samples_interval={"low": 0.95 * samples_per_s, "high": 1.05 * samples_per_s},
        speedup_interval=None if speedup is None else {"low": 0.95 * speedup, "high": 1.05 * speedup},
        energy_j_per_sample=1.5 / max(samples_per_s, 1.0),
        metric_value=2.5,
        quality=quality,
        quality_delta_pct=delta,
        device="NVIDIA H200",
    )


def _bench_json(*stages: StageResult) -> list[dict]:
    """The stages as accel-bench writes them into bench.json (the real schema, through its own writer)."""
    return json.loads(json.dumps(to_json(list(stages), {}), default=str))["stages"]


GOOD = (
    _stage("baseline", 50.0, None, mfu=0.05),
    _stage("amp", 300.0, 6.0, mfu=0.33),
    _stage("amp_compile", 460.0, 9.2, mfu=0.52),
    _stage("tuned_gpt2_small", 470.0, 9.4, mfu=0.53),
)
FACTS = {"matmul_tflops": 790.0, "table_peak_tflops": 989.4}


def test_ladder_verdict_passes_the_article_table_mfu_and_quality() -> None:
    problems, figures = gpu_check.ladder_verdict(_bench_json(*GOOD), FACTS)
    assert problems == []
    assert figures["verdict: speedup"] == "tuned_gpt2_small 9.40x against 6.53x"
    assert "amp_compile 52.0% against 50%" == figures["verdict: MFU"]
    assert "65.1% of the hand-timed matmul" in figures["amp_compile"]  # 0.52 x 989.4 / 790
    assert "J/sample" in figures["baseline"] and "[47.5, 52.5]" in figures["baseline"]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda s: _stage("tuned_gpt2_small", 250.0, 5.0, mfu=0.3), "tuned_gpt2_small runs 5.00x"),
        (lambda s: _stage("amp_compile", 400.0, 8.0, mfu=0.41), "amp_compile MFU 41.0% is below 50%"),
        (lambda s: _stage("amp", 300.0, 6.0, quality="FAIL", delta=3.1), "amp: validation loss +3.10%"),
        (lambda s: _stage("amp_compile", 0.0, None, status="failed"), "amp_compile: failed"),
    ],
)
def test_ladder_verdict_names_what_falls_short(change, expected: str) -> None:
    stages = [change(s) if s.name == change(s).name else s for s in GOOD]
    problems, _ = gpu_check.ladder_verdict(_bench_json(*stages), FACTS)
    assert any(expected in p for p in problems), problems


def test_without_a_tuned_stage_the_fastest_is_judged() -> None:
    problems, figures = gpu_check.ladder_verdict(_bench_json(*GOOD[:3]), {})
    assert problems == [] and figures["verdict: speedup"].startswith("amp_compile 9.20x")
    assert "hand-timed" not in figures["amp_compile"]  # no mfu part: no cross-check


def test_report_writes_markdown_json_and_the_ladder_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    ctx = gpu_check.CheckContext(out_dir=tmp_path / "out", facts={"ladder": _bench_json(*GOOD)})
    parts = [gpu_check.Part(name="ladder", detail="4 stages", figures={"baseline": "50.0 samples/s"})]
    files = gpu_check.write_report(parts, ctx, {"date": "today", "device": "NVIDIA H200"})
    assert [f.name for f in files] == ["gpu_check.md", "gpu_check.json", "gpu_check.png"]
    assert (tmp_path / "out" / "gpu_check.png").read_bytes().startswith(b"\x89PNG")
    assert "![ladder](gpu_check.png)" in (tmp_path / "out" / "gpu_check.md").read_text()
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["device"] == "NVIDIA H200" and [s["name"] for s in report["ladder"]][-1] == "tuned_gpt2_small"
    assert not list((tmp_path / "out").glob(".*"))  # nothing left half-written


@pytest.mark.slow
def test_the_ladder_part_end_to_end_on_a_cpu(tmp_path: Path) -> None:
    """The ladder part's machinery (accel-bench subprocess, bench.json, verdict) on the CPU profile; the verdict's
    GPU targets are not met on a CPU, so the part fails naming them."""
    ctx = gpu_check.CheckContext(out_dir=tmp_path)
    part = run_ladder(
        ctx,
        # the tiniest quick run (as tests/test_bench.py's): the machinery, not the figures; no reruns under the
        # other xdist worker's load
        ["--quick", "--steps", "4", "--max-reruns", "0", "trainer.accelerator=cpu"]
        + ["data.max_chars=120000", "model.n_layer=1"],
        timeout=900,
    )
    stages = {s["name"]: s for s in ctx.facts["ladder"]}  # type: ignore[union-attr]
    assert list(stages) == ["baseline", "amp", "amp_compile"], part.detail
    assert all(s["status"] == "ok" for s in stages.values()), part.detail
    assert part.status == "FAIL" and "below 6.53x" in part.detail
    assert "samples/s" in part.figures["baseline"] and (tmp_path / "bench" / "bench.md").is_file()


@pytest.mark.gpu
def test_micro_batch_finder_on_a_real_gpu_recovers_from_real_cuda_out_of_memory() -> None:
    """Under a 3 GiB cap: the first real steps rule sizes out by real CUDA OOM or measured peak, an allocator OOM
    after the sizing is recovered by halving, and the weights equal a fixed micro-batch of 8's (1e-3)."""
    (part,) = gpu_check.run_checks(["micro_batch"])
    assert part.status == "PASS", (part.detail, part.figures)


@pytest.mark.gpu
def test_full_check_on_a_real_gpu(tmp_path: Path) -> None:
    """`--full` on the GPU machine: every part passes (the README's "Verified on a GPU" table comes from it)."""
    done = subprocess.run(
        [sys.executable, "-m", "lightning_accel.gpu_check", "--full", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, (tmp_path / "gpu_check.md").read_text()


@pytest.mark.parametrize("lost", [False, True], ids=["healthy", "a-lost-card"])
def test_the_health_part_polls_every_card_and_the_agent_lists_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, lost: bool
) -> None:
    import contextlib
    import os
    import time

    from _fake_nvml import FakeGPU, FakeNVML, install

    from lightning_accel.gpu_check import health_part

    uuids = ["GPU-a0aaaaaa-0000-0000-0000-000000000000", "GPU-b1bbbbbb-0000-0000-0000-000000000001"]
    errors = {"nvmlDeviceGetRemappedRows": 15} if lost else {}  # NVML_ERROR_GPU_IS_LOST
    gpus = [FakeGPU(uuids[0], processes=[os.getpid()], errors=errors, remapped_rows=(0, 0, 1, 0)), FakeGPU(uuids[1])]
    start = time.monotonic()
    install(monkeypatch, FakeNVML(gpus, clock=lambda: time.monotonic() - start))  # the agent's rounds are 0.5 s apart
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(health_part, "need_cuda", lambda: None)  # the seams: CUDA's ordinals and the memory held
    monkeypatch.setattr(health_part, "_cuda_uuids", lambda: uuids)
    monkeypatch.setattr(health_part, "_holding_memory", contextlib.nullcontext)
    part = health_part.check_health(gpu_check.CheckContext(out_dir=tmp_path))
    assert part.name == "health" and part.figures["agent cards"] == "2"
    assert part.figures["this process seen"] == "yes" and len(part.figures["poll (ms, each of 3)"].split()) == 3
    assert part.figures["cuda:1 health"] == "ok" and "ecc_corrected_volatile" in part.figures["cuda:1 readings given"]
    if lost:
        assert part.status == "FAIL" and part.detail == "cuda:0 is lost (GPU_IS_LOST)"
    else:
        assert part.status == "PASS" and part.detail == ""
        assert part.figures["cuda:0 health"] == "row remapping pending: reset the GPU to apply it"  # reported only
