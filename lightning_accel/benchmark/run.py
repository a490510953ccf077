"""Run a whole ladder: plan every stage, run each in turn, derive the table's columns and write the outputs."""

from __future__ import annotations

import datetime as dt
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_accel.benchmark.ladder import BenchSettings, Launcher, describe_changes, launch, plan_stages, run_stage
from lightning_accel.benchmark.report import markdown_table, write_outputs
from lightning_accel.benchmark.results import StageResult, finalize

__all__ = ["BenchRun", "run_bench"]


@dataclass(kw_only=True)
class BenchRun:
    """What `run_bench` returns: the rows, the table, the files written and the total wall time."""

    results: list[StageResult]
    table: str
    files: list[Path] = field(default_factory=list)
    note: str | None = None
    total_s: float = 0.0
    header: dict[str, Any] = field(default_factory=dict)


def _machine() -> dict[str, Any]:
    import lightning
    import torch

    from lightning_accel.benchmark.ladder import _effective_cpus

    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows
        load = None
    return {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "lightning": lightning.__version__, "cpus": _effective_cpus(),
            "load_average_1m": load}  # fmt: skip


def busy_note(machine: dict[str, Any]) -> str | None:
    """A warning when other processes kept the CPUs busy as the bench began: the times then measure contention too."""
    load, cpus = machine.get("load_average_1m"), machine.get("cpus") or 1
    if load is None or load <= cpus:
        return None
    return (
        f"the machine was busy (1-minute load average {load:.1f} on {cpus} CPU(s)): times are noisy, and torch's "
        "intra-op threads contend with the other processes (OMP_NUM_THREADS=1 shows how much)"
    )


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
) -> BenchRun:
    """Plan every stage (a bad setting raises before any runs), run them in order, then write the outputs.

    Raises:
        ConfigError: for an unknown stage or overrides that do not compose, before any stage runs.
    """
    started = time.perf_counter()
    machine = _machine()  # before any stage: the load average is the others' load, not ours
    plans = plan_stages(ladder, overrides, settings, out_dir)
    changes = describe_changes(plans)
    results = []
    for index, plan in enumerate(plans):
        stage_dir = out_dir / "stages" / f"{index}-{plan.name}"
        if plan.status == "ok":
            echo(f"accel-bench: stage {index + 1}/{len(plans)} `{plan.name}`: {changes[plan.name]} ({plan.steps} "
                 f"steps)" if plan.steps else f"accel-bench: stage {index + 1}/{len(plans)} `{plan.name}`")  # fmt: skip
        result = run_stage(plan, stage_dir, changes[plan.name], settings.stage_timeout_s, launcher)
        if result.status != "ok":
            echo(f"accel-bench: stage `{plan.name}` {result.status}: {result.reason}")
        else:
            echo(f"accel-bench: stage `{plan.name}` done in {result.process_s:.1f} s")
        results.append(result)
    settings_by_stage = {p.name: {"num_workers": p.num_workers, "precision": p.precision, "accumulate": p.accumulate,
                                  "family": p.family} for p in plans}  # fmt: skip
    reference = finalize(results, mode=settings.mode, tolerance=settings.tolerance, peak_tflops=peak_tflops,
                         settings=settings_by_stage)  # fmt: skip
    table = markdown_table(results, settings.metric, settings.tolerance, settings.target)
    total_s = time.perf_counter() - started
    created = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    device = next((r.device for r in results if r.device), "")
    title = (f"accel-bench {created}: {device or 'no stage ran'}, torch {machine['torch']}, lightning "
             f"{machine['lightning']}")  # fmt: skip
    header = {
        "created": created,
        "command": list(argv) or sys.argv,
        "machine": machine,
        "settings": {
            "ladder": list(ladder),
            "overrides": list(overrides),
            **asdict(settings),
            "peak_tflops": peak_tflops,
        },  # fmt: skip
        "reference": reference.name if reference else None,
        "total_s": total_s,
    }
    files, note = write_outputs(results, out_dir, header, table, title)
    footer = (f"Speedup over `{reference.name}`" if reference else "No stage ran") + f"; total {total_s:.1f} s."
    echo(f"\n{title}\n\n{table}\n\n{footer}")
    for line in (note, busy_note(machine)):
        if line:
            echo(f"accel-bench: note: {line}")
    echo(f"accel-bench: wrote {', '.join(str(f) for f in files)}")
    return BenchRun(results=results, table=table, files=files, note=note, total_s=total_s, header=header)
