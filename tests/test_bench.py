"""accel-bench: table arithmetic, MFU peaks, bottleneck verdicts, bad input, a failing stage, --quick end to end."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _wait import wait_until

from lightning_accel import bench
from lightning_accel.benchmark import (
    BenchSettings,
    StageResult,
    bottleneck,
    default_ladder,
    finalize,
    higher_is_better,
    markdown_table,
    model_flops_utilization,
    quality_verdict,
    run_bench,
    speedups,
)
from lightning_accel.benchmark.results import next_step
from lightning_accel.benchmark.stage_plan import plan_stages
from lightning_accel.telemetry.peak_flops import compute_dtype, lookup_peak_flops


def _measurement(
    train_s: float,
    metric: float,
    *,
    world: int = 1,
    data_s: float = 0.1,
    backward_s: float = 0.5,
    device: str = "cpu",
    precision: str = "32-true",
) -> dict:
    return {
        "world_size": world,
        "train_s": train_s,
        "steady_s": 1.0,
        "steady_batches": 10,
        "steady_samples": 320,
        "steady_tokens": 20480,
        "data_s": data_s,
        "forward_s": 0.3,
        "backward_s": backward_s,
        "optimizer_s": 0.6 - data_s - backward_s + 0.5,
        "final_metric": metric,
        "device": device,
        "precision": precision,
        "float32_matmul_precision": "highest",
        "flops_per_batch": 1e9,
        "peak_memory_bytes": 2**30,
        "memory_total_bytes": 2**34,
    }


def _row(name: str, train_s: float, metric: float, **kwargs) -> StageResult:
    return StageResult(name=name, measurement=_measurement(train_s, metric, **kwargs))


# --- the table's arithmetic ------------------------------------------------------------------------------------------


def test_speedup_is_reference_time_over_stage_time_from_the_recorded_json() -> None:
    rows = [_row("baseline", 120.0, 2.0), _row("amp", 80.0, 2.01), _row("ddp", 30.0, 2.02)]
    reference = finalize(rows, mode="min", tolerance=0.02)
    assert reference is rows[0]
    assert [r.time_s for r in rows] == [120.0, 80.0, 30.0]
    assert [r.speedup for r in rows] == [1.0, 1.5, 4.0]
    assert rows[1].samples_per_s == 320.0 and rows[1].tokens_per_s == 20480.0


def test_a_skipped_baseline_makes_the_first_stage_that_ran_the_reference() -> None:
    rows = [
        StageResult(name="baseline", status="skipped", reason="no"),
        StageResult(name="amp", time_s=10.0),
        StageResult(name="ddp", status="failed", reason="boom"),
        StageResult(name="mp", time_s=4.0),
    ]
    assert speedups(rows) is rows[1]
    assert [r.speedup for r in rows] == [None, 1.0, None, 2.5]


@pytest.mark.parametrize(
    ("value", "mode", "expected"),
    [
        (2.04, "min", "pass"),  # exactly 2% worse (lower is better): on the boundary passes
        (2.0401, "min", "FAIL"),
        (1.5, "min", "pass"),  # better
        (0.882, "max", "pass"),  # exactly 2% worse (higher is better)
        (0.8819, "max", "FAIL"),
        (0.95, "max", "pass"),
        (None, "min", "n/a"),
        (math.nan, "min", "FAIL"),  # diverged
    ],
)
def test_quality_verdict_at_the_tolerance_boundaries(value, mode, expected) -> None:
    reference = 2.0 if mode == "min" else 0.9
    verdict, delta = quality_verdict(value, reference, mode, 0.02)
    assert verdict == expected
    if expected != "n/a" and value is not None and math.isfinite(value):
        assert delta == pytest.approx(100 * (value - reference) / reference)


def test_quality_fails_a_stage_worse_than_baseline_and_the_table_shows_it() -> None:
    rows = [
        _row("baseline", 10.0, 2.0),
        _row("amp", 5.0, 2.1),
        StageResult(name="ddp", status="skipped", reason="`ddp` with one device (1 CPU(s)); it needs 2 or more"),
    ]
    finalize(rows, mode="min", tolerance=0.02)
    assert [r.quality for r in rows] == ["pass", "FAIL", "n/a"]
    table = markdown_table(rows, "val/loss", 0.02, None).splitlines()
    assert len(table) == 2 + len(rows)
    assert table[0].startswith("| stage | what it changes | runs | time | speedup |")
    assert "| 2.00x |" in table[3] and "FAIL (+5.0%)" in table[3]
    assert "skipped: `ddp` with one device" in table[4]


def test_the_table_reports_each_stages_micro_batch() -> None:
    rows = [_row("baseline", 10.0, 2.0), _row("amp", 5.0, 2.0), _row("ddp", 4.0, 2.0)]
    for row, (size, auto, recoveries) in zip(rows, [(32, False, 0), (8, True, 0), (4, True, 1)], strict=True):
        row.measurement.update(micro_batch=size, micro_batch_auto=auto, micro_batch_recoveries=recoveries)
    finalize(rows, mode="min", tolerance=0.02)
    table = markdown_table(rows, "val/loss", 0.02, None).splitlines()
    column = table[0].split(" | ").index("micro-batch")
    assert [line.split(" | ")[column] for line in table[2:]] == ["32", "8 (auto)", "4 (auto, 1 OOM recovery)"]


def test_metric_direction_from_its_name() -> None:
    assert higher_is_better("val/acc") and higher_is_better("val/f1_macro")
    assert not higher_is_better("val/loss") and not higher_is_better("val/bpc") and not higher_is_better("val/ppl")


# --- MFU -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA H200", "bf16", 989.4),  # what NVML and torch call it; Lightning's ThroughputMonitor finds no peak
        ("NVIDIA H200 NVL", "bf16", 835.5),
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "fp8", 1513.0),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
        ("NVIDIA A100 80GB PCIe", "bf16", 312.0),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA L40S", "fp16", 362.1),
        ("NVIDIA A10G", "bf16", 125.0),
        ("Tesla V100-SXM2-16GB", "fp16", 125.0),
        ("Tesla T4", "fp16", 65.0),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
    ],
)
def test_peak_flops_lookup_by_device_name(name: str, dtype: str, tflops: float) -> None:
    assert lookup_peak_flops(name, dtype).flops == pytest.approx(tflops * 1e12)


def test_peak_flops_unknown_cpu_missing_dtype_and_override() -> None:
    assert lookup_peak_flops("cpu", "fp32").flops is None
    assert "--peak-tflops" in lookup_peak_flops("cpu", "fp32").reason
    assert lookup_peak_flops("Tesla T4", "bf16").flops is None  # no bf16 tensor cores
    assert lookup_peak_flops("Imaginary GPU 9000", "bf16").flops is None
    assert lookup_peak_flops("cpu", "fp32", override_tflops=2.0).flops == 2e12
    assert compute_dtype("bf16-mixed") == "bf16" and compute_dtype("16-mixed") == "fp16"
    assert compute_dtype("32-true", "high") == "tf32" and compute_dtype("32-true", "highest") == "fp32"
    assert compute_dtype("32-true", "high", tf32_capable=False) == "fp32"


def test_mfu_from_measured_flops_and_the_peak() -> None:
    assert model_flops_utilization(1e12, 100, 10.0, 1e14) == pytest.approx(0.1)
    assert model_flops_utilization(None, 100, 10.0, 1e14) is None
    rows = [_row("baseline", 10.0, 2.0, device="NVIDIA H200", precision="bf16-mixed")]
    finalize(rows, mode="min", tolerance=0.02)
    assert rows[0].mfu == pytest.approx(1e9 * 10 / 1.0 / 989.4e12)
    cpu = [_row("baseline", 10.0, 2.0)]
    finalize(cpu, mode="min", tolerance=0.02, peak_tflops=1.0)
    assert cpu[0].mfu == pytest.approx(1e10 / 1e12)


# --- bottleneck verdicts -----------------------------------------------------------------------------------------


def test_bottleneck_rules() -> None:
    compute = {"data": 0.05, "forward": 0.35, "backward": 0.5, "optimizer": 0.1}
    assert bottleneck({**compute, "data": 0.2}, None, None, 1)[0] == "input-bound"
    assert bottleneck({**compute, "data": 0.12}, 40.0, None, 1)[0] == "input-bound"  # idle GPU and some waiting
    assert bottleneck({**compute, "data": 0.12}, 90.0, None, 1)[0] == "compute-bound"
    assert bottleneck({**compute, "communication": 0.3}, None, None, 2)[0] == "communication-bound"
    assert bottleneck({**compute, "communication": 0.3}, None, None, 1)[0] == "compute-bound"
    assert bottleneck(compute, 95.0, 0.95, 1)[0] == "memory-bound"
    assert bottleneck(compute, 95.0, 0.5, 1) == ("compute-bound", "95% of the step computes, GPU busy 95%")


def test_communication_is_the_backward_time_beyond_the_single_process_stage_and_advice_follows() -> None:
    rows = [
        _row("amp", 10.0, 2.0, precision="bf16-mixed", backward_s=0.3),
        _row("ddp", 6.0, 2.0, world=2, precision="bf16-mixed", backward_s=0.6),
    ]
    finalize(rows, mode="min", tolerance=0.02, settings={"amp": {"num_workers": 2, "precision": "bf16-mixed"}})
    assert rows[1].split["communication"] == pytest.approx(0.3)
    assert rows[1].bottleneck == "communication-bound" and "accumulation=fixed" in rows[1].next_step
    assert rows[0].bottleneck == "compute-bound" and rows[0].next_step == "preset=ddp"
    slow_input = [_row("baseline", 10.0, 2.0, data_s=0.4)]
    finalize(slow_input, mode="min", tolerance=0.02, settings={"baseline": {"num_workers": 0}})
    assert slow_input[0].bottleneck == "input-bound" and slow_input[0].next_step.startswith("preset=amp")


def test_advice_never_names_what_the_stage_already_has() -> None:
    row = _row("model_parallel", 6.0, 2.0, world=2)
    ddp = next_step(row, "communication-bound", 2, "bf16-mixed", accumulate=1, family="ddp")
    assert "accumulation=fixed" in ddp and "ddp_grad_compression" in ddp and "strategy=pipeline" in ddp
    sharded = next_step(row, "communication-bound", 2, "bf16-mixed", accumulate=4, family="model_parallel")
    assert "accumulation" not in sharded and "model_parallel" not in sharded and "ddp_grad_compression" not in sharded
    assert "nccl=ib" in sharded
    fed = next_step(row, "input-bound", 4, "32-true")
    assert "now 4" in fed and "preset=amp" not in fed  # it has workers: raise them, do not add a tuner


def test_advice_and_the_search_read_one_table_of_moves() -> None:
    from lightning_accel.autotune import search
    from lightning_accel.benchmark import moves

    assert search.MOVES is moves.MOVES
    row = _row("ddp", 6.0, 2.0, world=2)
    advice = next_step(row, "memory-bound", 0, "32-true", family="ddp")
    for move in moves.MOVES:
        if "memory-bound" in move.addresses and move.needs != ("model_parallel",):
            assert move.words() in advice, move.name  # every memory move the stage lacks, in the table's words


# --- planning and bad input ----------------------------------------------------------------------------------------


def test_default_ladder_ends_with_the_best_model_parallel_stage() -> None:
    assert default_ladder(["amp", "baseline", "ddp"]) == ["baseline", "amp", "ddp", "model_parallel"]
    assert default_ladder(["amp", "baseline", "ddp", "pipeline"])[-1] == "model_parallel"  # pipeline: by name only


@pytest.mark.slow
def test_plan_skips_what_cannot_run_here_and_budgets_the_rest(tmp_path: Path) -> None:
    ladder = ["baseline", "ddp", "model_parallel"]
    overrides = ["trainer.accelerator=cpu", "trainer.devices=1", "precision=fp16_mixed"]
    plans, _ = plan_stages(ladder, overrides, BenchSettings(steps=8), tmp_path, visible_cuda=0)
    assert [p.status for p in plans] == ["skipped"] * 3
    assert "fp16" in plans[0].reason and "CUDA" in plans[0].reason
    plans, seed = plan_stages(
        ladder, ["trainer.accelerator=cpu", "trainer.devices=1"], BenchSettings(steps=8), tmp_path, visible_cuda=0
    )
    assert [p.status for p in plans] == ["ok", "skipped", "skipped"] and seed == 1234  # the config's seed
    assert "with one device" in plans[1].reason
    command = plans[0].command(tmp_path / "run0", seed + 1)
    assert "preset=baseline" in command and "trainer.max_steps=8" in command and "test=false" in command
    assert any(c.endswith("_target_=lightning_accel.callbacks.BenchMonitor") for c in command)
    assert "seed=1235" in command and f"hydra.run.dir={tmp_path / 'run0'}" in command
    assert f"++callbacks.bench_monitor.output_path={tmp_path / 'run0' / 'stage.json'}" in command


@pytest.mark.slow
def test_plan_matches_samples_across_stages_with_bigger_global_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("lightning_accel.shape._usable_cpus", lambda: 2)  # 2 CPU ranks, on any machine
    plans, _ = plan_stages(
        ["baseline", "ddp", "model_parallel"],
        ["trainer.accelerator=cpu"],
        BenchSettings(steps=40),
        tmp_path,
        visible_cuda=0,
    )
    assert [p.world_size for p in plans] == [1, 2, 2]
    assert [p.global_batch for p in plans] == [32, 64, 256]  # model_parallel: 2 ranks x accumulate 4
    assert [p.steps for p in plans] == [40, 20, 5]
    assert "trainer.devices=2" in plans[1].command(tmp_path, None)
    same = BenchSettings(steps=40, match="steps")
    same_steps, _ = plan_stages(["baseline", "ddp"], ["trainer.accelerator=cpu"], same, tmp_path, visible_cuda=0)
    assert [p.steps for p in same_steps] == [40, 40]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--ladder", "baseline,nope"], ["`nope`", "amp", "baseline", "ddp", "model_parallel"]),
        (["trainer.devices=abc"], ["trainer.devices", "abc"]),
        (["model=nope"], ["model=nope"]),
        (["--tolerance", "2"], ["--tolerance", "fraction"]),
        (["--until-target"], ["--target"]),
        (["preset=amp"], ["--ladder"]),
        (["--metric", "train/loss"], ["val/"]),
        (["--metric", "val/loss,val/bpc"], ["`--metric='val/loss,val/bpc'`", "one metric key"]),
        (["--out", "/proc/version/x"], ["`--out=/proc/version/x` cannot be written", "is a file"]),
    ],
)
def test_bad_input_is_named_before_any_stage_runs(argv, words, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("lightning_accel.benchmark.run.run_once", lambda *a, **k: pytest.fail("a stage ran"))
    assert bench.main(["--out", str(tmp_path / "out"), *argv]) == 2  # an --out in argv wins
    err = capsys.readouterr().err
    assert err.startswith("accel-bench: error:")
    for word in words:
        assert word in err


# --- a failing stage and the outputs, without training ------------------------------------------------------------


def test_a_failing_stage_is_a_failed_row_and_the_ladder_goes_on(tmp_path: Path, monkeypatch) -> None:
    """The middle stage's process raises; the stages around it still run and the outputs are written."""
    times = {"baseline": 12.0, "model_parallel": 3.0}

    def launcher(command: list[str], stage_dir: Path, timeout: float | None) -> subprocess.CompletedProcess[str]:
        name = stage_dir.parent.name.split("-", 1)[1]
        if name == "amp":
            code = "raise RuntimeError('rank 0 failed at global step 3: out of memory')"
            return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        stage_dir.mkdir(parents=True, exist_ok=True)
        (stage_dir / "stage.json").write_text(json.dumps(_measurement(times[name], 2.0)))
        return subprocess.CompletedProcess(command, 0, "", "")

    lines: list[str] = []
    monkeypatch.setattr("lightning_accel.benchmark.run._probe", _ScriptedProbe([]))
    run = run_bench(
        ["baseline", "amp", "model_parallel"],
        ["trainer.accelerator=cpu"],
        BenchSettings(steps=4, repeats=2),
        tmp_path,
        launcher=launcher,
        echo=lines.append,
    )
    statuses = {r.name: r.status for r in run.results}
    if statuses["model_parallel"] == "skipped":  # a 1-CPU machine
        assert "one device" in run.results[2].reason
    else:
        assert run.results[2].speedup == 4.0
    assert statuses["baseline"] == "ok" and statuses["amp"] == "failed"
    assert "RuntimeError" in run.results[1].reason and "out of memory" in run.results[1].reason
    assert "failed: exit 1: RuntimeError" in run.table
    assert {p.name for p in run.files} >= {"bench.md", "bench.csv", "bench.json"}


