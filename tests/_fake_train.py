"""`python -m _fake_train OVERRIDES...` (with tests/ on PYTHONPATH): accel-train on a machine that a fake NVML says
has two H100s with GPM, through the same seam as the unit tests (`lightning_accel.telemetry.nvml.pynvml`).

DDP child ranks re-run this module (accel-train starts them with `python -m <the main module>`), so every rank sees
the same fake. `ACCEL_FAKE_GPUS` names the GPUs (`GPU-<letter><index>...`: two jobs on one machine get two pairs of
cards); their readings are functions of the real clock: SM and tensor activity, utilisation and temperature swing
over a few seconds, power is constant per card (`power_w`), and the energy counter grows at exactly that power, so
`rate(accel_gpu_energy_joules_total)` must give it back. While the file `ACCEL_FAKE_IDLE_FILE` names exists, the
activity readings (utilisation, SM, tensor, DRAM) read 0.5%: the job still holds its memory and does nothing.
`ACCEL_FAKE_XID=<code>@<s>` scripts an XID event on the first card every <s> seconds (a health reader registers
its event set after the fake starts, and sees the events that come after).
"""

from __future__ import annotations

import math
import os
import time

from _fake_nvml import FakeGPU, FakeNVML

POWER_W = (300.0, 350.0)  # per card


def fake_gpus(letter: str, started: float) -> list[FakeGPU]:
    idle_file = os.environ.get("ACCEL_FAKE_IDLE_FILE")
    xid = os.environ.get("ACCEL_FAKE_XID")  # "<code>@<s>": an XID event on the first card every <s> seconds
    code, every = (int(xid.split("@")[0]), float(xid.split("@")[1])) if xid else (0, 0.0)
    xids = [(time.monotonic() + every * k, code) for k in range(1, 1000)] if xid else []
    gpus = []
    for index, power_w in enumerate(POWER_W):

        def swing(low: float, high: float, period_s: float, phase: float = index, activity: bool = True) -> object:
            def value(t: float) -> float:
                if activity and idle_file and os.path.exists(idle_file):
                    return 0.5  # the job holds its memory and does nothing
                return low + (high - low) * (0.5 + 0.5 * math.sin(2 * math.pi * (t - started) / period_s + phase))

            return value

        gpus.append(
            FakeGPU(
                f"GPU-{letter}{index}{letter * 6}-0000-0000-0000-00000000000{index}",
                utilization=swing(85.0, 100.0, 7.0),
                memory_used_mib=lambda t, i=index: 30_000.0 + 1_000 * i,
                power_mw=power_w * 1000.0,
                power_limit_mw=700_000.0,
                temperature_c=swing(55.0, 75.0, 11.0, activity=False),
                energy_mj=lambda t, p=power_w: 1e9 + p * 1000.0 * (t - started),
                gpm={2: swing(40.0, 90.0, 5.0), 3: swing(20.0, 40.0, 9.0), 5: swing(10.0, 60.0, 6.0), 10: 30.0},
                xids=xids if index == 0 else [],
            )
        )
    return gpus


def install() -> FakeNVML:
    import lightning_accel.telemetry.nvml as nvml

    fake = FakeNVML(fake_gpus(os.environ.get("ACCEL_FAKE_GPUS", "a"), 0.0), clock=time.monotonic)
    nvml.pynvml = fake
    return fake


if __name__ == "__main__":
    install()
    from lightning_accel.train import main

    main()
