"""The signals matrix of examples/runs_and_signals.md: each case 10 times on a 2-rank accel-train, with the slowest and
median time until every rank ended.

Default: SIGTERM and SIGINT to rank 0, to rank 1 and to the whole group during training (`tests/test_train_signals.py`:
every rank ends with 128 + N within 30 s, and the first attempt's `last.ckpt` resumes). `--early`: SIGTERM to rank 0
during the DataLoaderTuner's trials, MicroBatchFinder's search, the start of training and compiling
(`tests/test_early_signals.py`: every rank ends non-zero within 30 s). `pytest -m slow` runs each case once; this runs
them `--runs` times and prints the table. A case that misses fails the benchmark (exit 1) after the table.

Run:
    python tests/benchmarks/bench_signal_matrix.py [--early] [--runs 10]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the launch helpers of the two test files

import test_early_signals as early  # noqa: E402
import test_train_signals as training  # noqa: E402


def _row(name: str, times: list[float], codes: list[int], ok: int, runs: int) -> str:
    return (
        f"| {name} | {runs} | {ok} of {runs} | {', '.join(map(str, sorted(set(codes))))} | "
        f"{max(times):.1f} s | {statistics.median(times):.1f} s |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--early", action="store_true", help="SIGTERM before the training loop, at each point")
    parser.add_argument("--runs", type=int, default=10, help="runs of each case (default 10)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs={args.runs} must be at least 1")
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("| case | runs | every rank ended | exit | slowest | median |\n|---|---|---|---|---|---|")
    missed = 0
    with tempfile.TemporaryDirectory(prefix="signal-matrix-") as root:
        if args.early:
            cases = [(point, point) for point in early.POINTS]
        else:
            cases = [(f"{s.name} to {t}", (s, t)) for s, t in training.MATRIX]
        for name, case in cases:
            times, codes, ok = [], [], 0
            for attempt in range(args.runs):
                folder = Path(root) / f"{len(os.listdir(root))}"
                folder.mkdir()
                if args.early:
                    elapsed, code, _ = early.interrupt_at(folder, str(case))
                    good = code != 0 and elapsed < early.DEADLINE_S
                else:
                    signum, target = case
                    elapsed, code, step = training.interrupt_once(folder, signum, target)
                    good = code == 128 + signum and elapsed < training.DEADLINE_S
                    if attempt == 0 and good:
                        training._resume(folder, step)
                times.append(elapsed)
                codes.append(code)
                ok += good
            missed += args.runs - ok
            print(_row(name, times, codes, ok, args.runs), flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 1 if missed else 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    raise SystemExit(main())
