"""Run a whole ladder: plan every stage, run them round by round (each run under an interference probe, a flagged
run again up to a bound), derive the table's columns and write the outputs."""

from __future__ import annotations

import datetime as dt
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning_accel.benchmark.bench_report import markdown_table, write_outputs
from lightning_accel.benchmark.process import Launcher, launch, run_once
from lightning_accel.benchmark.results import StageResult, StageRun, finalize
from lightning_accel.benchmark.stage_plan import BenchSettings, StagePlan, describe_changes, plan_stages
from lightning_accel.errors import describe_os_error
from lightning_accel.files import remove_stale_temporaries
from lightning_accel.system.interference import InterferenceProbe, nvml_compute_pids

__all__ = ["BenchRun", "busy_note", "run_bench"]


@dataclass(kw_only=True)
class BenchRun:
    """What `run_bench` returns: the rows, the table, the files written and the total wall time."""

    results: list[StageResult]
    table: str
    files: list[Path] = field(default_factory=list)
    note: str | None = None
    total_s: float = 0.0
    header: dict[str, Any] = field(default_factory=dict)
    interrupted: bool = False
    """Ctrl-C or SIGTERM stopped the bench: the outputs hold the runs that finished."""
    write_error: str = ""
    """Why the report files could not be written (a full disk), or empty."""


def _machine() -> dict[str, Any]:
    import lightning
    import torch

    from lightning_accel.system import read_cpu_budget

    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows
        load = None
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cpus": max(1, read_cpu_budget().effective),
        "load_average_1m": load,
    }


def busy_note(machine: dict[str, Any]) -> str | None:
    """A warning when other processes kept the CPUs busy as the bench began: the times then measure contention too."""
    load, cpus = machine.get("load_average_1m"), machine.get("cpus") or 1
    if load is None or load <= cpus:
        return None
    return (
        f"the machine was busy (1-minute load average {load:.1f} on {cpus} CPU(s)): times are noisy, and torch's "
        "intra-op threads contend with the other processes (OMP_NUM_THREADS=1 shows how much)"
    )


def _probe(settings: BenchSettings, on_cuda: bool) -> InterferenceProbe:
    return InterferenceProbe(threshold=settings.interference_threshold, gpu_pids=nvml_compute_pids if on_cuda else None)


def _run(
    plan: StagePlan,
    index: int,
    round_index: int,
    seed: int | None,
    out_dir: Path,
    settings: BenchSettings,
    launcher: Launcher,
    attempt: int = 0,
) -> StageRun:
    suffix = f"-rerun{attempt}" if attempt else ""
    run_dir = out_dir / "stages" / f"{index}-{plan.name}" / f"run{round_index}{suffix}"
    return run_once(
        plan.command(run_dir, seed),
        run_dir,
        round_index=round_index,
        seed=seed,
        timeout=settings.stage_timeout_s,
        launcher=launcher,
        probe=_probe(settings, plan.on_cuda),
    )


def _run_schedule(
    schedule: list[tuple[int, int]],
    plans: list[StagePlan],
    results: list[StageResult],
    seed: int | None,
    changes: dict[str, str],
    reruns_left: dict[int, int],
    out_dir: Path,
    settings: BenchSettings,
    launcher: Launcher,
    echo: Callable[[str], None],
) -> None:
    """Run every (round, stage) of `schedule` in order, rerunning a flagged run while `reruns_left` allows."""
    for position, (round_index, index) in enumerate(schedule):
        plan, result = plans[index], results[index]
        run_seed = None if seed is None else seed + round_index
        echo(
            f"accel-bench: run {position + 1}/{len(schedule)}: `{plan.name}` round {round_index + 1} "
            f"(seed {run_seed}): {changes[plan.name]}" + (f", {plan.steps} steps" if plan.steps else "")
        )
        run = _run(plan, index, round_index, run_seed, out_dir, settings, launcher)
        result.runs.append(run)
        while run.status == "ok" and run.flagged and reruns_left[index] > 0:
            reruns_left[index] -= 1
            reasons = "; ".join((run.interference or {}).get("reasons") or [])
            echo(f"accel-bench: `{plan.name}` round {round_index + 1} ran under interference ({reasons}): again")
            rerun = _run(
                plan,
                index,
                round_index,
                run_seed,
                out_dir,
                settings,
                launcher,
                attempt=settings.max_reruns - reruns_left[index],
            )
            result.runs.append(rerun)
            if rerun.status != "ok":  # the flagged run stays the round's measurement
                echo(f"accel-bench: the rerun of `{plan.name}` failed ({rerun.reason}); its flagged run counts")
                break
            run.replaced, run = True, rerun
        if run.status != "ok":
            echo(f"accel-bench: `{plan.name}` round {round_index + 1} failed: {run.reason}")
        else:
            flag = " (under interference)" if run.flagged else ""
            echo(f"accel-bench: `{plan.name}` round {round_index + 1} done in {run.process_s:.1f} s{flag}")


