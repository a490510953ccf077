"""The end-of-run summary of accel-train: metrics, wall time, throughput and where the outputs went."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_accel.callbacks.run_stats import RunStats

__all__ = ["RunSummary", "collect_summary", "print_summary", "write_summary"]

# Reference figures a datamodule may expose, shown beside the metrics (the examples' text data has these).
_BASELINE_ATTRS = ("unigram_bpc", "uniform_bpc")


@dataclass(kw_only=True)
class RunSummary:
    """What accel-train reports at the end of a run (also written as summary.json in the run directory)."""

    metrics: dict[str, float] = field(default_factory=dict)
    """Final validation metrics and the test metrics."""
    baselines: dict[str, float] = field(default_factory=dict)
    """Reference figures of the data (e.g. the unigram entropy a language model must beat)."""
    wall_time_s: float = 0.0
    """From the start of the run (config composed) to the end of the test."""
    fit_time_s: float = 0.0
    """Training time, first to last training batch, validation included."""
    train_samples: int = 0
    """Training samples over all ranks."""
    samples_per_s: float = 0.0
    """train_samples / fit_time_s."""
    world_size: int = 1
    strategy: str = ""
    """The strategy family of the run shape (ddp, model_parallel, pipeline, ...)."""
    best_checkpoint: str | None = None
    tested_weights: str = "final"
    """"best" (the best checkpoint) or "final" (the weights at the end of the fit)."""
    run_dir: str = ""
    log_dirs: list[str] = field(default_factory=list)


def collect_summary(
    trainer: pl.Trainer,
    datamodule: Any,
    stats: RunStats,
    strategy_family: str,
    metrics: dict[str, float],
    wall_time_s: float,
    run_dir: str,
    tested_weights: str,
) -> RunSummary:
    baselines = {}
    for name in _BASELINE_ATTRS:
        value = getattr(datamodule, name, None)
        if isinstance(value, (int, float)) and math.isfinite(value):
            baselines[name] = float(value)
    samples = stats.samples
    checkpoint = trainer.checkpoint_callback
    return RunSummary(
        metrics=dict(metrics),
        baselines=baselines,
        wall_time_s=wall_time_s,
        fit_time_s=stats.fit_seconds,
        train_samples=samples,
        samples_per_s=samples / stats.fit_seconds if stats.fit_seconds > 0 else 0.0,
        world_size=trainer.world_size,
        strategy=strategy_family,
        best_checkpoint=(getattr(checkpoint, "best_model_path", "") or None),
        tested_weights=tested_weights,
        run_dir=run_dir,
        log_dirs=sorted({str(lg.log_dir) for lg in trainer.loggers if getattr(lg, "log_dir", None)}),
    )


def write_summary(summary: RunSummary, path: Path) -> None:
    path.write_text(json.dumps(asdict(summary), indent=2, sort_keys=True) + "\n")


def print_summary(summary: RunSummary) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="accel-train summary", show_header=True, header_style="bold")
    table.add_column("", style="cyan", no_wrap=True)
    table.add_column("value", overflow="fold")
    for key in sorted(summary.metrics):
        table.add_row(key, f"{summary.metrics[key]:.4f}")
    for key, value in sorted(summary.baselines.items()):
        table.add_row(f"baseline {key}", f"{value:.4f}")
    table.add_row("wall time", f"{summary.wall_time_s:.1f} s (fit {summary.fit_time_s:.1f} s)")
    table.add_row(
        "throughput",
        f"{summary.samples_per_s:,.1f} samples/s over {summary.world_size} process(es)"
        + (f" ({summary.strategy})" if summary.strategy not in ("", "auto", "single_device") else ""),
    )
    table.add_row("tested weights", summary.tested_weights)
    table.add_row("best checkpoint", summary.best_checkpoint or "-")
    for log_dir in summary.log_dirs:
        table.add_row("logs", log_dir)
    table.add_row("run directory", summary.run_dir)
    Console().print(table)
