"""`ladder` (`--full`): `accel-bench --profile gpu` over fp32 baseline, amp, amp + compile and the tuned preset,
and its verdict against the article's table, the MFU target and the baseline's validation loss."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence

from lightning_accel.gpu_check.context import CheckContext, Part, log_tail, need_cuda, run_command

__all__ = ["ARTICLE_SPEEDUP", "MFU_TARGET", "QUALITY_TOLERANCE", "check_ladder", "ladder_verdict", "run_ladder"]

ARTICLE_SPEEDUP = 6.53
"""The article's last rung (4 GPUs, model parallel + accumulation + OneCycleLR): what the tuned stage must reach."""
MFU_TARGET = 0.50
"""What bf16 + compile must reach on one GPU (nanoGPT-class GPT-2 small training reaches 40-50% on an H100)."""
QUALITY_TOLERANCE = 0.02
"""Largest relative difference of a stage's validation loss from the fp32 baseline's over the same samples."""


def ladder_verdict(stages: Sequence[dict], facts: dict[str, object]) -> tuple[list[str], dict[str, str]]:
    """The ladder's problems (empty: PASS) and figures, from bench.json's stages (`StageResult` as dicts).

    The tuned stage (else the fastest that ran) must reach `ARTICLE_SPEEDUP` over the first stage, `amp_compile`
    `MFU_TARGET`, and every stage's metric stay within `QUALITY_TOLERANCE` of the first's.
    """
    figures: dict[str, str] = {}
    problems = [
        f"{s['name']}: {s['status']} ({s.get('reason') or 'no reason given'})" for s in stages if s["status"] != "ok"
    ]
    ran = [s for s in stages if s["status"] == "ok"]
    if len(ran) < 2:
        return [*problems, "fewer than two stages ran: no speedup to judge"], figures
    matmul, peak = facts.get("matmul_tflops"), facts.get("table_peak_tflops")
    for s in ran:
        interval = s.get("samples_interval") or {}
        speed = s.get("speedup_interval") or {}
        cells = [
            f"{s['samples_per_s']:.1f} samples/s [{interval.get('low', math.nan):.1f}, "
            f"{interval.get('high', math.nan):.1f}]"
        ]
        if s.get("speedup") is not None:
            cells.append(f"{s['speedup']:.2f}x [{speed.get('low', math.nan):.2f}, {speed.get('high', math.nan):.2f}]")
        if s.get("mfu") is not None:
            cells.append(f"MFU {s['mfu']:.1%}")
            if isinstance(matmul, float) and isinstance(peak, float):
                cells.append(f"{s['mfu'] * peak / matmul:.1%} of the hand-timed matmul")
        if s.get("energy_j_per_sample") is not None:
            cells.append(f"{s['energy_j_per_sample']:.3f} J/sample")
        cells.append(f"{s.get('metric_value')} ({s.get('quality')}, {s.get('quality_delta_pct')}%)")
        figures[s["name"]] = "; ".join(cells)
        delta = s.get("quality_delta_pct")
        if s is not ran[0] and (s.get("quality") == "FAIL" or (delta is not None and delta > 100 * QUALITY_TOLERANCE)):
            problems.append(
                f"{s['name']}: validation loss {delta:+.2f}% from the baseline's (limit {QUALITY_TOLERANCE:.0%})"
            )
    tuned = next((s for s in ran if s["name"].startswith("tuned")), None)
    best = tuned or max(ran[1:], key=lambda s: s.get("speedup") or 0.0)
    speedup = best.get("speedup") or 0.0
    figures["verdict: speedup"] = f"{best['name']} {speedup:.2f}x against {ARTICLE_SPEEDUP}x"
    if speedup < ARTICLE_SPEEDUP:
        problems.append(f"{best['name']} runs {speedup:.2f}x the baseline's samples/s, below {ARTICLE_SPEEDUP}x")
    compiled = next((s for s in ran if s["name"] == "amp_compile"), None)
    if compiled is not None:
        mfu = compiled.get("mfu")
        figures["verdict: MFU"] = f"amp_compile {'n/a' if mfu is None else f'{mfu:.1%}'} against {MFU_TARGET:.0%}"
        if mfu is None or mfu < MFU_TARGET:
            problems.append(
                f"amp_compile MFU {'n/a' if mfu is None else f'{mfu:.1%}'} is below {MFU_TARGET:.0%}"
                + (f" ({compiled.get('mfu_note')})" if compiled.get("mfu_note") else "")
            )
    return problems, figures


def check_ladder(ctx: CheckContext) -> Part:
    """`accel-bench --profile gpu` over baseline, amp, amp + compile and the tuned preset."""
    need_cuda()
    return run_ladder(ctx, ["--profile", "gpu"], timeout=900)


def run_ladder(ctx: CheckContext, bench_args: list[str], timeout: float) -> Part:
    ladder = ["baseline", "amp", "amp_compile"]
    extra = []
    if ctx.facts.get("tuned_preset"):
        ladder.append(str(ctx.facts["tuned_preset"]))
        extra.append(f"hydra.searchpath=[file://{(ctx.out_dir / 'conf').resolve()}]")
    out = ctx.out_dir / "bench"
    command = [
        sys.executable,
        "-m",
        "lightning_accel.bench",
        *bench_args,
        "--ladder",
        ",".join(ladder),
        "--out",
        str(out),
        "--overwrite",
        *extra,
    ]
    code = run_command(command, ctx.out_dir / "bench.log", timeout=timeout * ctx.timeout_scale)
    try:
        stages = json.loads((out / "bench.json").read_text())["stages"]
    except (OSError, ValueError, KeyError) as err:
        return Part(
            name="ladder",
            status="FAIL",
            detail=f"exit {code}, no bench.json ({err}): {log_tail(ctx.out_dir / 'bench.log')}",
        )
    ctx.facts["ladder"] = stages
    problems, figures = ladder_verdict(stages, ctx.facts)
    figures = {"command": " ".join(command[1:]), **figures}
    if not ctx.facts.get("tuned_preset"):
        figures["tuned stage"] = "none: the tune part wrote no preset; the fastest stage is judged instead"
    return Part(
        name="ladder",
        status="FAIL" if problems or code not in (0, 1) else "PASS",
        detail="; ".join(problems) or f"{len(stages)} stages, exit {code}",
        figures=figures,
    )