# --- end to end ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QuickBench:
    """What one `accel-bench --quick` run left: the tests below each check one part of it."""

    result: subprocess.CompletedProcess[str]
    out: Path

    def report(self) -> dict[str, Any]:
        return json.loads((self.out / "bench.json").read_text())

    def stages(self) -> dict[str, dict[str, Any]]:
        return {s["name"]: s for s in self.report()["stages"]}


@pytest.fixture(scope="module")
def _quick_bench_runs() -> dict[str, QuickBench | str]:
    return {}


@pytest.fixture
def quick_bench(
    _quick_bench_runs: dict[str, QuickBench | str], run_cli, tmp_path_factory: pytest.TempPathFactory
) -> QuickBench:
    """`accel-bench --quick` for real, at the tiniest settings, once for this module (the module-scoped cache; `run_cli`
    is function-scoped): two stages train twice each, round by round; ddp on one device is skipped."""
    if "run" not in _quick_bench_runs:
        tmp_path = tmp_path_factory.mktemp("quick_bench")
        out = tmp_path / "bench"
        args = [
            "--quick",
            "--ladder",
            "baseline,amp,ddp",
            "--steps",
            "6",
            "--out",
            str(out),
            "trainer.devices=1",
            "data.max_chars=120000",
            "model.n_layer=1",
            "--max-reruns",
            "0",
        ]
        _quick_bench_runs["run"] = "it did not finish"  # a hang fails every test once, not each after 300 s
        started = time.perf_counter()
        result = run_cli(args, cwd=tmp_path, timeout=300, module="lightning_accel.bench")
        print(f"accel-bench --quick (2 stages x 2 rounds): {time.perf_counter() - started:.1f} s")
        _quick_bench_runs["run"] = QuickBench(result, out)
    bench_run = _quick_bench_runs["run"]
    if isinstance(bench_run, str):
        pytest.fail(f"accel-bench --quick failed in an earlier test: {bench_run}")
    assert bench_run.result.returncode in (0, 1), bench_run.result.stderr[-3000:]  # 1: amp's loss may move > 2%
    return bench_run


