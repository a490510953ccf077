"""CPU DDP on 2 ranks (gloo): accel-train's thread plan (`threads=auto`) against Lightning's own thread setting
(`threads=torch`: OMP_NUM_THREADS = CPUs / processes, torch's spinning OpenMP threads), and with `--settings ...
pinned`, the plan with each rank pinned to its own CPUs (`threads.pin=true`), quiet and beside one CPU-bound process
(`tests/_busy.py`).

Each run is `python -m lightning_accel.train` on the GPT example (`trainer=smoke`, `--steps` steps, no validation or
test) in a fresh run directory; its figure is the summary's samples/s (fit time only). Rounds interleave the
settings and the two conditions in rotated orders. Reported: median samples/s [interval] per setting and condition,
and each setting's ratio to the plan's, paired by round, with the load average before and after. Measures; asserts
nothing.

Run:
    python tests/benchmarks/bench_sharing_ddp.py [--rounds 3] [--steps 60] [--settings plan lightning pinned]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _busy, _wait

from _busy import busy  # noqa: E402

from lightning_accel.measure import ratio, summarize  # noqa: E402

SETTINGS = {
    "plan": ["threads=auto"],
    "lightning": ["threads=torch"],
    "pinned": ["threads=auto", "threads.pin=true"],
}
CONDITIONS = {"quiet": 0, "1 busy": 1}
_OURS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "ACCEL_THREADS_SET",
)


def run_once(setting: str, steps: int, root: Path) -> float:
    run_dir = Path(tempfile.mkdtemp(dir=root))
    overrides = [
        "trainer=smoke",
        "trainer.accelerator=cpu",
        "strategy=ddp",
        "trainer.devices=2",
        "data.max_chars=200000",
        f"trainer.max_steps={steps}",
        "trainer.limit_val_batches=0",
        "test=false",
        "logger=none",
        "~callbacks.lr_monitor",
        *SETTINGS[setting],
        f"hydra.run.dir={run_dir}",
    ]
    env = {k: v for k, v in os.environ.items() if k not in _OURS} | {"ACCEL_LOG_DIR": str(root)}
    done = subprocess.run(
        [sys.executable, "-m", "lightning_accel.train", *overrides], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"{setting}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return float(json.loads((run_dir / "summary.json").read_text())["samples_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=["plan", "lightning"])
    args = parser.parse_args()
    chosen = list(dict.fromkeys(["plan", *args.settings]))  # the plan: what every ratio is taken against
    results: dict[str, dict[str, list[float]]] = {c: {s: [] for s in chosen} for c in CONDITIONS}
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            conditions = list(CONDITIONS)[:: 1 if round_ % 2 == 0 else -1]
            for condition in conditions:
                with busy(CONDITIONS[condition]) if CONDITIONS[condition] else contextlib.nullcontext():
                    order = chosen[round_ % len(chosen) :] + chosen[: round_ % len(chosen)]  # rotated each round
                    for setting in order:
                        value = run_once(setting, args.steps, Path(tmp))
                        results[condition][setting].append(value)
                        print(f"round {round_ + 1} {condition} {setting}: {value:.1f} samples/s", flush=True)
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    for condition in CONDITIONS:
        cells = ", ".join(f"{s} {summarize(results[condition][s]).format('.1f')}" for s in chosen)
        plan = results[condition]["plan"]
        paired = "; ".join(
            f"plan / {s} {ratio(plan, results[condition][s]).format('.2f')}"
            if s == "lightning"
            else f"{s} / plan {ratio(results[condition][s], plan).format('.2f')}"
            for s in chosen[1:]
        )
        print(f"{condition}: {cells} samples/s; {paired}")


if __name__ == "__main__":
    main()
