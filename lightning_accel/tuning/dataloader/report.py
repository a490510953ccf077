"""The DataLoaderTuner's table of trials (plain text for logs, rich for the console) and its logged metrics."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning_accel.tuning.dataloader.decision import TunerDecision
from lightning_accel.tuning.dataloader.timing import Trial

__all__ = ["COLUMNS", "decision_metrics", "rich_table", "table_rows", "table_text"]

COLUMNS = ("workers", "prefetch", "pin", "samples/s", "data wait", "startup s", "steps", "interference", "note")


def table_rows(trials: Sequence[Trial], chosen: Trial | None) -> list[list[str]]:
    """One row of strings per trial: workers, prefetch, pin, samples/s, data wait, startup, steps, interference (yes
    when the trial was timed while another process took our CPUs: see `Trial.flag`), note."""
    rows = []
    for trial in trials:
        s = trial.settings
        measured = trial.status != "skipped"
        rows.append([
            str(s.num_workers), str(s.prefetch_factor or "-"), "yes" if s.pin_memory else "no",
            f"{trial.samples_per_s:,.1f}" if measured and trial.steps else "-",
            f"{100 * trial.wait_share:.0f}%" if measured and trial.steps else "-",
            f"{trial.startup_s:.2f}" if measured else "-", str(trial.steps), "yes" if trial.flag else "-",
            "chosen" if trial is chosen else (trial.note or trial.status),
        ])  # fmt: skip
    return rows


def table_text(rows: Sequence[Sequence[str]]) -> str:
    """The rows under `COLUMNS` as plain text, for logs."""
    return "\n".join("  ".join(f"{cell:>10}" for cell in row) for row in [COLUMNS, *rows])


def rich_table(rows: Sequence[Sequence[str]], title: str) -> Any:
    """The rows as a rich `Table`, the chosen one in bold green."""
    from rich.table import Table

    table = Table(*COLUMNS, title=title)
    for row in rows:
        table.add_row(*row, style="bold green" if row[-1] == "chosen" else None)
    return table


def decision_metrics(decision: TunerDecision, trials: Sequence[Trial], tuning_time_s: float, cache_hit: bool
                     ) -> dict[str, float]:  # fmt: skip
    """The `dataloader_tuner/...` metrics of a decision (see `DataLoaderTuner`'s docstring)."""
    settings = decision.settings
    metrics = {
        "num_workers": settings.num_workers, "prefetch_factor": settings.prefetch_factor or 0,
        "pin_memory": settings.pin_memory, "persistent_workers": settings.persistent_workers,
        "samples_per_s": decision.samples_per_s, "data_wait_share": decision.wait_share,
        "speedup": decision.speedup or math.nan, "tuning_time_s": tuning_time_s,
        "trials": sum(t.status != "skipped" for t in trials), "cache_hit": cache_hit,
    }  # fmt: skip
    return {f"dataloader_tuner/{key}": float(value) for key, value in metrics.items()}
