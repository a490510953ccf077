"""accel-tune end to end with a scripted launcher: the guided search, the quality gate, failures, the time budget,
Ctrl-C, the preset and the report. Each "run" writes the measurement a fake world gives its candidate."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from test_bench import _measurement

from lightning_accel.autotune.autopilot import TuneSettings, tune
from lightning_accel.autotune.search import Space
from lightning_accel.benchmark.stage_plan import BenchSettings

USER = ["trainer.accelerator=cpu", "trainer.devices=1"]


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """No interference flags: the scripted runs take no time, whatever else this machine runs."""
    from test_bench import _ScriptedProbe

    monkeypatch.setattr("lightning_accel.benchmark.run._probe", _ScriptedProbe([]))


def _candidate_of(command: list[str]) -> str:
    """The candidate a run measures: the name in its stage preset's first comment line."""
    preset = next(a.split("=", 1)[1] for a in command if a.startswith("preset="))
    searchpath = next(a for a in command if a.startswith("hydra.searchpath="))
    folder = Path(re.search(r"file://([^\]]+)", searchpath).group(1))  # type: ignore[union-attr]
    return (folder / "preset" / f"{preset}.yaml").read_text().splitlines()[1].lstrip("# ").strip()


def world(
    rates: dict[str, float],
    metrics: dict[str, float] | None = None,
    fails: tuple[str, ...] = (),
    data_share: dict[str, float] | None = None,
    on_call: Callable[[int], None] | None = None,
    oom: tuple[str, ...] = (),
    records: dict[str, dict[str, object]] | None = None,
):
    """A launcher whose runs measure `rates[candidate]` samples/s (+-1% by round), the metric `metrics[candidate]`
    (2.0), a data-wait share (input-bound above 0.2), and fail for the candidates in `fails`; `records[candidate]`
    adds to its BenchMonitor record (what a DataLoaderTuner or MicroBatchFinder decided)."""
    calls: list[str] = []

    def launcher(command: list[str], stage_dir: Path, timeout: float | None) -> subprocess.CompletedProcess[str]:
        name = _candidate_of(command)
        calls.append(name)
        if on_call is not None:
            on_call(len(calls))
        if name in fails:
            return subprocess.CompletedProcess(command, 1, "", "RuntimeError: boom in the candidate\n")
        if name in oom:
            return subprocess.CompletedProcess(command, 1, "", "torch.OutOfMemoryError: CUDA out of memory (fake)\n")
        rate = rates.get(name, rates["baseline"] * 0.9) * (1 + 0.01 * (len(calls) % 3 - 1))
        share = (data_share or {}).get(name, 0.05)
        m = _measurement(320.0 / rate, (metrics or {}).get(name, 2.0), data_s=share)
        m["steady_s"] = steady = 320.0 / rate
        compute = steady * (1 - share) / 3
        m["data_s"], m["forward_s"], m["backward_s"], m["optimizer_s"] = share * steady, compute, compute, compute
        m.update((records or {}).get(name, {}))
        stage_dir.mkdir(parents=True, exist_ok=True)
        (stage_dir / "stage.json").write_text(json.dumps(m))
        return subprocess.CompletedProcess(command, 0, "", "")

    return launcher, calls


def settings(tmp_path: Path, **kwargs) -> TuneSettings:
    return TuneSettings(
        bench=BenchSettings(steps=4, repeats=2, match="steps"), config_dir=tmp_path / "conf", name="tiny", **kwargs
    )


