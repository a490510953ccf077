"""DataLoaderTuner on the real lightning-hydra-template: `preset=amp`, N runs beside busy processes that are not ours.

The template app is built as tests/test_template_app.py builds it (its files under tests/template_app/upstream, the
guide's patch, the offline digits datamodule), then `python src/train.py data=digits preset=amp` runs `--runs`
times, one after another, each with the tuner's cache off (every run tunes) and one epoch, while `--busy` CPU-bound
processes (tests/_busy.py) run beside them. A callback added on the command line writes each run's decision.

Printed per run: the decision (workers, prefetch, pinned, persistent; "kept" when the loader's own settings stayed),
the loader's own data-wait share with its interval, the bound it sets (1 / (1 - w), high end), the speedup claimed
(credited) with its interval and as measured, whether the trials were flagged under interference, the trials and
the tuning time. Then: how many runs agree with the most common decision (the issue's criterion: at least 4 of 5),
whether any claim exceeds its bound, and the load average before and after. A benchmark: it prints, it asserts
nothing.

Run:
    python tests/benchmarks/bench_template_tuner.py [--runs 5] [--busy 1] [--max-tuning-time-s 60]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS)]

from _busy import start_busy_processes, stop_processes  # noqa: E402
from _env import clean_env  # noqa: E402
from test_template_app import APP, guide_patch  # noqa: E402

PROBE = '''
"""Writes the DataLoaderTuner's decision and trials of this run as JSON (added by bench_template_tuner.py)."""

import json

import lightning.pytorch as pl

from lightning_accel.callbacks import DataLoaderTuner


class TunerProbe(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module):
        tuner = next(c for c in trainer.callbacks if isinstance(c, DataLoaderTuner))
        record = {
            "result": None if tuner.result is None else tuner.result.as_dict(),
            "trials": [t.as_dict() for t in tuner.trials],
            "tuning_time_s": tuner.tuning_time_s,
            "loader_workers": trainer.train_dataloader.num_workers,
        }
        with open(self.path, "w") as out:
            json.dump(record, out)