def run_bench(
    ladder: Sequence[str],
    overrides: Sequence[str],
    settings: BenchSettings,
    out_dir: Path,
    *,
    peak_tflops: float | None = None,
    launcher: Launcher = launch,
    echo: Callable[[str], None] = print,
    argv: Sequence[str] = (),
    stage_extra: Mapping[str, Sequence[str]] | None = None,
) -> BenchRun:
    """Plan every stage (a bad setting raises before any runs), run them round by round, then write the outputs.

    Round k runs every stage once from seed `seed + k` (the same seed for every stage of a round, so the rounds pair
    up), in ladder order on even rounds and in reverse on odd ones (A B C, C B A, ...): a stage's place in the round
    (caches warmed by the one before, the machine heating up, a neighbour's leftover processes) then favours no
    stage over two rounds; in one order, two identical stages measured 11% apart. A run that the interference probe
    flags is run again at once, up to `settings.max_reruns` times per stage; the rerun replaces it when it is quiet,
    and a flagged stage is shown as such. With `repeats=1` the reference stage runs a second time from the next seed,
    for the metric's noise. `stage_extra` adds overrides per stage after the user's (see `plan_stages`).

    Raises:
        ConfigError: for an unknown stage or overrides that do not compose, before any stage runs.
    """
    started = time.perf_counter()
    remove_stale_temporaries(out_dir)  # what a killed earlier bench left half-written here
    machine = _machine()  # before any stage: the load average is the others' load, not ours
    plans, seed = plan_stages(ladder, overrides, settings, out_dir, stage_extra=stage_extra)
    changes = describe_changes(plans)
    results = [
        StageResult(
            name=p.name,
            changes=changes[p.name],
            status=p.status,
            reason=p.reason,
            overrides=[*p.overrides, *p.extra],
            world_size=p.world_size,
            steps=p.steps,
        )
        for p in plans
    ]
    runnable = [i for i, p in enumerate(plans) if p.status == "ok"]
    orders = [runnable if k % 2 == 0 else runnable[::-1] for k in range(settings.repeats)]  # A B C, C B A, ...
    schedule = [(k, i) for k, order in enumerate(orders) for i in order]
    if settings.repeats == 1 and runnable:  # a second seed of the reference: its own noise, for the quality verdict
        schedule.append((1, runnable[0]))
    reruns_left = {i: settings.max_reruns for i in runnable}
    interrupted = False
    try:
        _run_schedule(schedule, plans, results, seed, changes, reruns_left, out_dir, settings, launcher, echo)
    except KeyboardInterrupt:  # the running stage's processes are ended by `launch`; keep what finished
        interrupted = True
        echo("accel-bench: interrupted; writing the runs that finished")
        for result in results:
            if result.status == "ok" and not any(r.status == "ok" for r in result.runs):
                result.status, result.reason = "skipped", "not run: accel-bench was interrupted"
    settings_by_stage = {
        p.name: {"num_workers": p.num_workers, "precision": p.precision, "accumulate": p.accumulate, "family": p.family}
        for p in plans
    }
    by: Literal["time", "throughput"] = (
        "time" if settings.match == "samples" and settings.time_budget_s is None else "throughput"
    )
    reference = finalize(
        results,
        mode=settings.mode,
        tolerance=settings.tolerance,
        peak_tflops=peak_tflops,
        settings=settings_by_stage,
        speedup_by=by,
    )
    table = markdown_table(results, settings.metric, settings.tolerance, settings.target)
    total_s = time.perf_counter() - started
    created = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    device = next((r.device for r in results if r.device), "")
    title = (
        f"accel-bench {created}: {device or 'no stage ran'}, torch {machine['torch']}, lightning {machine['lightning']}"
    )
    header = {
        "created": created,
        "command": list(argv) or sys.argv,
        "machine": machine,
        "settings": {
            "ladder": list(ladder),
            "overrides": list(overrides),
            **asdict(settings),
            "peak_tflops": peak_tflops,
            "first_seed": seed,
            "speedup_by": by,
        },
        "reference": reference.name if reference else None,
        "total_s": total_s,
        "interrupted": interrupted,
    }
    footer = (
        f"Speedup over `{reference.name}`" if reference else "No stage ran"
    ) + f"; {settings.repeats} round(s), medians [interval]; total {total_s:.1f} s."
    echo(f"\n{title}\n\n{table}\n\n{footer}")  # first: a report that cannot be written still shows the table
    try:
        files, note = write_outputs(results, out_dir, header, table, title)
        write_error = ""
    except OSError as err:  # a full disk: each file is whole or absent, never truncated
        files, note = [p for p in (out_dir / f"bench.{x}" for x in ("md", "csv", "json", "png")) if p.is_file()], None
        write_error = f"the report could not be written: {describe_os_error(err)}; the table above is it"
        echo(f"accel-bench: error: {write_error}")
    flagged = [r.name for r in results if r.interference]
    lines = [note, busy_note(machine)]
    if flagged:
        lines.append(
            f"measured under interference: {', '.join(flagged)}. Their figures may not hold on a quiet "
            "machine; run again when it is quiet (see the `interference` column)."
        )
    for line in lines:
        if line:
            echo(f"accel-bench: note: {line}")
    echo(f"accel-bench: wrote {', '.join(str(f) for f in files)}")
    return BenchRun(
        results=results,
        table=table,
        files=files,
        note=note,
        total_s=total_s,
        header=header,
        interrupted=interrupted,
        write_error=write_error,
    )