@pytest.mark.slow
def test_the_search_follows_the_bottleneck_keeps_quality_and_writes_the_preset(tmp_path: Path) -> None:
    rates = {"baseline": 100.0, "precision=amp": 150.0, "precision=amp+strategy=ddp+devices=2": 260.0}
    metrics = {"compile=default": 3.0}  # faster but worse: must not win
    rates["compile=default"] = 400.0
    launcher, calls = world(rates, metrics, fails=("compile=default+precision=amp",))
    lines: list[str] = []
    result = tune(
        USER, Space(devices=2, compile=True), settings(tmp_path), tmp_path / "out", launcher=launcher, echo=lines.append
    )
    assert result.pick is not None and result.pick.candidate.name == "precision=amp+strategy=ddp+devices=2"
    assert result.confirmed is True
    names = [o.candidate.name for o in result.history]
    assert names[0] == "baseline" and "compile=default" in names
    compiled = next(o for o in result.history if o.candidate.name == "compile=default")
    assert compiled.quality == "FAIL"
    failed = [o for o in result.history if o.status == "failed"]
    assert [o.candidate.name for o in failed] == ["compile=default+precision=amp"] and "boom" in failed[0].reason
    preset = (tmp_path / "conf" / "preset" / "tuned_tiny.yaml").read_text()
    assert "override /precision: amp" in preset and "override /strategy: ddp" in preset and "devices: 2" in preset
    report = (tmp_path / "out" / "tune.md").read_text()
    assert "| `compile=default` |" in report and "lost: quality" in report and "failed: " in report
    assert "lost: slower than the baseline |" in report  # a candidate at 0.9x, its interval below the baseline's
    assert "The pick: " in report and "the baseline's samples/s in the confirmation run" in report
    assert (
        "pick" in report
        and json.loads((tmp_path / "out" / "tune.json").read_text())["pick"] == result.pick.candidate.name
    )
    assert any("generation 1" in line for line in lines)


@pytest.mark.slow  # ~15 s; the confirmation runs in the search test by default
def test_a_pick_the_confirmation_does_not_uphold_leaves_the_baseline(tmp_path: Path) -> None:
    rates = {"baseline": 100.0, "precision=amp": 150.0}
    launcher, calls = world(rates)

    def confirm_aware(command, stage_dir, timeout):
        if "confirm" in stage_dir.parts:
            rates["precision=amp"] = 101.0  # the longer run shows no real gain
        return launcher(command, stage_dir, timeout)

    result = tune(
        USER,
        Space(devices=1, compile=False),
        settings(tmp_path),
        tmp_path / "out",
        launcher=confirm_aware,
        echo=lambda _: None,
    )
    assert result.confirmed is False and result.pick is not None and result.pick.candidate.name == "baseline"
    assert "override" not in (tmp_path / "conf" / "preset" / "tuned_tiny.yaml").read_text()  # the user's config as is


@pytest.mark.slow
def test_the_search_and_its_confirmation_end_inside_the_time_budget_and_ctrl_c_keeps_the_best_so_far(
    tmp_path: Path,
) -> None:
    """Every run takes 10 s of a fake clock (a confirmation run, 3x the steps, 30 s). The baseline's generation (2
    runs) costs 20 s; a generation starts only when it and the confirmation (2 stages x 2 rounds x 30 s) fit in what
    is left, so the whole search, confirmation included, ends inside 250 s."""
    now = [0.0]
    launcher, calls = world({"baseline": 100.0, "precision=amp": 150.0})

    def timed(command, stage_dir, timeout):
        now[0] += 30.0 if "confirm" in stage_dir.parts else 10.0
        return launcher(command, stage_dir, timeout)

    result = tune(
        USER,
        Space(devices=2, compile=True),
        settings(tmp_path, time_budget_s=250),
        tmp_path / "out",
        launcher=timed,
        echo=lambda _: None,
        clock=lambda: now[0],
    )
    assert result.generations == 2 and result.confirmed is True  # 20 s + 60 s + the confirmation's 120 s
    assert "would end past the time budget of 250 s (170 s left)" in result.stop_reason, result.stop_reason
    assert now[0] == 200.0 <= 250
    now[0] = 0.0
    result = tune(
        USER,
        Space(devices=2, compile=True),
        settings(tmp_path / "tight", time_budget_s=150),
        tmp_path / "out_tight",
        launcher=timed,
        echo=lambda _: None,
        clock=lambda: now[0],
    )
    assert result.generations == 1 and result.pick is not None and result.pick.candidate.name == "baseline"
    assert now[0] == 20.0  # 20 s + 60 s + 120 s would not fit: only the baseline, no confirmation needed

    def interrupt(n: int) -> None:
        if n == 5:  # generation 1, after the baseline's and amp's first round
            raise KeyboardInterrupt

    launcher, calls = world({"baseline": 100.0, "precision=amp": 150.0}, on_call=interrupt)
    result = tune(
        USER,
        Space(devices=2, compile=True),
        settings(tmp_path / "second"),
        tmp_path / "out2",
        launcher=launcher,
        echo=lambda _: None,
    )
    assert result.interrupted and result.stop_reason == "interrupted (Ctrl-C)" and result.confirmed is None
    assert result.pick is not None  # the best measured before Ctrl-C
    assert (tmp_path / "second" / "conf" / "preset" / "tuned_tiny.yaml").is_file()
    assert (tmp_path / "out2" / "tune.md").is_file()


