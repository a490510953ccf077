"""Sharing a machine: the GPT example trained on the CPU, quiet and beside one and two CPU-bound processes, with
torch's defaults, with the thread plan, and with each fixed setting of threads (1, 2) x OpenMP wait policy.

Each setting is one long-lived worker process started with its environment (the wait policy must be there before
`import torch` loads libgomp): `default` (torch's own: every CPU, OpenMP threads spin at barriers), `plan` (the
variables `read_thread_plan` sets for one rank, as accel-train applies them) and `t{1,2}-{spin,passive}`. The
worker builds the example's `GPTLanguageModel` as `accel-train` does by default (2 layers, 4 heads, 128 wide,
64-byte blocks, batch 32, AdamW) and, on each request, trains for a window of `--window-s` seconds on random bytes
(forward, cross-entropy, backward, step) and answers its samples/s. Rounds interleave everything: each round visits
the conditions (quiet, 1 busy, 2 busy: `tests/_busy.py`'s processes, which are not ours) in a rotated order, and in
each condition every setting in a rotated order, so drift hits all alike. Reported per condition and setting: the
median samples/s with its interval (`lightning_accel.measure.summarize`), then the ratios the issue's criteria name,
paired by round (`measure.ratio`): plan busy / plan quiet, plan / default, plan / the best fixed setting. Beside one
busy process one CPU of two is left, so the figure to hold the plan against is one CPU's worth: what one thread makes
of a whole CPU on a quiet machine (the faster t1 setting, quiet), printed as the plan's share of it and as its own
ratio to the default (the plan / default that one CPU's worth would give). Two threads may get a fair share of 4/3
CPUs beside one busy process, but each waits at every barrier for the other, descheduled (the t2 rows show it). The
load average is printed before and after. A benchmark: it measures and prints, it asserts nothing.

Run:
    python tests/benchmarks/bench_sharing_a_machine.py [--rounds 6] [--window-s 3] [--json out.json]
        [--spin-counts 1000 10000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _busy, _wait

from _busy import busy  # noqa: E402

from lightning_accel.measure import ratio, summarize  # noqa: E402
from lightning_accel.system.threads import THREAD_COUNT_ENV, WAIT_POLICY_ENV, read_thread_plan  # noqa: E402

BATCH, BLOCK = 32, 64
CONDITIONS = {"quiet": 0, "1 busy": 1, "2 busy": 2}
_OURS = (*THREAD_COUNT_ENV, WAIT_POLICY_ENV, "ACCEL_THREADS_SET")

WORKER = f"""
import sys, time, torch
from lightning_accel.examples import GPTLanguageModel
torch.manual_seed(0)
model = GPTLanguageModel()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
x = torch.randint(0, 256, ({BATCH}, {BLOCK}))
y = torch.randint(0, 256, ({BATCH}, {BLOCK}))

def step():
    optimizer.zero_grad(set_to_none=True)
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    optimizer.step()

for _ in range(5):
    step()
print("ready", torch.get_num_threads(), flush=True)
for line in sys.stdin:
    window = float(line)
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < window:
        step()
        steps += 1
    print(steps * {BATCH} / (time.perf_counter() - started), flush=True)
