"""The end-of-run GPU report: per-GPU totals, curves, rank timing and alerts; a rich table, JSON, Markdown, PNG."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_accel.telemetry.alerts import Alert
from lightning_accel.telemetry.ranks import RankTiming
from lightning_accel.telemetry.sampler import Stat

__all__ = ["COLUMNS", "PLOTTED", "RunReport"]

# Report column -> (metric, statistic of the run aggregate, scale, header).
COLUMNS: dict[str, tuple[str, str, float, str]] = {
    "utilization_mean_pct": ("utilization_pct", "mean", 1.0, "util mean %"),
    "utilization_peak_pct": ("utilization_pct", "max", 1.0, "util peak %"),
    "memory_peak_gib": ("memory_used_mib", "max", 1 / 1024, "peak mem GiB"),
    "memory_total_gib": ("memory_total_mib", "max", 1 / 1024, "mem GiB"),
    "power_mean_w": ("power_w", "mean", 1.0, "power mean W"),
    "throttled_pct": ("throttle_any_frac", "mean", 100.0, "throttled %"),
    "temperature_max_c": ("temperature_c", "max", 1.0, "max temp C"),
}
PLOTTED = (
    ("utilization_pct", "utilization %"),
    ("memory_used_pct", "memory used %"),
    ("power_w", "power W"),
    ("temperature_c", "temperature C"),
)


def _number(value: float, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


class RunReport:
    """What GPUMonitor gathers over a run on rank zero; its `state_dict` goes into checkpoints, so a resumed run
    continues the totals, curves and alerts of the run it resumes.

    Args:
        max_points: curve points kept; beyond it every other point is dropped and later windows are drawn at the new
            stride, so the curves stay evenly spread.
    """

    def __init__(self, max_points: int = 2000) -> None:
        self.max_points = max_points
        self.gpus: dict[str, dict[str, Stat]] = {}
        self.info: dict[str, dict[str, Any]] = {}
        self.energy_base: dict[str, float] = {}
        self.energy_fit: dict[str, float] = {}
        self.history: list[dict[str, Any]] = []
        self.stride = 1
        self.windows = 0
        self.alerts: list[dict[str, Any]] = []
        self.ranks: dict[int, list[float]] = {}
        self.fit_s = 0.0
        self.overhead_s = 0.0
        self.last_step = 0

    def begin_fit(self) -> None:
        """A new fit (e.g. a resume): its energy counters start at 0 again."""
        for key, value in self.energy_fit.items():
            self.energy_base[key] = self.energy_base.get(key, 0.0) + value
        self.energy_fit = {}

    def energy_wh(self, key: str) -> float:
        return self.energy_base.get(key, 0.0) + self.energy_fit.get(key, 0.0)

    def add_window(
        self, elapsed_s: float, step: int, gpus: Mapping[str, Mapping[str, Stat]], timings: Sequence[RankTiming] = ()
    ) -> None:
        """Fold one window (GPU key -> metric -> aggregate) and the ranks' timings into the run."""
        self.last_step = step
        point: dict[str, Any] = {"t": elapsed_s, "step": step, "gpus": {}}
        for key, stats in gpus.items():
            run = self.gpus.setdefault(key, {})
            for name, stat in stats.items():
                run.setdefault(name, Stat()).merge(stat)
            if "energy_wh" in stats:
                self.energy_fit[key] = stats["energy_wh"].last
            point["gpus"][key] = {name: stats[name].mean for name, _ in PLOTTED if name in stats}
        for timing in timings:
            totals = self.ranks.setdefault(timing.rank, [0.0, 0.0, 0])
            totals[0] += timing.step_time_s * timing.steps
            totals[1] += timing.data_time_s * timing.steps
            totals[2] += timing.steps
        if point["gpus"]:
            if self.windows % self.stride == 0:
                self.history.append(point)
                if len(self.history) > self.max_points:
                    self.history, self.stride = self.history[::2], 2 * self.stride
            self.windows += 1

    def add_alert(self, alert: Alert) -> None:
        self.alerts.append(
            {"name": alert.name, "step": alert.step, "gpu": alert.gpu, "value": alert.value, "message": alert.message}
        )

    @property
    def fired(self) -> set[str]:
        return {alert["name"] for alert in self.alerts}

    def gpu_rows(self) -> list[dict[str, Any]]:
        rows = []
        for key, run in self.gpus.items():
            row: dict[str, Any] = {"gpu": key, **self.info.get(key, {})}
            for column, (metric, stat, scale, _) in COLUMNS.items():
                row[column] = run[metric].value(stat) * scale if metric in run else math.nan
            row["energy_wh"] = self.energy_wh(key) if "energy_wh" in run or key in self.energy_base else math.nan
            row["seconds"] = max(s.seconds for s in run.values())
            rows.append(row)
        return rows

    def rank_rows(self) -> list[dict[str, Any]]:
        return [
            {"rank": rank, "step_time_ms": 1e3 * step_s / steps, "data_time_ms": 1e3 * data_s / steps, "steps": steps}
            for rank, (step_s, data_s, steps) in sorted(self.ranks.items())
            if steps
        ]

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-able data (NaN where a GPU gave no reading)."""
        return {
            "fit_seconds": self.fit_s,
            "last_step": self.last_step,
            "monitor_overhead_s": self.overhead_s,
            "monitor_overhead_pct": 100.0 * self.overhead_s / self.fit_s if self.fit_s > 0 else 0.0,
            "gpus": self.gpu_rows(),
            "ranks": self.rank_rows(),
            "alerts": list(self.alerts),
        }

    def to_markdown(self) -> str:
        data = self.to_dict()
        lines = [
            "# GPU report",
            "",
            f"Fit time {data['fit_seconds']:.1f} s up to step {data['last_step']}; {len(data['gpus'])} GPU(s). "
            f"GPUMonitor's own time on the training thread: {data['monitor_overhead_s']:.3f} s "
            f"({data['monitor_overhead_pct']:.2f}% of the fit).",
            "",
            "| GPU | name | " + " | ".join(h for *_, h in COLUMNS.values()) + " | energy Wh |",
            "|---|---|" + "---:|" * (len(COLUMNS) + 1),
        ]
        for row in data["gpus"]:
            cells = [_number(row[c], 2 if c.endswith("gib") else 1) for c in COLUMNS] + [_number(row["energy_wh"], 3)]
            lines.append(f"| {row['gpu']} | {row.get('name', '-')} | " + " | ".join(cells) + " |")
        if len(data["ranks"]) > 1:
            lines += ["", "| rank | step time ms | data wait ms | steps |", "|---:|---:|---:|---:|"]
            lines += [
                f"| {r['rank']} | {r['step_time_ms']:.2f} | {r['data_time_ms']:.2f} | {r['steps']} |"
                for r in data["ranks"]
            ]
        lines += ["", "## Alerts", ""]
        lines += [f"- step {a['step']}, `{a['name']}`: {a['message']}" for a in data["alerts"]] or ["None."]
        return "\n".join(lines) + "\n"

    def table(self) -> Any:
        """A rich Table of the per-GPU rows."""
        from rich.table import Table

        table = Table(title="GPUMonitor report", header_style="bold")
        table.add_column("GPU", no_wrap=True)
        table.add_column("name", no_wrap=True)
        for header in (*(h for *_, h in COLUMNS.values()), "energy Wh"):
            table.add_column(header, justify="right")
        for row in self.gpu_rows():
            cells = [_number(row[c], 2 if c.endswith("gib") else 1) for c in COLUMNS] + [_number(row["energy_wh"], 3)]
            table.add_row(row["gpu"], str(row.get("name", "-")), *cells)
        if self.alerts:
            table.caption = "alerts: " + ", ".join(f"{a['name']} (step {a['step']})" for a in self.alerts)
        return table

    def plot(self, path: Path) -> bool:
        """The curves over time as a PNG; False when matplotlib is missing or there is nothing to draw."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            return False
        if not self.history:
            return False
        scale, unit = (60.0, "min") if self.history[-1]["t"] > 300 else (1.0, "s")
        figure = Figure(figsize=(11, 7), tight_layout=True)
        figure.suptitle("GPUMonitor: window means per GPU")
        FigureCanvasAgg(figure)
        for position, (metric, label) in enumerate(PLOTTED):
            axes = figure.add_subplot(2, 2, position + 1)
            for key in self.gpus:
                points = [
                    (p["t"] / scale, p["gpus"][key][metric]) for p in self.history if metric in p["gpus"].get(key, {})
                ]
                if points:
                    axes.plot(*zip(*points, strict=True), label=key, linewidth=1.2)
            axes.set_title(label)
            axes.set_xlabel(f"time ({unit})")
            axes.grid(alpha=0.3)
            if position == 0 and len(self.gpus) <= 16:
                axes.legend(fontsize="small")
        figure.savefig(path, dpi=100)
        return True

    def write(self, directory: Path, filename: str, plot: bool = True) -> list[Path]:
        """<filename>.json, .md and (with `plot`) .png in `directory`; returns the paths written."""
        directory.mkdir(parents=True, exist_ok=True)
        written = [directory / f"{filename}.json", directory / f"{filename}.md"]
        written[0].write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        written[1].write_text(self.to_markdown())
        if plot and self.plot(directory / f"{filename}.png"):
            written.append(directory / f"{filename}.png")
        return written

    def state_dict(self) -> dict[str, Any]:
        return {
            "gpus": {
                k: {n: [s.weighted, s.seconds, s.min, s.max, s.last] for n, s in v.items()}
                for k, v in self.gpus.items()
            },
            "info": self.info,
            "energy_wh": {key: self.energy_wh(key) for key in {*self.energy_base, *self.energy_fit}},
            "history": self.history,
            "stride": self.stride,
            "windows": self.windows,
            "alerts": self.alerts,
            "ranks": {str(rank): totals for rank, totals in self.ranks.items()},
            "fit_s": self.fit_s,
            "overhead_s": self.overhead_s,
            "last_step": self.last_step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.gpus = {k: {n: Stat(*values) for n, values in v.items()} for k, v in state.get("gpus", {}).items()}
        self.info = dict(state.get("info", {}))
        self.energy_base, self.energy_fit = dict(state.get("energy_wh", {})), {}
        self.history = list(state.get("history", []))
        self.stride, self.windows = int(state.get("stride", 1)), int(state.get("windows", len(self.history)))
        self.alerts = list(state.get("alerts", []))
        self.ranks = {int(rank): list(totals) for rank, totals in state.get("ranks", {}).items()}
        self.fit_s = float(state.get("fit_s", 0.0))
        self.overhead_s = float(state.get("overhead_s", 0.0))
        self.last_step = int(state.get("last_step", 0))
