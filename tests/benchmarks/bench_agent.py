"""The agent's cost: `accel-dash agent` on a machine of 8 (scripted) GPUs at its 2 s interval, as the CPU time it
takes over the wall time, with an interval over repeated runs. The target: at most 1% of a core.

The fake NVML answers in Python, where the real library answers in C: the figure is an upper bound of the agent's
own work (reading, JSON, the atomic write, the usage record), measured in this process by `time.process_time`.

Run:
    python tests/benchmarks/bench_agent.py [--gpus 8] [--interval 2] [--rounds 15] [--repeats 3] [--usage 0|1]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _fake_nvml import FakeGPU, FakeNVML  # noqa: E402

from lightning_accel.measure import summarize  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--usage", type=int, default=1)
    args = parser.parse_args()
    import lightning_accel.telemetry.nvml as nvml
    from lightning_accel.dash.cli import main as dash

    gpus = [
        FakeGPU(f"GPU-{i:08d}-0000-0000-0000-000000000000", utilization=50.0, processes=[os.getpid()])
        for i in range(args.gpus)
    ]
    nvml.pynvml = FakeNVML(gpus, clock=time.monotonic)
    shares = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            argv = ["agent", "--runs-dir", f"{tmp}/runs", "--hostname", "bench", "--interval", str(args.interval)]
            argv += ["--rounds", str(args.rounds)]
            argv += ["--usage-db", f"{tmp}/usage-{repeat}.sqlite"] if args.usage else ["--no-usage"]
            wall, cpu = time.perf_counter(), time.process_time()
            assert dash(argv) == 0
            shares.append(100.0 * (time.process_time() - cpu) / (time.perf_counter() - wall))
    s = summarize(shares)
    print(
        f"accel-dash agent, {args.gpus} fake GPUs, every {args.interval:g} s, {args.rounds} rounds x {args.repeats}, "
        f"usage {'on' if args.usage else 'off'}: {s.median:.2f}% of a core [{min(shares):.2f}, {max(shares):.2f}] "
        f"(1-min load {os.getloadavg()[0]:.2f})"
    )


if __name__ == "__main__":
    main()