"""


def settings(spin_counts: Sequence[int] = ()) -> dict[str, dict[str, str]]:
    """Setting name -> the variables its worker starts with (on top of an environment cleared of ours); with
    `spin_counts`, two threads that spin that many times at a barrier before they sleep (libgomp's `GOMP_SPINCOUNT`,
    a wait between spinning, 300,000 spins unless told, and passive, none)."""
    plan = read_thread_plan(ranks=1, num_workers=0, env={})
    found = {"default": {}, "plan": dict(plan.set)}
    for threads in (1, 2):
        for policy in ("spin", "passive"):
            env = {key: str(threads) for key in THREAD_COUNT_ENV}
            if policy == "passive":
                env[WAIT_POLICY_ENV] = "PASSIVE"
            found[f"t{threads}-{policy}"] = env
    for count in spin_counts:
        found[f"t2-spin{count}"] = {key: "2" for key in THREAD_COUNT_ENV} | {"GOMP_SPINCOUNT": str(count)}
    return found


class Worker:
    def __init__(self, name: str, extra: dict[str, str]) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _OURS} | extra
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        ready = self.proc.stdout.readline().split()  # type: ignore[union-attr]
        assert ready and ready[0] == "ready", f"{name}: worker did not start"
        self.threads = int(ready[1])

    def run(self, window_s: float) -> float:
        self.proc.stdin.write(f"{window_s}\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return float(self.proc.stdout.readline())  # type: ignore[union-attr]

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait(timeout=60)


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--window-s", type=float, default=3.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--spin-counts", type=int, nargs="*", default=[], help="GOMP_SPINCOUNT settings to add")
    args = parser.parse_args()

    plan = read_thread_plan(ranks=1, num_workers=0, env={})
    print(plan.describe())
    print(f"load average before: {_load()}")
    workers = {name: Worker(name, env) for name, env in settings(args.spin_counts).items()}
    names = list(workers)
    results: dict[str, dict[str, list[float]]] = {c: {n: [] for n in names} for c in CONDITIONS}
    started = time.perf_counter()
    try:
        for round_ in range(args.rounds):
            conditions = list(CONDITIONS)
            conditions = conditions[round_ % 3 :] + conditions[: round_ % 3]
            for condition in conditions:
                with busy(CONDITIONS[condition]) if CONDITIONS[condition] else contextlib.nullcontext():
                    order = names[round_ % len(names) :] + names[: round_ % len(names)]
                    for name in order:
                        results[condition][name].append(workers[name].run(args.window_s))
            print(f"round {round_ + 1}/{args.rounds} done ({time.perf_counter() - started:.0f} s, load {_load()})")
    finally:
        for worker in workers.values():
            worker.close()
    print(f"load average after: {_load()}")
    print(f"\nthreads per worker: {', '.join(f'{n}={w.threads}' for n, w in workers.items())}")
    print(f"\nsamples/s (median [95% interval]) over {args.rounds} rounds of {args.window_s:g} s windows")
    print(f"{'setting':<12}" + "".join(f"{c:>26}" for c in CONDITIONS))
    for name in names:
        cells = [summarize(results[c][name]).format(".0f") for c in CONDITIONS]
        print(f"{name:<12}" + "".join(f"{cell:>26}" for cell in cells))
    report: dict[str, object] = {"results": results, "plan": plan.describe()}
    print()
    for condition in CONDITIONS:
        fixed = [f"t{t}-{p}" for t in (1, 2) for p in ("spin", "passive")]  # the sweep: threads (1, 2) x policy
        best = max(fixed, key=lambda n: summarize(results[condition][n]).median)
        lines = {
            "plan / quiet plan": ratio(results[condition]["plan"], results["quiet"]["plan"]),
            "plan / default": ratio(results[condition]["plan"], results[condition]["default"]),
            f"plan / best fixed ({best})": ratio(results[condition]["plan"], results[condition][best]),
        }
        if condition == "1 busy":  # one CPU of two left: what one thread makes of a whole CPU, quiet
            one = max((n for n in fixed if n.startswith("t1")), key=lambda n: summarize(results["quiet"][n]).median)
            lines[f"plan / one CPU ({one} quiet)"] = ratio(results[condition]["plan"], results["quiet"][one])
            lines[f"one CPU ({one} quiet) / default"] = ratio(results["quiet"][one], results[condition]["default"])
        for name in names[len(fixed) + 2 :]:  # the spin counts asked for
            lines[f"{name} / default"] = ratio(results[condition][name], results[condition]["default"])
        shown = "; ".join(f"{k} {v.format('.2f')}" for k, v in lines.items())
        print(f"{condition}: {shown}")
        report[condition] = {k: v.as_dict() for k, v in lines.items()}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