@pytest.mark.slow  # ~15 s; the move table's order is checked in process by default
def test_an_input_bound_baseline_tries_the_dataloader_tuner_first(tmp_path: Path) -> None:
    tuner = "dataloader_tuner"
    decision = {"num_workers": 4, "prefetch_factor": 2, "pin_memory": False, "persistent_workers": True}
    launcher, calls = world(
        {"baseline": 100.0, tuner: 300.0}, data_share={"baseline": 0.6}, records={tuner: {"loader": decision}}
    )
    result = tune(
        USER,
        Space(devices=1, compile=False),
        settings(tmp_path, per_generation=1, confirm_steps=0),
        tmp_path / "out",
        launcher=launcher,
        echo=lambda _: None,
    )
    assert result.history[1].candidate.name == tuner  # the first move for input-bound
    assert result.pick is not None and result.pick.candidate.name.startswith(tuner)
    preset = (tmp_path / "conf" / "preset" / "tuned_tiny.yaml").read_text()
    assert "DataLoaderTuner" in preset  # the tuner stays, and the workers it found are pinned
    assert "  num_workers: 4" in preset and "  persistent_workers: true" in preset and "prefetch" not in preset


def test_the_command_line_refuses_bad_settings_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_accel.tune import main

    assert main(["--steps", "0"]) == 2
    assert "`--steps=0` must be >= 1" in capsys.readouterr().err
    assert main(["--name", "../evil", "--out", str(tmp_path / "out")]) == 2  # refused before the search runs
    assert "letters, digits and underscores" in capsys.readouterr().err
    assert not (tmp_path / "out" / "gen0").exists()


@pytest.mark.slow
def test_a_run_that_does_not_fit_is_tuned_to_one_that_does(tmp_path: Path) -> None:
    """The baseline runs out of memory; micro_batch=auto fits and becomes the pick (confirmed without a baseline)."""
    launcher, calls = world(
        {"baseline": 100.0, "micro_batch=auto": 90.0},
        oom=("baseline",),
        records={"micro_batch=auto": {"micro_batch": 8, "micro_batch_auto": True}},
    )
    result = tune(
        USER,
        Space(devices=1, compile=False),
        settings(tmp_path, per_generation=1),
        tmp_path / "out",
        launcher=launcher,
        echo=lambda _: None,
    )
    assert result.history[0].status == "failed"
    assert result.pick is not None and result.pick.candidate.name == "micro_batch=auto" and result.confirmed
    preset = (tmp_path / "conf" / "preset" / "tuned_tiny.yaml").read_text()
    assert "override /micro_batch: auto" in preset and "    micro_batch_size: 8" in preset


def test_the_confirmation_is_estimated_from_the_training_part_of_a_run() -> None:
    """3x the steps triples a run's training, not its start-up: at a quarter of a run training, the confirmation
    (baseline and pick, 2 rounds) costs 6 baseline-length runs, not 12."""
    from lightning_accel.autotune.autopilot import _over_budget

    tune_settings = TuneSettings(bench=BenchSettings(steps=40, repeats=2), time_budget_s=100)
    assert _over_budget(0.0, 3, 5.0, 1.0, tune_settings) == ""  # 30 s + 60 s
    assert "(~30 s) and the confirmation (~60 s)" in _over_budget(20.0, 3, 5.0, 1.0, tune_settings)
    assert _over_budget(20.0, 3, 5.0, 0.25, tune_settings) == ""  # 20 s + 30 s + 30 s
    assert _over_budget(100.0, 1, 0.0, 1.0, tune_settings) == "the time budget of 100 s is spent"
    assert (
        _over_budget(20.0, 3, 5.0, 1.0, TuneSettings(bench=tune_settings.bench, time_budget_s=100, confirm_steps=0))
        == ""
    )


