"""Cost of one HealthReader poll of 8 cards (fake NVML), beside one DeviceReader reading of the same 8 for scale.

Run: `python tests/benchmarks/bench_health.py [--reps 21] [--polls 200]`. Each repetition times `--polls` health polls
of 8 Hopper cards (event sets held across polls, none waiting; ECC counts and remapped rows read) and `--polls`
readings of the same cards by DeviceReader, one after the other in each repetition. Prints the median time per
poll with its 95% bootstrap interval and the NVML calls per card per poll. The fake answers in Python, so the times
are the reader's own overhead plus the fake's; on a real card each NVML call adds the driver's time (microseconds for
these counters, ctypes releasing the GIL), so the calls per card are the figure that carries over.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the fake NVML
from _fake_nvml import FakeClock, FakeGPU, FakeNVML  # noqa: E402

import lightning_accel.telemetry.nvml as nvml  # noqa: E402
from lightning_accel.measure import interleaved, summarize  # noqa: E402
from lightning_accel.telemetry.health import HealthReader  # noqa: E402
from lightning_accel.telemetry.readings import DeviceReader  # noqa: E402

CARDS = 8  # an 8-GPU node


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=21, help="repetitions (each times --polls polls)")
    parser.add_argument("--polls", type=int, default=200, help="polls per repetition")
    args = parser.parse_args()

    clock = FakeClock()
    fake = FakeNVML([FakeGPU(f"GPU-{i:08d}-0000-0000-0000-000000000000") for i in range(CARDS)], clock=clock)
    nvml.pynvml = fake
    devices = nvml.resolve_devices(list(range(CARDS)))
    health = HealthReader(devices, clock=clock)
    readers = [DeviceReader(device) for device in devices]
    health.poll()  # registers the event sets: the first poll's one-off cost
    for reader in readers:
        reader.read()

    def poll_health() -> None:
        health.poll()

    def read_all() -> None:
        for reader in readers:
            reader.read()

    jobs = {"health poll (8 cards)": poll_health, "DeviceReader read (8 cards)": read_all}
    times: dict[str, list[float]] = {name: [] for name in jobs}
    calls: dict[str, float] = {}
    for _, name in interleaved(list(jobs), args.reps):
        before = sum(fake.calls.values())
        start = time.perf_counter()
        for _ in range(args.polls):
            clock.advance(1.0)
            jobs[name]()
        times[name].append((time.perf_counter() - start) / args.polls)
        calls[name] = (sum(fake.calls.values()) - before) / args.polls / CARDS
    health.close()

    print(f"python {platform.python_version()}, {args.reps} repetitions x {args.polls} polls, fake NVML, {CARDS} cards")
    for name, values in times.items():
        interval = summarize([v * 1e6 for v in values])
        print(f"{name:30s} {interval.format('.0f', ' us')} per poll, {calls[name]:.1f} NVML calls per card")


if __name__ == "__main__":
    main()
