"""The bench's outputs: the Markdown table (stdout and bench.md), bench.csv, bench.json and the bench.png bar chart."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning_accel.benchmark.results import StageResult

__all__ = ["CSV_COLUMNS", "JSON_SCHEMA_VERSION", "markdown_table", "plot", "to_json", "write_outputs"]

JSON_SCHEMA_VERSION = 1
"""`schema_version` of bench.json; raised when a key changes meaning or goes away."""

CSV_COLUMNS = (
    "stage", "status", "reason", "changes", "world_size", "steps", "time_s", "speedup", "samples_per_s",
    "tokens_per_s", "time_to_target_s", "peak_memory_bytes", "mfu", "gpu_utilization_pct", "metric_value",
    "quality", "quality_delta_pct", "bottleneck", "next_step", "data_share", "forward_share", "backward_share",
    "optimizer_share", "communication_share", "process_s", "device", "dtype",
)  # fmt: skip


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


def markdown_table(results: Sequence[StageResult], metric: str, tolerance: float, target: float | None) -> str:
    """The article's table (stage, what it changes, time, speedup over the baseline) and the measured columns."""
    reach = "time to target" if target is None else f"time to {metric}={target:g}"
    header = ["stage", "what it changes", "time", "speedup", "samples/s", "tokens/s", reach, "peak mem", "MFU",
              "GPU util", metric, f"quality (±{tolerance:.0%})", "bottleneck", "next to try"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in results:
        if r.status != "ok":
            cells = [r.name, r.changes, f"{r.status}: {r.reason}"] + ["-"] * (len(header) - 3)
        else:
            quality = r.quality if r.quality_delta_pct is None else f"{r.quality} ({r.quality_delta_pct:+.1f}%)"
            mfu = "n/a" if r.mfu is None else f"{100 * r.mfu:.1f}%"
            reached = _seconds(r.time_to_target_s) if target is not None else "-"
            if target is not None and r.time_to_target_s is None:
                reached = "not reached"
            cells = [
                r.name, r.changes, _seconds(r.time_s), "-" if r.speedup is None else f"{r.speedup:.2f}x",
                _number(r.samples_per_s), _number(r.tokens_per_s), reached, _bytes(r.peak_memory_bytes), mfu,
                "n/a" if r.gpu_utilization_pct is None else f"{r.gpu_utilization_pct:.0f}%",
                _number(r.metric_value, 4), quality, f"{r.bottleneck} ({r.bottleneck_why})", r.next_step,
            ]  # fmt: skip
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def _csv_row(r: StageResult) -> dict[str, Any]:
    row = {key: getattr(r, key, None) for key in CSV_COLUMNS if hasattr(r, key)}
    row["stage"] = r.name
    for key in ("data", "forward", "backward", "optimizer", "communication"):
        row[f"{key}_share"] = r.split.get(key)
    return {key: ("" if row.get(key) is None else row[key]) for key in CSV_COLUMNS}


def to_json(results: Sequence[StageResult], header: dict[str, Any]) -> dict[str, Any]:
    """bench.json: `schema_version`, the run's header (machine, settings, reference, totals) and every stage."""
    return {"schema_version": JSON_SCHEMA_VERSION, **header, "stages": [asdict(r) for r in results]}


def plot(results: Sequence[StageResult], path: Path, title: str) -> str | None:
    """Draw the time of each stage as a bar labelled with its speedup; returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'lightning_accel[plot]'): bench.png not written"
    names = [r.name for r in results]
    times = [r.time_s if r.status == "ok" and r.time_s else 0.0 for r in results]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(results)), 3.6))
    colors = ["tab:red" if r.quality == "FAIL" else "tab:blue" for r in results]
    bars = ax.bar(names, times, color=colors)
    for bar, r in zip(bars, results, strict=True):
        label = f"{r.speedup:.2f}x" if r.speedup is not None else r.status
        if r.quality == "FAIL":
            label += "\nquality FAIL"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=9, xytext=(0, 2), textcoords="offset points")  # fmt: skip
    ax.set_ylabel("training time (s)")
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def write_outputs(
    results: Sequence[StageResult], out_dir: Path, header: dict[str, Any], table: str, title: str
) -> tuple[list[Path], str | None]:
    """Write bench.md, bench.csv, bench.json and bench.png into `out_dir`; returns the files and a note (no PNG)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / "bench.md", out_dir / "bench.csv", out_dir / "bench.json"]
    files[0].write_text(f"# {title}\n\n{table}\n")
    with files[1].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(_csv_row(r) for r in results)
    files[2].write_text(json.dumps(to_json(results, header), indent=2, default=str) + "\n")
    note = plot(results, out_dir / "bench.png", title)
    if note is None:
        files.append(out_dir / "bench.png")
    return files, note