@pytest.mark.slow  # ~20 s; the confirmation runs in the search test by default
def test_a_win_on_top_of_a_win_must_hold_up_against_its_parent_in_the_confirmation(tmp_path: Path) -> None:
    """amp wins; compile on top of amp clears it in the search's short runs but not in the longer confirmation run,
    where it is measured beside amp too: amp is the pick, and the report says why compile lost."""
    rates = {"baseline": 100.0, "precision=amp": 150.0, "compile=default+precision=amp": 170.0}
    launcher, calls = world(rates)
    confirm_ladders: list[str] = []

    def confirm_aware(command, stage_dir, timeout):
        if "confirm" in stage_dir.parts:
            rates["compile=default+precision=amp"] = 151.0  # the longer run: no gain over amp
            confirm_ladders.append(_candidate_of(command))
        return launcher(command, stage_dir, timeout)

    lines: list[str] = []
    result = tune(
        USER,
        Space(devices=1, compile=True),
        settings(tmp_path),
        tmp_path / "out",
        launcher=confirm_aware,
        echo=lines.append,
    )
    assert set(confirm_ladders) == {"baseline", "precision=amp", "compile=default+precision=amp"}
    assert result.pick is not None and result.pick.candidate.name == "precision=amp" and result.confirmed is True
    assert any("did not uphold compile=default+precision=amp" in line for line in lines)
    report = (tmp_path / "out" / "tune.md").read_text()
    assert "lost: not faster than precision=amp beyond the noise in the confirmation run" in report
    assert "the search's pick did not hold up, precision=amp stays" in report
    preset = (tmp_path / "conf" / "preset" / "tuned_tiny.yaml").read_text()
    assert "override /precision: amp" in preset and "compile" not in preset


@pytest.mark.slow  # ~15 s; Ctrl-C in the search runs by default
def test_ctrl_c_in_the_confirmation_keeps_the_searchs_pick_unconfirmed(tmp_path: Path) -> None:
    launcher, calls = world({"baseline": 100.0, "precision=amp": 150.0})

    def interrupt_confirmation(command, stage_dir, timeout):
        if "confirm" in stage_dir.parts:
            raise KeyboardInterrupt
        return launcher(command, stage_dir, timeout)

    result = tune(
        USER,
        Space(devices=1, compile=False),
        settings(tmp_path),
        tmp_path / "out",
        launcher=interrupt_confirmation,
        echo=lambda _: None,
    )
    assert result.interrupted and result.confirmed is None and "confirmation was interrupted" in result.stop_reason
    assert result.pick is not None and result.pick.candidate.name == "precision=amp"
    assert "override /precision: amp" in (tmp_path / "conf" / "preset" / "tuned_tiny.yaml").read_text()
    assert "confirmation: not run" in (tmp_path / "out" / "tune.md").read_text()


def test_a_row_measured_under_interference_cannot_win() -> None:
    """The bench row's interference flag reaches the outcome, and the report names it as the reason it lost."""
    from lightning_accel.autotune.autopilot import _verdict, outcome_of
    from lightning_accel.autotune.search import Candidate, incumbent
    from lightning_accel.benchmark.results import StageResult

    amp = Candidate((("precision", "amp"),))
    row = StageResult(
        name="cand1",
        samples_per_s=300.0,
        samples_interval={"low": 290.0, "high": 310.0},
        quality="pass",
        interference=True,
    )
    busy = outcome_of(amp, row)
    base = outcome_of(
        Candidate(), StageResult(name="as_is", samples_per_s=100.0, samples_interval={"low": 99.0, "high": 101.0})
    )
    assert busy.interference and incumbent([base, busy]) == base
    assert _verdict(busy, base, base, {}).startswith("lost: measured under interference")


@pytest.mark.slow
def test_on_a_busy_machine_nothing_wins_and_the_report_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Every run measured under interference (reruns included): amp's 1.5x does not decide, the baseline stays."""
    from test_bench import _ScriptedProbe

    monkeypatch.setattr("lightning_accel.benchmark.run._probe", _ScriptedProbe([True] * 1000))
    launcher, calls = world({"baseline": 100.0, "precision=amp": 150.0})
    lines: list[str] = []
    result = tune(
        USER,
        Space(devices=1, compile=False),
        settings(tmp_path),
        tmp_path / "out",
        launcher=launcher,
        echo=lines.append,
    )
    assert result.pick is not None and result.pick.candidate.name == "baseline"
    amp = next(o for o in result.history if o.candidate.name == "precision=amp")
    assert amp.interference and amp.samples_per_s is not None and amp.samples_per_s > 140
    report = (tmp_path / "out" / "tune.md").read_text()
    assert "Measured under interference" in report and "`precision=amp`" in report
    assert "lost: measured under interference" in report
    assert any("measured under interference" in line for line in lines)
