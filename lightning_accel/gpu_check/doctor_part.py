"""`doctor`: `accel-doctor` exits 0."""

from __future__ import annotations

import json
import subprocess
import sys

from lightning_accel.gpu_check.context import CheckContext, Part

__all__ = ["check_doctor"]


def check_doctor(ctx: CheckContext) -> Part:
    done = subprocess.run(
        [sys.executable, "-m", "lightning_accel.doctor", "--json"], capture_output=True, text=True, timeout=120
    )
    figures: dict[str, str] = {}
    try:
        checks = json.loads(done.stdout)["checks"]
        figures = {c["name"]: f"{c['status']}: {c.get('detail') or c.get('message') or ''}".strip() for c in checks}
    except (ValueError, KeyError, TypeError):
        figures = {"output": " / ".join((done.stdout + done.stderr).strip().splitlines()[-5:])}
    return Part(
        name="doctor",
        status="PASS" if done.returncode == 0 else "FAIL",
        detail=f"exit {done.returncode}",
        figures=figures,
    )