@pytest.mark.slow
def test_quick_cli_reports_its_settings_and_every_stage(quick_bench: QuickBench) -> None:
    report = quick_bench.report()
    assert report["schema_version"] == 2 and report["reference"] == "baseline"
    assert report["settings"]["repeats"] == 2 and report["settings"]["speedup_by"] == "throughput"
    assert set(report["machine"]) >= {"torch", "lightning", "python", "cpus"}
    assert [s["name"] for s in report["stages"]] == ["baseline", "amp", "ddp"]
    ddp = quick_bench.stages()["ddp"]
    assert ddp["status"] == "skipped" and "one device" in ddp["reason"]


@pytest.mark.slow
def test_quick_cli_runs_the_stages_round_by_round(quick_bench: QuickBench) -> None:
    lines = quick_bench.result.stdout.splitlines()
    order = [line.split("`")[1] for line in lines if line.startswith("accel-bench: run ")]
    assert order == ["baseline", "amp", "amp", "baseline"]  # interleaved, round by round, round 2 in reverse


@pytest.mark.slow
@pytest.mark.parametrize("name", ["baseline", "amp"])
def test_quick_cli_stage_carries_its_runs_and_their_median(quick_bench: QuickBench, name: str) -> None:
    stage = quick_bench.stages()[name]
    assert stage["status"] == "ok", stage["reason"]
    runs = stage["runs"]
    assert [r["round"] for r in runs] == [0, 1] and [r["seed"] for r in runs] == [1234, 1235]
    assert all(r["interference"] is not None and "other_cpu_s" in r["interference"] for r in runs)
    times = sorted(r["measurement"]["train_s"] for r in runs if not r["flagged"]) or sorted(
        r["measurement"]["train_s"] for r in runs
    )
    assert stage["time_s"] == pytest.approx(sum(times) / len(times))  # the median of two
    assert stage["time_interval"]["low"] <= stage["time_s"] <= stage["time_interval"]["high"]
    assert stage["metric_interval"]["n"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["baseline", "amp"])
