"""What the usage page costs to read: 90 days of synthetic usage for 20 users x 8 GPUs x 4 hosts, one database per
host, written through `UsageStore.record`, then the usage page's data (`UsageReader.page`: GPU-hours per user per
day, held and idle-held, and the top 10 idle-held jobs) over all four databases, timed cold (a new reader each run, as
each page request is).

Run: `python tests/benchmarks/bench_usage.py [--reps 15] [--days 90] [--jobs-per-user 2]`. It prints figures (the
median with its interval, `lightning_accel.measure`, and min/max), it does not pass or fail; the target is at most
300 ms for the page.

Each host, each day: every user runs `--jobs-per-user` jobs, each on all 8 GPUs for part of the day (a fraction of it
idle-held), written as one interval per host-day of 24 h (the rollup holds one row per day, host, user, job and GPU
whatever the interval, so the rows, and so the read, are those of 5 s intervals: 20 x 2 x 8 = 320 rows per host-day,
28,800 per host).
"""

from __future__ import annotations

import argparse
import calendar
import os
import platform
import random
import sys
import tempfile
import time
from datetime import date, timedelta
from pathlib import Path

from lightning_accel.dash.usage_schema import UsageObservation
from lightning_accel.dash.usage_store import DEFAULT_MAX_BYTES, UsageStore
from lightning_accel.dash.usage_view import UsageReader
from lightning_accel.measure import summarize

HOSTS, USERS, GPUS = 4, 20, 8
LAST_DAY = date(2025, 3, 31)


def build(directory: Path, days: int, jobs_per_user: int, seed: int = 0) -> list[Path]:
    """One database per host under `directory`, `days` days up to `LAST_DAY`; returns their paths."""
    rng = random.Random(seed)
    paths = []
    for host_number in range(HOSTS):
        host = f"node{host_number:02d}"
        path = directory / f"usage-{host}.sqlite"
        with UsageStore(path) as store:
            for back in range(days - 1, -1, -1):
                day = LAST_DAY - timedelta(days=back)
                end = calendar.timegm(day.timetuple()) + 86399.0  # 23:59:59 UTC of `day`
                batch = []
                for user in range(USERS):
                    for job in range(jobs_per_user):
                        run_id = f"{day.isoformat()}-{host}-u{user:02d}-j{job}"
                        for gpu in range(GPUS):
                            held = rng.uniform(0.0, 86400.0 / (USERS * jobs_per_user / GPUS))
                            for idle in (False, True):  # the busy and the idle-held part of the day
                                batch.append(
                                    UsageObservation(
                                        host=host,
                                        user=f"user{user:02d}",
                                        job=run_id,
                                        gpu_index=gpu,
                                        gpu_uuid=f"GPU-{host}-{gpu}",
                                        interval_s=86399.0,
                                        held_s=held * (rng.uniform(0.0, 0.4) if idle else 0.6),
                                        idle=idle,
                                        energy_j=held * 300.0,
                                        samples=int(held * 50),
                                        steps=int(held),
                                    )
                                )
                store.record(batch, end)
                store._pruned_at = end  # the benchmark's days are in the past: keep record's retention out of it
        paths.append(path)
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15, help="timed reads of the page (default 15)")
    parser.add_argument("--days", type=int, default=90, help="days of usage per host (default 90)")
    parser.add_argument("--jobs-per-user", type=int, default=2, help="jobs per user per host-day (default 2)")
    args = parser.parse_args()
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, {platform.platform()}")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        started = time.perf_counter()
        paths = build(directory, args.days, args.jobs_per_user)
        print(f"built {HOSTS} databases of {args.days} days in {time.perf_counter() - started:.1f} s")
        since = LAST_DAY - timedelta(days=args.days - 1)
        reader = UsageReader([directory])
        rows = len(reader.rows())
        print(f"rows: {rows:,} ({rows // HOSTS:,} per host)")
        for path in paths:
            size = path.stat().st_size + (path.with_name(path.name + "-wal").stat().st_size)
            print(f"  {path.name}: {size / 2**20:.2f} MiB ({size / DEFAULT_MAX_BYTES:.2%} of the 256 MiB cap)")
        figures: dict[str, list[float]] = {"page": [], "totals per user": [], "csv rows": []}
        for _ in range(args.reps):  # interleaved: each query once per round
            for name in figures:
                reader = UsageReader([directory])
                started = time.perf_counter()
                if name == "page":
                    page = reader.page(since, LAST_DAY)
                elif name == "totals per user":
                    reader.totals("user", since, LAST_DAY)
                else:
                    reader.rows(since, LAST_DAY)
                figures[name].append((time.perf_counter() - started) * 1000)
        assert len(page.days) == args.days and len(page.held_gpu_hours) == USERS and not page.notes
        for name, values in figures.items():
            interval = summarize(values)
            print(
                f"{name:>16}: {interval.format('.1f', ' ms')} ({interval.method}, n={interval.n}), "
                f"min {min(values):.1f} ms, max {max(values):.1f} ms"
            )
        print("target: the page at most 300 ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
