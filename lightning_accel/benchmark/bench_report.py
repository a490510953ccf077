"""The bench's outputs: the Markdown table (stdout and bench.md), bench.csv, bench.json and the bench.png bar chart."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning_accel.benchmark.results import StageResult, counted_runs
from lightning_accel.files import atomic_path, atomic_write

__all__ = [
    "CSV_COLUMNS",
    "JSON_SCHEMA_VERSION",
    "markdown_table",
    "plot",
    "speedup_cell",
    "to_json",
    "write_outputs",
]

JSON_SCHEMA_VERSION = 2
"""`schema_version` of bench.json; raised when a key changes meaning or goes away. 2: every stage has `runs` (one
per round and rerun, each with its `interference`), and `time_interval`, `speedup_interval`, `samples_interval`,
`metric_interval` (`{median, low, high, n, method}`), `speedup_verdict`, `interference`, `energy_j`,
`energy_j_per_sample`, `energy_note`, `quality_noise`, `reference_steps`; `time_s`, `speedup`, `samples_per_s` and
`metric_value` are medians over the counted runs."""

CSV_COLUMNS = (
    "stage",
    "status",
    "reason",
    "changes",
    "world_size",
    "steps",
    "reference_steps",
    "runs",
    "time_s",
    "time_low",
    "time_high",
    "speedup",
    "speedup_low",
    "speedup_high",
    "speedup_verdict",
    "samples_per_s",
    "samples_per_s_low",
    "samples_per_s_high",
    "tokens_per_s",
    "time_to_target_s",
    "peak_memory_bytes",
    "micro_batch",
    "micro_batch_auto",
    "micro_batch_recoveries",
    "energy_j",
    "energy_j_per_sample",
    "energy_note",
    "mfu",
    "gpu_utilization_pct",
    "metric_value",
    "metric_low",
    "metric_high",
    "quality",
    "quality_delta_pct",
    "quality_noise",
    "interference",
    "interference_note",
    "bottleneck",
    "next_step",
    "data_share",
    "forward_share",
    "backward_share",
    "optimizer_share",
    "communication_share",
    "process_s",
    "device",
    "dtype",
)


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 120:
        return f"{value:.1f} s"
    if value < 7200:
        return f"{value / 60:.1f} min"
    return f"{value / 3600:.2f} h"


def _number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:,.{digits}f}"


def _bytes(value: int | None) -> str:
    return "-" if not value else f"{value / 2**30:.2f} GiB"


def _interval(interval: dict[str, Any] | None, spec: str, unit: str = "") -> str:
    """` [low, high]` after a median, or "" for a single value."""
    if not interval or interval.get("n", 0) < 2:
        return ""
    return f" [{interval['low']:{spec}}, {interval['high']:{spec}}]{unit}"


def _time_cell(r: StageResult) -> str:
    """`12.3 s [11.9, 12.8]`: the median, then the interval in the median's unit."""
    interval = r.time_interval
    if r.time_s is None or not interval or interval.get("n", 0) < 2:
        return _seconds(r.time_s)
    text = _seconds(r.time_s)
    unit = text.split()[-1]
    scale = {"s": 1.0, "min": 60.0, "h": 3600.0}[unit]
    digits = 2 if unit == "h" else 1
    return f"{text} [{interval['low'] / scale:.{digits}f}, {interval['high'] / scale:.{digits}f}]"


def speedup_cell(r: StageResult) -> str:
    """`1.43x [1.38, 1.50]`; "no clear difference" (with the interval) when it holds 1.0; a flag under interference."""
    if r.speedup is None:
        return "-"
    if not r.speedup_verdict:  # the reference
        return "1.00x (reference)" + (" (interference)" if r.interference else "")
    interval = _interval(r.speedup_interval, ".2f", "x")
    if r.speedup_verdict == "no clear difference":
        text = f"no clear difference{interval}"
    else:
        text = f"{r.speedup:.2f}x{interval}"
    return text + (" (interference)" if r.interference else "")