def test_quick_cli_stage_measures_and_explains_what_it_cannot(quick_bench: QuickBench, name: str) -> None:
    stage = quick_bench.stages()[name]
    measured = stage["runs"][0]["measurement"]
    assert measured["optimizer_steps"] == 6 and measured["flops_per_batch"] > 0
    assert measured["final_metric"] is not None and len(measured["validations"]) == 2
    assert measured["energy_j"] is None and measured["energy_note"]  # no RAPL, no GPU here: n/a with a reason
    assert stage["bottleneck"] in ("input-bound", "compute-bound") and stage["next_step"]
    assert stage["mfu"] is None and "CPU" in stage["mfu_note"]


@pytest.mark.slow
def test_quick_cli_speedup_carries_its_interval_and_verdict(quick_bench: QuickBench) -> None:
    amp = quick_bench.stages()["amp"]
    assert amp["speedup_interval"]["low"] <= amp["speedup"] <= amp["speedup_interval"]["high"]
    assert amp["speedup_verdict"] in ("faster", "slower", "no clear difference")


@pytest.mark.slow
def test_quick_cli_writes_the_csv_the_table_and_the_png(quick_bench: QuickBench) -> None:
    out, amp = quick_bench.out, quick_bench.stages()["amp"]
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert [r["stage"] for r in rows] == ["baseline", "amp", "ddp"]
    assert float(rows[1]["speedup"]) == pytest.approx(amp["speedup"])
    assert float(rows[1]["speedup_low"]) == pytest.approx(amp["speedup_interval"]["low"])
    assert rows[1]["energy_note"] and rows[1]["energy_j"] == ""
    table = (out / "bench.md").read_text()
    assert table.count("\n| ") == 4 and "| baseline |" in table and "skipped:" in table
    assert "1.00x (reference)" in table and " [" in table  # intervals in the table
    assert "| stage | what it changes | runs | time | speedup |" in quick_bench.result.stdout
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_busy_machine_is_noted() -> None:
    from lightning_accel.benchmark.run import busy_note

    assert "load average 4.1 on 2 CPU(s)" in busy_note({"load_average_1m": 4.1, "cpus": 2})
    assert busy_note({"load_average_1m": 1.5, "cpus": 2}) is None and busy_note({"load_average_1m": None}) is None


def test_a_stage_past_its_timeout_is_stopped_with_its_children(tmp_path: Path) -> None:
    import psutil

    from lightning_accel.benchmark.process import launch, run_once

    child = "import time; time.sleep(120)"
    code = (
        f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {child!r}]); print(p.pid); "
        "sys.stdout.flush(); time.sleep(120)"
    )
    result = run_once(
        [sys.executable, "-c", code], tmp_path / "0-slow", round_index=0, seed=None, timeout=3.0, launcher=launch
    )
    assert result.status == "failed" and "--stage-timeout=3 s" in result.reason
    grandchild = int((tmp_path / "0-slow" / "stdout.log").read_text().split()[0])

    def gone() -> bool:
        try:
            return psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(gone, timeout_s=10, what=f"the stage's grandchild (pid {grandchild}) to end")


