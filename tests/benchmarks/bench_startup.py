"""accel-train's start-up: how long Hydra's answers and the check take, beside `python -c "import hydra"`.

Times, in fresh processes, `accel-train --help`, `accel-train trainer.maxx_steps=3` (an unknown key: Hydra's error,
exit 2) and `accel-train check=true` on a tiny config (`trainer=smoke trainer.accelerator=cpu`: the plan, the checks
and the callbacks, nothing trained), with `python -c "import hydra"` as the floor. With `--baseline PATH` (another
checkout's `accel-train`, e.g. `/work/main/.venv/bin/accel-train`) the same commands of that build run in the same
rounds, and each row gets the ratio baseline / this (above 1: this build is faster).

Every command runs once to warm the file cache and write bytecode (into a private `PYTHONPYCACHEPREFIX`, so neither
checkout is written to), then `--runs` rounds in turn (A B C ..., A B C ...). It prints each median with its range
(wall seconds and the CPU seconds the process used), the exit codes, and the 1-minute load average before and after
each round: figures from a loaded machine compare only with figures of the same run. A benchmark: it measures and
prints; the targets (--help and the unknown key within 1 s on a quiet machine, check=true no slower than before) are
judged by reading it.

Run:
    python tests/benchmarks/bench_startup.py [--runs 5] [--baseline /work/main/.venv/bin/accel-train]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning_accel.measure import interleaved, ratio, summarize

CASES = {
    "--help": (["--help"], 0),
    "unknown key": (["trainer.maxx_steps=3"], 2),
    "check=true": (["check=true", "trainer=smoke", "trainer.accelerator=cpu"], 0),
}
"""name -> (accel-train's arguments, the exit code it should give)."""


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _time(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds and exit code of one run of `command`."""
    cpu = _children_cpu_s()
    started = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started, _children_cpu_s() - cpu, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--baseline", type=Path, help="another build's accel-train, timed in the same rounds")
    args = parser.parse_args()

    here = Path(sys.executable).parent / "accel-train"
    builds = {"this": here} | ({"baseline": args.baseline} if args.baseline else {})
    work = Path(tempfile.mkdtemp(prefix="bench_startup_"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "HYDRA_FULL_ERROR")}
    env |= {"PYTHONPYCACHEPREFIX": str(work / "pycache"), "ACCEL_LOG_DIR": str(work / "outputs")}
    items: list[tuple[str, str, list[str], int]] = [
        ("python -c 'import hydra'", "this", [sys.executable, "-c", "import hydra"], 0)
    ]
    for name, (argv, code) in CASES.items():
        for build, exe in builds.items():
            items.append((name, build, [str(exe), *argv], code))

    print(f"python {sys.version.split()[0]}; {os.cpu_count()} CPUs; this: {here}; baseline: {args.baseline or '-'}")
    for _name, _build, command, _code in items:  # warm-up: file cache and bytecode, not counted
        _time(command, work, env)
    wall: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    codes: dict[tuple[str, str], set[int]] = {}
    loads: list[tuple[float, float]] = []
    for index, (name, build, command, _code) in interleaved(items, args.runs):
        if (name, build) == items[0][:2]:
            loads.append((os.getloadavg()[0], 0.0))
        seconds, cpu_s, code = _time(command, work, env)
        wall.setdefault((name, build), []).append(seconds)
        cpu.setdefault((name, build), []).append(cpu_s)
        codes.setdefault((name, build), set()).add(code)
        if (name, build) == items[-1][:2]:
            loads[index] = (loads[index][0], os.getloadavg()[0])

    print(f"{'command':<28}{'build':<10}{'wall s: median [min, max]':<30}{'CPU s':<24}{'exit':<8}baseline/this (wall)")
    for name, build, _command, expected in items:
        key = (name, build)
        shown = ",".join(str(c) for c in sorted(codes[key]))
        flag = "" if codes[key] == {expected} else f" (expected {expected})"
        speed = ""
        if build == "this" and (name, "baseline") in wall:
            speed = ratio(wall[(name, "baseline")], wall[key]).format(".2f", "x")
        print(
            f"{name:<28}{build:<10}{summarize(wall[key]).format('.2f'):<30}{summarize(cpu[key]).format('.2f'):<24}"
            f"{shown + flag:<8}{speed}"
        )
    print("1-min load average before/after each round: " + "; ".join(f"{a:.2f}/{b:.2f}" for a, b in loads))


if __name__ == "__main__":
    main()