def markdown_table(results: Sequence[StageResult], metric: str, tolerance: float, target: float | None) -> str:
    """The article's table (stage, what it changes, time, speedup over the baseline) and the measured columns: each
    figure a median over the stage's counted runs with its interval in brackets."""
    reach = "time to target" if target is None else f"time to {metric}={target:g}"
    header = [
        "stage",
        "what it changes",
        "runs",
        "time",
        "speedup",
        "samples/s",
        "tokens/s",
        reach,
        "peak mem",
        "micro-batch",
        "energy",
        "MFU",
        "GPU util",
        metric,
        f"quality (±{tolerance:.0%} or noise)",
        "interference",
        "bottleneck",
        "next to try",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in results:
        if r.status != "ok":
            cells = [r.name, r.changes, str(len(r.runs) or "-"), f"{r.status}: {r.reason}"]
            cells += ["-"] * (len(header) - len(cells))
        else:
            quality = r.quality if r.quality_delta_pct is None else f"{r.quality} ({r.quality_delta_pct:+.1f}%)"
            if r.reference_steps is not None:
                quality += f"; steps {r.steps} vs {r.reference_steps}"
            mfu = "n/a" if r.mfu is None else f"{100 * r.mfu:.1f}%"
            reached = _seconds(r.time_to_target_s) if target is not None else "-"
            if target is not None and r.time_to_target_s is None:
                reached = "not reached"
            energy = f"n/a ({r.energy_note or 'not measured'})" if r.energy_j is None else f"{r.energy_j / 3600:.3g} Wh"
            if r.energy_j_per_sample is not None:
                energy += f" ({r.energy_j_per_sample:.3g} J/sample)"
            counted = len(counted_runs(r)[0])
            cells = [
                r.name,
                r.changes,
                str(counted),
                _time_cell(r),
                speedup_cell(r),
                _number(r.samples_per_s) + _interval(r.samples_interval, ",.0f"),
                _number(r.tokens_per_s),
                reached,
                _bytes(r.peak_memory_bytes),
                _micro_batch_cell(r),
                energy,
                mfu,
                "n/a" if r.gpu_utilization_pct is None else f"{r.gpu_utilization_pct:.0f}%",
                _number(r.metric_value, 4) + _interval(r.metric_interval, ".4f"),
                quality,
                ("FLAGGED: " if r.interference else "") + (r.interference_note or "quiet"),
                f"{r.bottleneck} ({r.bottleneck_why})",
                r.next_step,
            ]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def _micro_batch_cell(r: StageResult) -> str:
    """`32`, or `4 (auto)` / `2 (auto, 1 OOM recovery)` when MicroBatchFinder chose it; `-` when unknown."""
    if r.micro_batch is None:
        return "-"
    if not r.micro_batch_auto:
        return str(r.micro_batch)
    n = r.micro_batch_recoveries
    return f"{r.micro_batch} (auto" + (f", {n} OOM recover{'y' if n == 1 else 'ies'})" if n else ")")


def _csv_row(r: StageResult) -> dict[str, Any]:
    row = {key: getattr(r, key, None) for key in CSV_COLUMNS if hasattr(r, key)}
    row["stage"] = r.name
    row["runs"] = len(counted_runs(r)[0])
    for prefix, interval in (
        ("time", r.time_interval),
        ("speedup", r.speedup_interval),
        ("samples_per_s", r.samples_interval),
        ("metric", r.metric_interval),
    ):
        row[f"{prefix}_low"] = interval.get("low") if interval else None
        row[f"{prefix}_high"] = interval.get("high") if interval else None
    for key in ("data", "forward", "backward", "optimizer", "communication"):
        row[f"{key}_share"] = r.split.get(key)
    return {key: ("" if row.get(key) is None else row[key]) for key in CSV_COLUMNS}


def to_json(results: Sequence[StageResult], header: dict[str, Any]) -> dict[str, Any]:
    """bench.json: `schema_version`, the run's header (machine, settings, reference, totals) and every stage."""
    return {"schema_version": JSON_SCHEMA_VERSION, **header, "stages": [asdict(r) for r in results]}


def plot(results: Sequence[StageResult], path: Path, title: str, by: str = "time") -> str | None:
    """Draw each stage's median time (`by="time"`; samples/s when the stages trained different amounts) as a bar with
    its interval as an error bar, labelled with its speedup (orange:
    measured under interference, red: quality FAIL); returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'lightning_accel[plot]'): bench.png not written"
    names = [r.name for r in results]
    value, spread = ("time_s", "time_interval") if by == "time" else ("samples_per_s", "samples_interval")
    times = [getattr(r, value) if r.status == "ok" and getattr(r, value) else 0.0 for r in results]
    intervals = [getattr(r, spread) or {} for r in results]
    errors = [
        [t - i.get("low", t) for t, i in zip(times, intervals, strict=True)],
        [i.get("high", t) - t for t, i in zip(times, intervals, strict=True)],
    ]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.8 * len(results)), 3.8))
    colors = ["tab:red" if r.quality == "FAIL" else "tab:orange" if r.interference else "tab:blue" for r in results]
    bars = ax.bar(names, times, color=colors, yerr=errors, capsize=4, ecolor="black")
    for bar, r, high in zip(bars, results, errors[1], strict=True):
        label = r.status if r.speedup is None else speedup_cell(r).replace(" [", "\n[").replace(" (", "\n(")
        if r.quality == "FAIL":
            label += "\nquality FAIL"
        ax.annotate(
            label,
            (bar.get_x() + bar.get_width() / 2, bar.get_height() + high),
            ha="center",
            va="bottom",
            fontsize=9,
            xytext=(0, 2),
            textcoords="offset points",
        )
    ax.set_ylabel("training time (s), median [range]" if by == "time" else "samples/s, median [range]")
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)
    return None


def write_outputs(
    results: Sequence[StageResult], out_dir: Path, header: dict[str, Any], table: str, title: str
) -> tuple[list[Path], str | None]:
    """Write bench.md, bench.csv, bench.json and bench.png into `out_dir`, each whole or not at all (written beside
    its target, then renamed: a full disk leaves the earlier file, never a truncated one); returns the files and a
    note (no PNG).

    Raises:
        OSError: of the first file that could not be written; the ones before it are written.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = io.StringIO(newline="")
    writer = csv.DictWriter(rows, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    writer.writerows(_csv_row(r) for r in results)
    files = [
        atomic_write(out_dir / "bench.md", f"# {title}\n\n{table}\n"),
        atomic_write(out_dir / "bench.csv", rows.getvalue()),
        atomic_write(out_dir / "bench.json", json.dumps(to_json(results, header), indent=2, default=str) + "\n"),
    ]
    by = header.get("settings", {}).get("speedup_by", "time")
    note: str | None = None
    with contextlib.suppress(_NotDrawn), atomic_path(out_dir / "bench.png") as tmp:
        note = plot(results, tmp, title, by=by)
        if note is not None:
            raise _NotDrawn  # the temporary file is removed; an earlier bench.png stays
    if note is None:
        files.append(out_dir / "bench.png")
    return files, note


class _NotDrawn(Exception):
    """Raised inside `atomic_path` to drop a picture that could not be drawn."""