def test_paths_become_hydra_values() -> None:
    from lightning_accel.benchmark.stage_config import hydra_value

    assert hydra_value(Path("/tmp/out/0-baseline")) == "/tmp/out/0-baseline"
    assert hydra_value(Path("/tmp/my runs/it's")) == "'/tmp/my runs/it\\'s'"


@pytest.mark.gpu
def test_quick_ladder_on_a_gpu_measures_mfu_and_utilisation(run_cli, tmp_path: Path) -> None:
    """On a CUDA machine: MFU from the peak table and GPU utilisation from GPUMonitor are filled in."""
    out = tmp_path / "bench"
    result = run_cli(
        ["--quick", "--ladder", "baseline,amp", "--out", str(out)],
        cwd=tmp_path,
        timeout=600,
        module="lightning_accel.bench",
    )
    assert result.returncode in (0, 1), result.stderr[-3000:]
    stages = json.loads((out / "bench.json").read_text())["stages"]
    for stage in stages:
        assert stage["status"] == "ok", stage["reason"]
        assert stage["device"] != "cpu" and stage["peak_memory_bytes"] > 0
        assert stage["mfu"] is None or 0 < stage["mfu"] < 1, stage["mfu_note"]
        assert stage["gpu_utilization_pct"] is not None


def test_your_own_model_from_your_own_config_directory(tmp_path: Path) -> None:
    """A model config of the user's, found through `hydra.searchpath`, is planned for every stage; --quick's GPT
    shrinking is left out for it."""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "tiny_mlp.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /data: digits\nmodel:\n"
        "  _target_: lightning_accel.examples.DigitsClassifier\n  hidden_dim: 32\n"
    )
    overrides = [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "model=tiny_mlp", "trainer.accelerator=cpu"]
    plans, _ = plan_stages(
        ["baseline", "amp"], overrides, BenchSettings(steps=10, profile="quick"), tmp_path / "out", visible_cuda=0
    )
    assert [p.status for p in plans] == ["ok", "ok"], [p.reason for p in plans]
    assert [p.global_batch for p in plans] == [64, 64]  # data=digits' batch size
    for plan in plans:
        command = plan.command(tmp_path, 1)
        assert "model=tiny_mlp" in command and not any(c.startswith("model.n_embd") for c in command)


@pytest.mark.slow
def test_gpu_profile_plans_gpt2_small_with_compile_kept_out_of_the_rates(tmp_path: Path, monkeypatch) -> None:
    """`--profile gpu` on a one-GPU machine (planned here with one visible CUDA device): GPT-2 small on every stage,
    amp + compile as a rung, the DDP rungs skipped with the reason, 10 warm-up batches and one batch in ten
    synchronised in every run, the DataLoaderTuner bounded; a model the user selects is kept."""
    from lightning_accel.benchmark.stage_plan import PROFILES

    monkeypatch.setattr("lightning_accel.shape._visible_cuda_devices", lambda: 1)
    monkeypatch.setattr("lightning_accel.precision._probe_cuda", lambda: ((9, 0), "NVIDIA H200"))
    gpu = PROFILES["gpu"]
    settings = BenchSettings(steps=gpu.steps, match=gpu.match, profile="gpu", val_checks=gpu.val_checks)
    plans, _ = plan_stages(list(gpu.ladder), ["trainer.accelerator=gpu"], settings, tmp_path / "out", visible_cuda=1)
    by_name = {p.name: p for p in plans}
    assert [by_name[n].status for n in ("baseline", "amp", "amp_compile")] == ["ok"] * 3
    assert by_name["ddp"].status == by_name["model_parallel"].status == "skipped"
    assert "one device" in by_name["ddp"].reason
    assert by_name["amp_compile"].settings["compile"] == "compile=default"
    assert by_name["baseline"].precision == "32-true" and by_name["amp"].precision == "bf16-mixed"
    for name in ("baseline", "amp", "amp_compile"):
        command = by_name[name].command(tmp_path, 1)
        assert "model=gpt2_small" in command and by_name[name].steps == 64
        assert "++callbacks.bench_monitor.warmup_batches=10" in command
        assert "++callbacks.bench_monitor.split_every_n_batches=10" in command
    assert "++callbacks.dataloader_tuner.max_tuning_time_s=10" in by_name["amp"].command(tmp_path, 1)
    mine, _ = plan_stages(
        ["baseline"], ["model=classifier", "trainer.accelerator=gpu"], settings, tmp_path / "o2", visible_cuda=1
    )
    assert "model=gpt2_small" not in mine[0].command(tmp_path, 1) and "model=classifier" in mine[0].overrides


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
@pytest.mark.parametrize("module", ["lightning_accel.bench", "lightning_accel.tune"])
def test_gpu_profile_is_refused_without_a_gpu_before_anything_runs(run_cli, tmp_path: Path, module: str) -> None:
    result = run_cli(["--profile", "gpu", "--out", str(tmp_path / "out")], cwd=tmp_path, module=module, timeout=120)
    assert result.returncode == 2
    assert "`--profile gpu` needs a CUDA GPU" in result.stderr and "--profile quick" in result.stderr
    assert not (tmp_path / "out" / "stages").exists()


def test_quick_bounds_a_dataloader_tuner_search() -> None:
    from lightning_accel.benchmark.stage_plan import StagePlan, budget_overrides

    plan = StagePlan(name="amp", overrides=("preset=amp",), callbacks=("dataloader_tuner", "lr_monitor"))
    _, quick = budget_overrides(plan, BenchSettings(profile="quick"), 32)
    assert "++callbacks.dataloader_tuner.max_tuning_time_s=10" in quick  # ++: a tuner added by accel-tune too
    assert not any("dataloader_tuner" in o for o in budget_overrides(plan, BenchSettings(), 32)[1])


