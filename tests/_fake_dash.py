"""`python -m _fake_dash ARGS` (tests/ on PYTHONPATH): accel-dash on a machine whose fake NVML holds the cards of the
`_fake_train` jobs (`ACCEL_FAKE_GPUS`' letters, two each: `ab` -> four cards) and one more card, `GPU-z...`, that no job
of ours holds, with a process of this test's user on it (`ACCEL_FAKE_PID`, default: this process)."""

from __future__ import annotations

import os
import time

from _fake_nvml import FakeGPU, FakeNVML
from _fake_train import fake_gpus

if __name__ == "__main__":
    import lightning_accel.telemetry.nvml as nvml

    cards = [gpu for letter in os.environ.get("ACCEL_FAKE_GPUS", "a") for gpu in fake_gpus(letter, 0.0)]
    pid = int(os.environ.get("ACCEL_FAKE_PID", os.getpid()))
    free = FakeGPU(
        "GPU-zzzzzzzz-0000-0000-0000-000000000009",
        name="NVIDIA A100-SXM4-80GB",
        architecture=8,
        utilization=lambda t: 30.0 + 10 * (int(t) % 3),
        power_mw=150_000.0,
        processes=[pid],
    )
    cards.append(free)
    nvml.pynvml = FakeNVML(cards, clock=time.monotonic)
    from lightning_accel.dash.cli import main

    raise SystemExit(main())
