"""`tune` (`--full`): `accel-tune --profile gpu --time-budget 180` on GPT-2 small, writing the preset the ladder's
tuned stage runs."""

from __future__ import annotations

import json
import sys

from lightning_accel.gpu_check.context import CheckContext, Part, log_tail, need_cuda, run_command

__all__ = ["check_tune"]


def check_tune(ctx: CheckContext) -> Part:
    """`accel-tune --profile gpu --time-budget 180` on GPT-2 small; its preset feeds the ladder's tuned stage."""
    need_cuda()
    out, conf = ctx.out_dir / "tune", ctx.out_dir / "conf"
    command = [
        sys.executable,
        "-m",
        "lightning_accel.tune",
        "--profile",
        "gpu",
        "--time-budget",
        "180",
        "--name",
        "gpt2_small",
        "--config-dir",
        str(conf),
        "--out",
        str(out),
        "model=gpt2_small",
    ]
    code = run_command(command, ctx.out_dir / "tune.log", timeout=420 * ctx.timeout_scale)
    preset = conf / "preset" / "tuned_gpt2_small.yaml"
    figures = {"command": " ".join(command[1:]), "exit": str(code)}
    try:
        trace = json.loads((out / "tune.json").read_text())
        figures.update(
            {
                "pick": str(trace.get("pick")),
                "confirmed": str(trace.get("confirmed")),
                "seconds": f"{float(trace.get('total_s') or 0):.0f}",
                "stopped": str(trace.get("stop")),
            }
        )
    except (OSError, ValueError) as err:
        figures["tune.json"] = f"unreadable: {err}"
    if code == 0 and preset.is_file():
        ctx.facts["tuned_preset"] = "tuned_gpt2_small"
        return Part(name="tune", status="PASS", detail=f"preset {preset.name}", figures=figures)
    detail = f"exit {code}: {log_tail(ctx.out_dir / 'tune.log')}"
    return Part(name="tune", status="FAIL", detail=detail, figures=figures)