@pytest.mark.parametrize(
    ("metric", "higher"),
    [
        ("val/acc", True),
        ("val/top1_acc", True),
        ("val/map_50", True),
        ("val/f1", True),
        ("val/loss", False),
        ("val/bpc", False),
        ("val/mape", False),
        ("val/smape", False),
        ("val/acc_error", False),
        ("val/wer", False),
    ],
)
def test_metric_direction_from_whole_words(metric: str, higher: bool) -> None:
    assert higher_is_better(metric) is higher


@pytest.mark.parametrize("path", ["/tmp/plain/dir", "/tmp/a b", "/tmp/a\\b c", "/tmp/it's", "/tmp/end\\", "/tmp/x=y"])
def test_run_directories_survive_hydra_override_parsing(path: str) -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from lightning_accel.benchmark.stage_config import hydra_value

    parsed = OverridesParser.create().parse_override(f"hydra.run.dir={hydra_value(Path(path))}")
    assert parsed.value() == path


def test_pipeline_and_tensor_parallel_ranks_count_their_shared_batches_once() -> None:
    from omegaconf import OmegaConf

    from lightning_accel.shape import run_shape

    def replicas(strategy: object, devices: int) -> int | None:
        cfg = OmegaConf.create({"trainer": {"accelerator": "cpu", "devices": devices, "strategy": strategy}})
        return run_shape(cfg, visible_cuda=0, cpus=4).data_parallel_size()

    assert replicas({"_target_": "x.DDPStrategy"}, 4) == 4
    pipeline = "lightning_accel.strategies.pipeline.PipelineStrategy"
    assert replicas({"_target_": pipeline, "data_parallel_size": 1, "n_microbatches": 4}, 2) == 1  # pp=2
    assert replicas({"_target_": pipeline}, 4) == 1  # the constructor's default: one pipeline over every rank
    ours = "lightning_accel.strategies.model_parallel.ModelParallelStrategy"
    assert replicas({"_target_": ours, "data_parallel_size": "auto", "tensor_parallel_size": 2}, 4) == 2
    assert replicas({"_target_": ours, "data_parallel_size": "auto", "tensor_parallel_size": "auto"}, 4) == 1  # nodes
    lightnings = "lightning.pytorch.strategies.ModelParallelStrategy"
    assert replicas({"_target_": lightnings, "tensor_parallel_size": 2}, 4) == 1  # Lightning's auto: the nodes
    assert replicas("ddp", 2) == 2
    assert replicas("ddp", "auto") is None  # the machine decides the world


def test_fp32_on_a_gpu_without_tf32_is_measured_against_its_fp32_peak() -> None:
    from lightning_accel.benchmark.results import _derive

    row = StageResult(
        name="baseline",
        measurement={
            **_measurement(10.0, 2.0, device="Tesla V100-SXM2-32GB"),
            "float32_matmul_precision": "high",
            "compute_capability": [7, 0],
        },
    )
    _derive(row, None)
    assert row.dtype == "fp32" and row.mfu is not None
    ampere = StageResult(
        name="baseline",
        measurement={**row.measurement, "device": "NVIDIA A100-SXM4-80GB", "compute_capability": [8, 0]},
    )
    _derive(ampere, None)
    assert ampere.dtype == "tf32"


# --- repeats, intervals, interference, noise-aware quality, energy -------------------------------------------------


def _fake_launcher(times: dict[str, list[float]], metrics: dict[str, list[float]] | None = None):
    """A launcher that writes each stage's next recorded time (and metric) as its measurement, in call order."""
    calls: list[str] = []

    def launcher(command: list[str], stage_dir: Path, timeout: float | None) -> subprocess.CompletedProcess[str]:
        name = stage_dir.parent.name.split("-", 1)[1]
        count = calls.count(name)
        calls.append(name)
        metric = (metrics or {}).get(name, [2.0] * 10)[count]
        stage_dir.mkdir(parents=True, exist_ok=True)
        (stage_dir / "stage.json").write_text(json.dumps(_measurement(times[name][count], metric)))
        return subprocess.CompletedProcess(command, 0, "", "")

    return launcher, calls


class _ScriptedProbe:
    """An interference probe whose verdicts are scripted per call (a stand-in for a busy /proc/stat)."""

    def __init__(self, flags: list[bool]) -> None:
        self.flags = flags
        self.calls = 0

    def __call__(self, settings: BenchSettings, on_cuda: bool) -> object:
        from lightning_accel.system.interference import Interference

        flagged = self.flags[self.calls] if self.calls < len(self.flags) else False
        self.calls += 1
        reasons = ("other processes used 1.00 of 2 CPU(s) (50%)",) if flagged else ()
        result = Interference(
            wall_s=1.0,
            cpus=2,
            other_cpu_s=1.0 if flagged else 0.01,
            own_cpu_s=1.0,
            steal_s=0.0,
            load_start=1.0,
            load_end=1.0,
            flagged=flagged,
            reasons=reasons,
        )

        class Probe:
            def start(self) -> None:
                pass

            def stop(self) -> Interference:
                return result

        return Probe()


def test_rounds_interleave_and_a_flagged_run_is_run_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launcher, calls = _fake_launcher({"baseline": [10.0, 10.2, 9.8, 10.1], "amp": [20.0, 5.0, 5.1, 4.9]})
    # the first amp run is measured under interference (20 s), its rerun is quiet
    probe = _ScriptedProbe([False, True, False, False, False, False, False])
    monkeypatch.setattr("lightning_accel.benchmark.run._probe", probe)
    lines: list[str] = []
    run = run_bench(
        ["baseline", "amp"],
        ["trainer.accelerator=cpu", "trainer.devices=1"],
        BenchSettings(steps=4, repeats=3),
        tmp_path,
        launcher=launcher,
        echo=lines.append,
    )
    assert calls == ["baseline", "amp", "amp", "amp", "baseline", "baseline", "amp"]  # round 2 in reverse order
    amp = run.results[1]
    assert [(r.round, r.flagged, r.replaced) for r in amp.runs] == [
        (0, True, True),
        (0, False, False),
        (1, False, False),
        (2, False, False),
    ]
    assert amp.time_s == 5.0 and not amp.interference  # the flagged 20 s run is not counted
    assert amp.speedup == pytest.approx(2.0) and amp.speedup_verdict == "faster"  # 10/5, 10.2/5.1, 9.8/4.9
    assert amp.speedup_interval is not None and amp.speedup_interval["n"] == 3
    assert any("ran under interference" in line and "again" in line for line in lines)
    assert "1 rerun(s)" in amp.interference_note