'''


def build_app(root: Path) -> Path:
    """The template app, as tests/test_template_app.py's `template` fixture builds it, plus the probe module."""
    app = root / "app"
    shutil.copytree(APP / "upstream", app)
    subprocess.run(["git", "apply", "-"], input=guide_patch(), cwd=app, text=True, check=True, timeout=60)
    shutil.copytree(APP / "overlay", app, dirs_exist_ok=True)
    (root / "probes").mkdir()
    (root / "probes" / "tuner_probe.py").write_text(PROBE)
    return app


def one_run(app: Path, root: Path, index: int, max_tuning_time_s: float) -> dict[str, Any]:
    out = root / f"run{index}.json"
    args = [
        "data=digits",
        "preset=amp",
        "trainer.max_epochs=1",
        "test=False",
        "callbacks.dataloader_tuner.use_cache=false",  # every run tunes
        f"callbacks.dataloader_tuner.max_tuning_time_s={max_tuning_time_s:g}",
        "callbacks.dataloader_tuner.print_table=false",
        "+callbacks.tuner_probe._target_=tuner_probe.TunerProbe",
        f"+callbacks.tuner_probe.path={out}",
        f"hydra.run.dir={root / f'hydra{index}'}",
    ]
    env = clean_env(PYTHONPATH=os.pathsep.join([str(root / "probes"), os.environ.get("PYTHONPATH", "")]))
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "src/train.py", *args], cwd=app, env=env, capture_output=True, text=True, timeout=900
    )
    wall = time.perf_counter() - started
    if done.returncode != 0 or not out.exists():
        return {"error": (done.stdout + done.stderr)[-3000:], "wall_s": wall}
    record = json.loads(out.read_text())
    record["wall_s"] = wall
    record["line"] = next(
        (line for line in (done.stdout + done.stderr).splitlines() if "DataLoaderTuner (" in line), ""
    )
    return record


def describe(record: dict[str, Any]) -> tuple[str, str]:
    """(the decision as a short key, one line of figures)."""
    result = record["result"]
    if result is None:
        return "none", "no decision (tuning failed or ran out of time)"
    s = result["settings"]
    key = (
        f"{s['num_workers']} workers"
        + (f", prefetch {s['prefetch_factor']}" if s["num_workers"] else "")
        + (", pinned" if s["pin_memory"] else "")
        + (", persistent" if s["persistent_workers"] else "")
        + (" (kept)" if result.get("kept") else "")
    )
    base = result.get("baseline")
    wait = "not timed" if base is None else f"{100 * base[0]:.1f}% [{100 * base[1]:.1f}%, {100 * base[2]:.1f}%]"
    bound = 1 / (1 - min(base[2], 0.99)) if base else None
    speed = result.get("speedup")
    claim = (
        "-"
        if speed is None
        else f"{speed:.2f}x [{result.get('speedup_low') or speed:.2f}, {result.get('speedup_high') or speed:.2f}]"
    )
    measured = result.get("measured_speedup")
    flagged = sum(bool(t["flag"]) for t in record["trials"])
    text = (
        f"{key}; own settings' data wait {wait}; bound {'-' if bound is None else f'{bound:.2f}x'}; claimed {claim}"
        f" (measured {'-' if measured is None else f'{measured:.2f}x'}); {len(record['trials'])} trials, "
        f"{flagged} flagged, {record['tuning_time_s']:.1f} s tuning, {record['wall_s']:.0f} s run"
    )
    return key, text


def main(args: argparse.Namespace) -> None:
    import torch

    load_before = os.getloadavg()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; torch {torch.__version__}, "
        f"python {platform.python_version()}; load average before {load_before[0]:.2f} {load_before[1]:.2f} "
        f"{load_before[2]:.2f}",
        flush=True,
    )
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        app = build_app(root)
        busy = start_busy_processes(args.busy)
        print(f"{args.runs} runs of the template's train.py, preset=amp, beside {args.busy} busy process(es)")
        try:
            time.sleep(0.5)
            for index in range(args.runs):
                load = os.getloadavg()[0]
                record = one_run(app, root, index, args.max_tuning_time_s)
                results.append(record)
                if "error" in record:
                    print(f"run {index + 1}: failed\n{record['error']}", flush=True)
                    continue
                _, text = describe(record)
                print(f"run {index + 1}: {text}; load {load:.1f}", flush=True)
                if args.lines:
                    print(f"        {record['line']}", flush=True)
                if args.trials:
                    for t in record["trials"]:
                        print(
                            f"        {t['num_workers']}w p{t['prefetch_factor']} {t['status']:>7} "
                            f"{t['samples_per_s']:>9,.0f} samples/s, wait {100 * t['wait_share']:.0f}% "
                            f"[{100 * t['wait_low']:.0f}%, {100 * t['wait_high']:.0f}%] {t['note']}",
                            flush=True,
                        )
        finally:
            stop_processes(busy)
    load_after = os.getloadavg()
    keys = [describe(r)[0] for r in results if "error" not in r]
    common, count = collections.Counter(keys).most_common(1)[0] if keys else ("-", 0)
    over = [
        r
        for r in results
        if "error" not in r
        and r["result"]
        and r["result"].get("speedup") is not None
        and r["result"].get("baseline") is not None
        and r["result"]["speedup"] > 1 / (1 - min(r["result"]["baseline"][2], 0.99)) + 1e-9
    ]
    print(
        f"\n{count} of {len(results)} runs chose the most common decision ({common}); criterion: at least 4 of 5 "
        f"-> {'met' if count >= 4 and len(results) == 5 else 'see counts'}; decisions {keys}; claims above their "
        f"bound: {len(over)}; load average after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--busy", type=int, default=1, help="CPU-bound processes beside the runs")
    parser.add_argument("--max-tuning-time-s", type=float, default=60.0)
    parser.add_argument("--lines", action="store_true", help="print each run's DataLoaderTuner report line")
    parser.add_argument("--trials", action="store_true", help="print each run's trials")
    main(parser.parse_args())
