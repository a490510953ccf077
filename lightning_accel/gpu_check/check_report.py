"""The GPU check's report: gpu_check.md (the machine, one row per part and its figures), gpu_check.json and
gpu_check.png (the ladder's samples/s against the article's table)."""

from __future__ import annotations

import datetime
import json
import platform
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import torch

from lightning_accel.gpu_check.context import CheckContext, Part
from lightning_accel.gpu_check.ladder_part import ARTICLE_SPEEDUP

__all__ = ["plot", "render", "to_json", "write_report"]


def _machine() -> dict[str, str]:
    """Date, device, driver, torch and Python: the header of the report and the README's table."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    driver = "n/a"
    if torch.cuda.is_available():
        try:
            from lightning_accel.telemetry import nvml

            if nvml.init_nvml() is None:
                try:
                    raw = nvml.pynvml.nvmlSystemGetDriverVersion()
                    driver = raw.decode() if isinstance(raw, bytes) else str(raw)
                finally:
                    nvml.shutdown_nvml()
        except Exception as err:  # the header must not stop the check
            driver = f"n/a ({type(err).__name__})"
    return {
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        "device": device,
        "driver": driver,
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
        "python": f"{platform.python_version()} on {platform.platform()}",
    }


def render(parts: Sequence[Part], machine: dict[str, str] | None = None) -> str:
    """The Markdown report: the machine, then one row per part and its figures."""
    machine = machine or _machine()
    lines = [
        "# lightning_accel GPU check",
        "",
        *(f"- {key}: {value}" for key, value in machine.items()),
        "",
        "| part | status | seconds | detail |",
        "|---|---|---|---|",
    ]
    lines += [f"| {p.name} | {p.status} | {p.seconds:.0f} | {p.detail.replace('|', '/')} |" for p in parts]
    for part in parts:
        if part.figures:
            lines += ["", f"## {part.name}", ""] + [f"- {k}: {v}" for k, v in part.figures.items()]
    return "\n".join(lines) + "\n"


def to_json(parts: Sequence[Part], machine: dict[str, str], facts: dict[str, object]) -> dict[str, object]:
    """gpu_check.json: the machine, every part (status, detail, seconds, figures) and the ladder's stages."""
    return {
        "schema_version": 1,
        **machine,
        "parts": [asdict(p) for p in parts],
        "ladder": facts.get("ladder", []),
        "gpm": facts.get("gpm"),
    }


def _no_plot(stages: Sequence[dict]) -> str | None:
    """Why gpu_check.png cannot be drawn (no stage ran, or no matplotlib), or None."""
    if not any(s.get("status") == "ok" and s.get("samples_per_s") for s in stages):
        return "no ladder stage ran: gpu_check.png not drawn"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed (pip install 'lightning_accel[plot]'): gpu_check.png not drawn"
    return None


def plot(stages: Sequence[dict], path: Path) -> str | None:
    """gpu_check.png: each ladder stage's samples/s with its interval and speedup, the article's 6.53x as a line;
    returns why not (no stage ran, or no matplotlib)."""
    note = _no_plot(stages)
    if note is not None:
        return note
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [s for s in stages if s.get("status") == "ok" and s.get("samples_per_s")]
    values = [s["samples_per_s"] for s in ran]
    intervals = [s.get("samples_interval") or {} for s in ran]
    errors = [
        [v - i.get("low", v) for v, i in zip(values, intervals, strict=True)],
        [i.get("high", v) - v for v, i in zip(values, intervals, strict=True)],
    ]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.8 * len(ran)), 4.0))
    colors = ["tab:red" if s.get("quality") == "FAIL" else "tab:blue" for s in ran]
    bars = ax.bar([s["name"] for s in ran], values, color=colors, yerr=errors, capsize=4, ecolor="black")
    for bar, s in zip(bars, ran, strict=True):
        label = f"{s['speedup']:.2f}x" if s.get("speedup") is not None else ""
        if s.get("mfu") is not None:
            label += f"\nMFU {s['mfu']:.0%}"
        ax.annotate(
            label,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=9,
            xytext=(0, 3),
            textcoords="offset points",
        )
    ax.axhline(
        values[0] * ARTICLE_SPEEDUP,
        color="tab:green",
        linestyle="--",
        label=f"the article's 4-GPU table: {ARTICLE_SPEEDUP}x",
    )
    ax.set_ylabel("samples/s, median [interval]")
    ax.set_title(f"GPU check ladder ({ran[0].get('device') or 'GPU'})", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.margins(y=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)
    return None


def write_report(parts: Sequence[Part], ctx: CheckContext, machine: dict[str, str] | None = None) -> list[Path]:
    """Write gpu_check.md, gpu_check.json and (when there is a ladder to draw) gpu_check.png into `ctx.out_dir`,
    each written beside its target and then renamed; returns the files written."""
    from lightning_accel.files import atomic_path, atomic_write

    machine = machine or _machine()
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    ladder = cast("list[dict[str, Any]]", ctx.facts.get("ladder") or [])  # the ladder part's stage rows
    png, stages = ctx.out_dir / "gpu_check.png", list(ladder)
    note = _no_plot(stages)
    if note is None:
        with atomic_path(png) as tmp:
            plot(stages, tmp)
    text = render(parts, machine) + (f"\n{note}\n" if note else "\n![ladder](gpu_check.png)\n")
    files = [
        atomic_write(ctx.out_dir / "gpu_check.md", text),
        atomic_write(
            ctx.out_dir / "gpu_check.json", json.dumps(to_json(parts, machine, ctx.facts), indent=2, default=str)
        ),
    ]
    return [*files, png] if note is None else files