def test_a_stage_under_interference_in_every_run_is_flagged_in_every_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher, calls = _fake_launcher({"baseline": [10.0, 10.0], "amp": [2.0, 2.1, 2.2, 2.3]})
    probe = _ScriptedProbe([False, True, True, True, False])  # amp: flagged, rerun flagged, in both rounds
    monkeypatch.setattr("lightning_accel.benchmark.run._probe", probe)
    lines: list[str] = []
    run = run_bench(
        ["baseline", "amp"],
        ["trainer.accelerator=cpu", "trainer.devices=1"],
        BenchSettings(steps=4, repeats=2, max_reruns=1),
        tmp_path,
        launcher=launcher,
        echo=lines.append,
    )
    assert calls == ["baseline", "amp", "amp", "amp", "baseline"]  # one rerun in all (--max-reruns 1); round 2 reversed
    amp = run.results[1]
    assert amp.interference and "FLAGGED" in run.table and "(interference)" in run.table
    assert any("measured under interference: amp" in line for line in lines)
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["stages"][1]["interference"] is True and report["stages"][1]["runs"][0]["flagged"] is True
    row = list(csv.DictReader((tmp_path / "bench.csv").open()))[1]
    assert row["interference"] == "True" and "under interference" in row["interference_note"]


def test_a_speedup_whose_interval_holds_one_is_no_clear_difference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("lightning_accel.benchmark.run._probe", _ScriptedProbe([]))  # quiet, whatever the machine
    launcher, _ = _fake_launcher({"baseline": [10.0, 10.0, 10.0], "amp": [9.0, 10.5, 10.0]})
    run = run_bench(
        ["baseline", "amp"],
        ["trainer.accelerator=cpu", "trainer.devices=1"],
        BenchSettings(steps=4, repeats=3),
        tmp_path,
        launcher=launcher,
        echo=lambda _: None,
    )
    amp = run.results[1]
    assert amp.speedup_verdict == "no clear difference"
    assert "no clear difference [0.95, 1.11]x" in run.table
    assert "1.00x" not in run.table.splitlines()[3]  # no number that reads as a win


def test_quality_fails_only_beyond_both_the_tolerance_and_the_references_own_noise() -> None:
    # the reference's seeds spread over 0.1 (5% of 2.0): a stage 4% worse is within that noise
    assert quality_verdict(2.08, 2.0, "min", 0.02, noise=0.1)[0] == "pass"
    assert quality_verdict(2.11, 2.0, "min", 0.02, noise=0.1)[0] == "FAIL"
    assert quality_verdict(2.05, 2.0, "min", 0.02, noise=0.01)[0] == "FAIL"  # beyond the tolerance and the noise
    assert quality_verdict(0.86, 0.9, "max", 0.02, noise=0.05)[0] == "pass"
    assert quality_verdict(math.nan, 2.0, "min", 0.02, noise=0.1)[0] == "FAIL"  # a loss that diverged lost quality


def test_repeats_one_runs_the_reference_twice_for_its_noise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("lightning_accel.benchmark.run._probe", _ScriptedProbe([]))
    launcher, calls = _fake_launcher(
        {"baseline": [10.0, 10.0], "amp": [5.0]}, metrics={"baseline": [2.0, 2.1], "amp": [2.09]}
    )
    run = run_bench(
        ["baseline", "amp"],
        ["trainer.accelerator=cpu", "trainer.devices=1"],
        BenchSettings(steps=4, repeats=1),
        tmp_path,
        launcher=launcher,
        echo=lambda _: None,
    )
    assert calls == ["baseline", "amp", "baseline"]
    base, amp = run.results
    assert [r.seed for r in base.runs] == [1234, 1235]
    assert base.quality_noise == pytest.approx(0.1) and amp.quality == "pass"  # +2.1% vs median 2.05, noise 0.1


def test_a_stage_on_fewer_steps_says_so(tmp_path: Path) -> None:
    rows = [_row("baseline", 10.0, 2.0), _row("ddp", 5.0, 2.01)]
    rows[0].steps, rows[1].steps = 40, 20
    finalize(rows, mode="min", tolerance=0.02)
    assert rows[1].reference_steps == 40 and rows[0].reference_steps is None
    assert "pass (+0.5%); steps 20 vs 40" in markdown_table(rows, "val/loss", 0.02, None)


@pytest.mark.slow  # ~45 s; the quality verdict's rules run in process by default
def test_a_broken_learning_rate_still_fails_quality(run_cli, tmp_path: Path) -> None:
    """A rung that really loses quality (its LR 100x too low: the loss hardly moves) fails the gate whatever the
    noise, and exits 1."""
    conf = tmp_path / "conf" / "preset"
    conf.mkdir(parents=True)
    (conf / "hot.yaml").write_text("# @package _global_\nmodel:\n  optimizer:\n    lr: 0.00003\n")
    out = tmp_path / "bench"
    args = [
        "--ladder",
        "baseline,hot",
        "--steps",
        "30",
        "--repeats",
        "1",
        "--val-checks",
        "1",
        "--out",
        str(out),
        "--max-reruns",
        "0",
        f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
        "data.max_chars=120000",
        "model.n_layer=1",
        "model.n_embd=32",
        "trainer.limit_val_batches=4",
    ]
    result = run_cli(args, cwd=tmp_path, timeout=300, module="lightning_accel.bench")
    stages = {s["name"]: s for s in json.loads((out / "bench.json").read_text())["stages"]}
    assert stages["hot"]["quality"] == "FAIL", (stages["hot"]["metric_interval"], stages["baseline"]["metric_interval"])
    assert [r["seed"] for r in stages["baseline"]["runs"]] == [1234, 1235]  # --repeats 1: a second seed, for noise
    assert stages["baseline"]["quality_noise"] > 0 and result.returncode == 1


