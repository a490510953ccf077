"""The DataLoaderTuner's report: the table of trials (plain text for logs, rich for the console), the line that
states the decision, and its logged metrics."""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from lightning_accel.tuning.dataloader.decision import TunerDecision
from lightning_accel.tuning.dataloader.loader_settings import LoaderSettings
from lightning_accel.tuning.dataloader.policy import medians
from lightning_accel.tuning.dataloader.timing import Trial

__all__ = [
    "COLUMNS",
    "decision_line",
    "decision_metrics",
    "publish",
    "rich_table",
    "shown_on_a_stream",
    "speedup_text",
    "table_rows",
    "table_text",
]

COLUMNS = ("workers", "prefetch", "pin", "samples/s", "data wait", "startup s", "steps", "interference", "note")


def table_rows(trials: Sequence[Trial], chosen: Trial | None) -> list[list[str]]:
    """One row of strings per trial: workers, prefetch, pin, samples/s, data wait, startup, steps, interference (yes
    when the trial was timed while another process took our CPUs: see `Trial.flag`), note."""
    rows = []
    for trial in trials:
        s = trial.settings
        measured = trial.status != "skipped"
        rows.append(
            [
                str(s.num_workers),
                str(s.prefetch_factor or "-"),
                "yes" if s.pin_memory else "no",
                f"{trial.samples_per_s:,.1f}" if measured and trial.steps else "-",
                f"{100 * trial.wait_share:.0f}%" if measured and trial.steps else "-",
                f"{trial.startup_s:.2f}" if measured else "-",
                str(trial.steps),
                "yes" if trial.flag else "-",
                "chosen" if trial is chosen else (trial.note or trial.status),
            ]
        )
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


def decision_metrics(
    decision: TunerDecision, trials: Sequence[Trial], tuning_time_s: float, cache_hit: bool
) -> dict[str, float]:
    """The `dataloader_tuner/...` metrics of a decision (see `DataLoaderTuner`'s docstring)."""
    settings = decision.settings
    metrics = {
        "num_workers": settings.num_workers,
        "prefetch_factor": settings.prefetch_factor or 0,
        "pin_memory": settings.pin_memory,
        "persistent_workers": settings.persistent_workers,
        "samples_per_s": decision.samples_per_s,
        "data_wait_share": decision.wait_share,
        "speedup": decision.speedup or math.nan,
        "speedup_bound": decision.bound or math.nan,
        "kept": decision.kept,
        "tuning_time_s": tuning_time_s,
        "trials": sum(t.status != "skipped" for t in trials),
        "cache_hit": cache_hit,
    }
    return {f"dataloader_tuner/{key}": float(value) for key, value in metrics.items()}


def speedup_text(result: TunerDecision) -> str:
    """The speedup a decision claims over the loader's own settings, with its interval and the bound their data wait
    sets (`decision.LoaderBound`); a measured speedup above the bound is named as noise, not credited."""
    if result.speedup is None:
        return "the loader's own settings were not timed"
    low, high = result.speedup_low or result.speedup, result.speedup_high or result.speedup
    text = f"{result.speedup:.2f}x [{low:.2f}, {high:.2f}] the loader's own settings"
    if result.baseline is None:
        return text
    measured = result.measured_speedup
    if measured is not None and measured > result.baseline.high * (1 + 1e-9):
        return (
            f"{text}: the most their data wait allows ({result.baseline.describe()}); measured {measured:.2f}x, the "
            "excess is noise or interference, not credited"
        )
    return f"{text}; they spent {result.baseline.describe()}"


def decision_line(result: TunerDecision, original: LoaderSettings, source: str) -> str:
    """One line: where the decision came from (`source`, and why it is not cached), what changed from the loader's
    own settings `original` or that they were kept and why, the throughput measured with it and the speedup it
    claims (`speedup_text`)."""
    if not result.confident:
        source += f"; not cached: {result.note}"
    rate = f"{result.samples_per_s:,.1f} samples/s per rank"
    if result.kept:
        return f"DataLoaderTuner ({source}): kept your settings: {result.reason}; {rate}."
    changed = (
        ", ".join(
            f"{k} {getattr(original, k)} -> {v}"
            for k, v in result.settings.as_dict().items()
            if getattr(original, k) != v
        )
        or "no change"
    )
    why = f"; {result.reason}" if result.reason else ""
    return f"DataLoaderTuner ({source}): {changed}{why}; {rate} ({speedup_text(result)})."


def publish(
    result: TunerDecision,
    original: LoaderSettings,
    trials: Sequence[Trial],
    *,
    tuning_time_s: float,
    cache_hit: bool,
    step_mode: str,
    print_table: bool,
    loggers: Iterable[Any],
    step: int,
    log: logging.Logger,
) -> None:
    """Report a decision on rank zero, once: the table of `trials` and the decision line at INFO on `log` (the run's
    log file and console under Hydra); with `print_table`, also with rich on the console where no logging handler
    shows `log`'s INFO on a terminal stream (a plain script), so the table never appears twice. The
    `dataloader_tuner/...` metrics go to every logger of `loggers`."""
    chosen = next((t for t in medians(trials) if t.settings.cost == result.settings.cost), None)
    rows = table_rows(trials, chosen)
    source = "cache" if cache_hit else f"{len(trials)} trials in {tuning_time_s:.1f} s"
    line = decision_line(result, original, source)
    title = f"DataLoaderTuner: train DataLoader settings timed on {step_mode} steps, per rank"
    if rows:
        log.info("%s\n%s", title, table_text(rows))
    log.info(line)  # into the run's log file (accel-train) and wherever the application sends logging
    if print_table and not shown_on_a_stream(log):
        from rich.console import Console

        console = Console()  # colours only on a terminal: a redirected stdout gets plain text
        if rows:
            console.print(rich_table(rows, title))
        console.print(line, highlight=False)
    metrics = decision_metrics(result, trials, tuning_time_s, cache_hit)
    for logger in loggers:
        logger.log_metrics(metrics, step=step)


def shown_on_a_stream(log: logging.Logger) -> bool:
    """Whether `log`'s INFO records reach a console stream (stdout or stderr) through a handler of it or of a parent
    it propagates to: Hydra's job logging, Lightning's own handler on its loggers. A file handler does not count."""
    if not log.isEnabledFor(logging.INFO):
        return False
    logger: logging.Logger | None = log
    while logger is not None:
        for handler in logger.handlers:
            stream = getattr(handler, "stream", None)
            if (
                not isinstance(handler, logging.FileHandler)
                and stream in (sys.stdout, sys.stderr)
                and handler.level <= logging.INFO
            ):
                return True
        logger = logger.parent if logger.propagate else None
    return False
