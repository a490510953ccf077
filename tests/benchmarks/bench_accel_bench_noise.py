"""accel-bench under load: does a busy machine ever print an unflagged speedup that a quiet run contradicts?

Runs `accel-bench --quick` `--runs` times on the machine as it is (quiet, if nothing else runs), then `--runs` times
beside a CPU-bound background process that is not ours (started through a shell that exits, so init adopts it).
For each stage it takes the quiet runs' interval: the span of their speedup intervals (the lowest low to the highest
high). A loaded run passes a stage when its median speedup lies within that span, or when it flags the stage as
measured under interference. It fails the check when it prints an unflagged speedup outside the span. Also shown:
each run's table row per stage (median [interval], verdict, flag, quality), its exit code and wall time, and the load
around it. A benchmark: it measures and prints; the last line says whether the check held.

Run:
    python tests/benchmarks/bench_accel_bench_noise.py [--runs 5] [--out DIR] [--busy 1] [-- extra accel-bench args]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _busy import start_busy_processes, stop_processes  # noqa: E402


def run_bench(out: Path, extra: list[str]) -> dict[str, Any]:
    started = time.perf_counter()
    load = os.getloadavg()[0]
    done = subprocess.run(
        [sys.executable, "-m", "lightning_accel.bench", "--quick", "--out", str(out), *extra],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    (out.parent / f"{out.name}.log").write_text(done.stdout + done.stderr)
    report = json.loads((out / "bench.json").read_text()) if (out / "bench.json").is_file() else {"stages": []}
    stages = {}
    for stage in report["stages"]:
        interval = stage.get("speedup_interval") or {}
        stages[stage["name"]] = {
            "status": stage["status"],
            "speedup": stage.get("speedup"),
            "low": interval.get("low"),
            "high": interval.get("high"),
            "verdict": stage.get("speedup_verdict"),
            "flagged": stage.get("interference"),
            "quality": stage.get("quality"),
            "delta": stage.get("quality_delta_pct"),
            "runs": len(stage.get("runs") or []),
        }
    return {"rc": done.returncode, "wall_s": wall, "load_start": load, "load_end": os.getloadavg()[0], "stages": stages}


def show(label: str, result: dict[str, Any]) -> None:
    print(
        f"{label}: exit {result['rc']}, {result['wall_s']:.0f} s, load {result['load_start']:.1f} -> "
        f"{result['load_end']:.1f}"
    )
    for name, s in result["stages"].items():
        if s["status"] != "ok" or s["speedup"] is None:
            print(f"    {name:>15}: {s['status']}")
            continue
        span = f"[{s['low']:.2f}, {s['high']:.2f}]" if s["low"] is not None else ""
        flag = " FLAGGED" if s["flagged"] else ""
        delta = "" if s["delta"] is None else f" ({s['delta']:+.1f}%)"
        print(
            f"    {name:>15}: {s['speedup']:.2f}x {span} {s['verdict'] or 'reference'}{flag}; quality "
            f"{s['quality']}{delta}; {s['runs']} runs"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--busy", type=int, default=1, help="CPU-bound background processes in the loaded runs")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("extra", nargs="*", help="more accel-bench arguments (after --)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-noise-"))
    print(f"{platform.node()}: {os.cpu_count()} CPUs, python {platform.python_version()}; outputs in {out}")
    quiet = []
    for k in range(args.runs):
        quiet.append(run_bench(out / f"quiet-{k}", args.extra))
        show(f"quiet {k + 1}/{args.runs}", quiet[-1])
    loaded = []
    pids = start_busy_processes(args.busy)
    try:
        time.sleep(1.0)
        for k in range(args.runs):
            loaded.append(run_bench(out / f"loaded-{k}", args.extra))
            show(f"loaded {k + 1}/{args.runs} ({args.busy} busy process(es))", loaded[-1])
    finally:
        stop_processes(pids)
    print("\nquiet runs' span of each stage's speedup intervals, and the loaded runs against it:")
    contradicted = 0
    for name in quiet[0]["stages"]:
        ok = [q["stages"][name] for q in quiet if q["stages"].get(name, {}).get("speedup") is not None]
        if not ok:
            print(f"    {name:>15}: no quiet speedup")
            continue
        low = min(s["low"] if s["low"] is not None else s["speedup"] for s in ok)
        high = max(s["high"] if s["high"] is not None else s["speedup"] for s in ok)
        medians = sorted(s["speedup"] for s in ok)
        quiet_flags = sum(bool(s["flagged"]) for s in ok)
        verdicts = []
        for run in loaded:
            s = run["stages"].get(name, {})
            if s.get("speedup") is None:
                verdicts.append("n/a")
            elif low <= s["speedup"] <= high:
                verdicts.append("within")
            elif s["flagged"]:
                verdicts.append("flagged")
            else:
                verdicts.append("CONTRADICTED")
                contradicted += 1
        print(
            f"    {name:>15}: quiet span [{low:.2f}, {high:.2f}], quiet medians {[round(m, 2) for m in medians]} "
            f"({quiet_flags} flagged); loaded: {', '.join(verdicts)}"
        )
    exits = [q["rc"] for q in quiet]
    print(f"\nquiet exit codes {exits}; loaded exit codes {[r['rc'] for r in loaded]}")
    print(
        f"check: {'held' if contradicted == 0 else 'FAILED'} ({contradicted} unflagged loaded speedup(s) outside "
        "the quiet span)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