def test_energy_from_the_fake_nvml_counter_leaves_validation_out(monkeypatch: pytest.MonkeyPatch) -> None:
    from _fake_nvml import FakeClock, FakeGPU, FakeNVML, install

    from lightning_accel.telemetry.energy import open_energy_meter

    clock = FakeClock()
    gpus = [FakeGPU("GPU-a", energy_mj=lambda t: 300_000.0 * t), FakeGPU("GPU-b", energy_mj=lambda t: 100_000.0 * t)]
    install(monkeypatch, FakeNVML(gpus, clock=clock))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    meter, reason = open_energy_meter([0, 1])
    assert meter is not None and reason == "" and "2 GPU(s)" in meter.source
    clock.advance(10.0)  # training: 400 W for 10 s
    meter.pause()
    clock.advance(5.0)  # validation: not counted
    meter.resume()
    clock.advance(2.0)
    assert meter.pause() == pytest.approx(4800.0)


def test_energy_from_rapl_or_n_a_with_the_reason(tmp_path: Path) -> None:
    from lightning_accel.telemetry.energy import open_energy_meter

    meter, reason = open_energy_meter(None, root=tmp_path)
    assert meter is None and "no RAPL" in reason
    domain = tmp_path / "sys" / "class" / "powercap" / "intel-rapl:0"
    domain.mkdir(parents=True)
    (domain / "name").write_text("package-0\n")
    (domain / "max_energy_range_uj").write_text("1000000\n")
    (domain / "energy_uj").write_text("900000\n")
    meter, reason = open_energy_meter(None, root=tmp_path)
    assert meter is not None and "package-0" in meter.source
    (domain / "energy_uj").write_text("100000\n")  # wrapped: 0.1 J to the top, then 0.1 J
    assert meter.pause() == pytest.approx(0.2)


def test_a_failed_rerun_leaves_the_flagged_run_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inner, calls = _fake_launcher({"baseline": [10.0], "amp": [5.0]})

    def launcher(command: list[str], stage_dir: Path, timeout: float | None) -> subprocess.CompletedProcess[str]:
        if stage_dir.name.endswith("-rerun1"):
            return subprocess.CompletedProcess(command, 1, "", "RuntimeError: the rerun broke")
        return inner(command, stage_dir, timeout)

    monkeypatch.setattr("lightning_accel.benchmark.run._probe", _ScriptedProbe([False, True, False]))
    lines: list[str] = []
    run = run_bench(
        ["baseline", "amp"],
        ["trainer.accelerator=cpu", "trainer.devices=1"],
        BenchSettings(steps=4, repeats=1),
        tmp_path,
        launcher=launcher,
        echo=lines.append,
    )
    amp = run.results[1]
    assert [(r.status, r.flagged, r.replaced) for r in amp.runs] == [("ok", True, False), ("failed", False, False)]
    assert amp.status == "ok" and amp.time_s == 5.0 and amp.interference
    assert any("rerun of `amp` failed" in line for line in lines)


def test_a_rerun_into_the_same_out_never_reports_an_old_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("lightning_accel.benchmark.run._probe", _ScriptedProbe([]))
    old = tmp_path / "stages" / "0-baseline" / "run0"
    old.mkdir(parents=True)
    (old / "stage.json").write_text(json.dumps(_measurement(1.0, 2.0)))  # an earlier bench's result

    def trains_nothing(command: list[str], stage_dir: Path, timeout: float | None) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(command, 0, "", "")  # `fit=false`: exit 0, no measurement

    run = run_bench(
        ["baseline"],
        ["trainer.accelerator=cpu", "trainer.devices=1"],
        BenchSettings(steps=4, repeats=1),
        tmp_path,
        launcher=trains_nothing,
        echo=lambda _: None,
    )
    assert run.results[0].status == "failed" and "wrote no measurement" in run.results[0].reason


def test_a_non_empty_out_is_refused_unless_overwrite(tmp_path: Path, capsys) -> None:
    (tmp_path / "bench.md").write_text("an earlier table")
    assert bench.main(["--out", str(tmp_path), "--ladder", "baseline"]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_ctrl_c_keeps_the_runs_that_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("lightning_accel.benchmark.run._probe", _ScriptedProbe([]))
    inner, calls = _fake_launcher({"baseline": [10.0, 10.0], "amp": [5.0, 5.0]})

    def launcher(command: list[str], stage_dir: Path, timeout: float | None) -> subprocess.CompletedProcess[str]:
        if len(calls) == 3:  # round 2 (reversed: amp, baseline)'s baseline: the user presses Ctrl-C
            raise KeyboardInterrupt
        return inner(command, stage_dir, timeout)

    run = run_bench(
        ["baseline", "amp"],
        ["trainer.accelerator=cpu", "trainer.devices=1"],
        BenchSettings(steps=4, repeats=2),
        tmp_path,
        launcher=launcher,
        echo=lambda _: None,
    )
    assert run.interrupted and calls == ["baseline", "amp", "amp"]
    assert [r.status for r in run.results] == ["ok", "ok"] and run.results[1].speedup == 2.0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["interrupted"] is True and [len(s["runs"]) for s in report["stages"]] == [1, 2]
    assert (tmp_path / "bench.md").is_file()


def test_what_a_stage_changes_names_compile_and_micro_batch(tmp_path: Path) -> None:
    from lightning_accel.benchmark.stage_plan import describe_changes, plan_stage

    plans = [
        plan_stage(name, [*overrides, "trainer.accelerator=cpu"], str(tmp_path / name))
        for name, overrides in (
            ("baseline", ["preset=baseline"]),
            ("compiled", ["preset=baseline", "compile=max-autotune"]),
            ("sized", ["preset=baseline", "micro_batch=auto"]),
        )
    ]
    described = describe_changes(plans)
    assert described["compiled"] == "compile=max-autotune" and described["sized"] == "micro_batch=auto"
