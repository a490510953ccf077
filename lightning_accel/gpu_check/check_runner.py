"""The GPU check's table of parts, `run_checks` and the command line (`python -m lightning_accel.gpu_check`)."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from lightning_accel.files import directory_write_error
from lightning_accel.gpu_check.check_report import write_report
from lightning_accel.gpu_check.context import CheckContext, Part, Skip
from lightning_accel.gpu_check.doctor_part import check_doctor
from lightning_accel.gpu_check.fp8_part import check_fp8
from lightning_accel.gpu_check.fsdp_part import check_fsdp
from lightning_accel.gpu_check.gpt_precision_part import check_gpt_precision
from lightning_accel.gpu_check.gpu_monitor_overhead_part import check_gpu_monitor_overhead
from lightning_accel.gpu_check.gpu_monitor_part import check_gpu_monitor
from lightning_accel.gpu_check.health_part import check_health
from lightning_accel.gpu_check.ladder_part import check_ladder
from lightning_accel.gpu_check.mfu_part import check_mfu
from lightning_accel.gpu_check.micro_batch_part import check_micro_batch
from lightning_accel.gpu_check.model_parallel_part import check_model_parallel
from lightning_accel.gpu_check.nvml_vs_torch_part import check_nvml_vs_torch
from lightning_accel.gpu_check.tune_part import check_tune

__all__ = ["FULL_PARTS", "PARTS", "main", "run_checks"]

_DESCRIPTION = (  # `--help`'s description: the first line of the package's docstring
    "One-command check of the GPU paths on a real GPU: `python -m lightning_accel.gpu_check [--full]` writes one "
    "report."
)

PARTS: dict[str, Callable[[CheckContext], Part]] = {
    "nvml_vs_torch": check_nvml_vs_torch,
    "gpu_monitor_overhead": check_gpu_monitor_overhead,
    "gpt_precision": check_gpt_precision,
    "mfu": check_mfu,
    "doctor": check_doctor,
    "fsdp": check_fsdp,
    "model_parallel": check_model_parallel,
    "fp8": check_fp8,
    "micro_batch": check_micro_batch,
    "health": check_health,
}
"""The parts of every check, in this order; part `x` lives in `gpu_check/x_part.py` as `check_x`."""
FULL_PARTS: dict[str, Callable[[CheckContext], Part]] = {
    "gpu_monitor": check_gpu_monitor,
    "tune": check_tune,
    "ladder": check_ladder,
}
"""`--full`'s parts, run after `PARTS` in this order (the ladder's tuned stage is the tune part's preset)."""


def run_checks(names: Sequence[str] | None = None, ctx: CheckContext | None = None) -> list[Part]:
    """Run the named parts (default: `PARTS`); a part that cannot run is SKIP with the reason, one that breaks FAIL.

    `ctx` carries the output folder and the figures one part leaves for another (default: a temporary folder).
    """
    ctx = ctx or CheckContext(out_dir=Path(tempfile.mkdtemp(prefix="gpu_check_")))
    every = {**PARTS, **FULL_PARTS}
    parts = []
    for name in names or PARTS:
        started = time.perf_counter()
        try:
            part = every[name](ctx)
            part.name = name
        except Skip as why:
            part = Part(name=name, status="SKIP", detail=str(why))
        except Exception as err:  # one broken part must not hide the others
            part = Part(
                name=name,
                status="FAIL",
                detail=f"{type(err).__name__}: {err}",
                figures={"traceback": traceback.format_exc().strip().splitlines()[-1]},
            )
        part.seconds = time.perf_counter() - started
        parts.append(part)
        print(f"{part.status:4}  {part.name} ({part.seconds:.0f} s): {part.detail}", flush=True)
    return parts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_accel.gpu_check", description=_DESCRIPTION)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("gpu_check"),
        help="the folder for gpu_check.md, gpu_check.json and gpu_check.png (default ./gpu_check)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="also the GPM monitor run, accel-tune --time-budget 180 and the gpt2_small ladder "
        "(about 8 minutes on an H200; needs Hydra, as accel-bench does)",
    )
    parser.add_argument("--parts", nargs="*", choices=[*PARTS, *FULL_PARTS], help="run only these parts")
    parser.add_argument(
        "--timeout-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="multiply the subprocess timeouts of --full (a slower GPU than an H200; default 1)",
    )
    args = parser.parse_args(argv)
    if not (args.timeout_scale > 0 and math.isfinite(args.timeout_scale)):
        parser.error(f"--timeout-scale must be a finite number > 0, got {args.timeout_scale}")
    problem = directory_write_error(args.out)  # before the parts run, not after minutes of GPU time
    if problem is not None:
        parser.error(f"--out {args.out} cannot be written: {problem}; pass a writable folder")
    root = str(Path(__file__).resolve().parents[2])  # `examples` sits beside the package in a checkout
    if root not in sys.path:
        sys.path.insert(0, root)
    os.environ.setdefault("TMPDIR", tempfile.gettempdir())
    ctx = CheckContext(out_dir=args.out.resolve(), timeout_scale=args.timeout_scale)
    names = args.parts or [*PARTS, *(FULL_PARTS if args.full else ())]
    parts = run_checks(names, ctx)
    files = write_report(parts, ctx)
    print("report: " + ", ".join(str(f) for f in files))
    return 1 if any(p.status == "FAIL" for p in parts) else 0
