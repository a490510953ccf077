"""The background sampler: reads every device each `interval_s` off the training thread, into time-weighted windows."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lightning_accel.telemetry import nvml
from lightning_accel.telemetry.readings import DeviceReader

__all__ = [
    "NVMLSampler",
    "Reader",
    "Stat",
    "Window",
    "open_sampler",
]


class _Device(Protocol):
    @property
    def index(self) -> int: ...


class Reader(Protocol):
    """What the sampler needs of a device reader (`DeviceReader`, or a stand-in in tests)."""

    @property
    def device(self) -> _Device: ...

    def read(self) -> dict[str, float]: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class Stat:
    """Time-weighted aggregate of one metric: each reading holds for the interval that ends with it."""

    weighted: float = 0.0
    """Sum of value x seconds."""
    seconds: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    last: float = math.nan

    def add(self, value: float, seconds: float) -> None:
        self.weighted += value * seconds
        self.seconds += seconds
        self.min = min(self.min, value)
        self.max = max(self.max, value)
        self.last = value

    def merge(self, other: Stat) -> None:
        """Append `other`, an aggregate of the time after this one's."""
        self.weighted += other.weighted
        self.seconds += other.seconds
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        if not math.isnan(other.last):
            self.last = other.last

    @property
    def mean(self) -> float:
        return self.weighted / self.seconds if self.seconds > 0 else math.nan

    def value(self, stat: str) -> float:
        """The statistic named `stat`: "mean", "min", "max" or "last"."""
        return self.mean if stat == "mean" else float(getattr(self, stat))


@dataclass(slots=True)
class Window:
    """The aggregates of the readings between two closes of the window."""

    start: float
    """Clock time the first reading's interval began."""
    end: float
    """Clock time of the last reading."""
    samples: int
    devices: dict[int, dict[str, Stat]] = field(default_factory=dict)
    """CUDA ordinal -> metric name -> aggregate."""

    @property
    def seconds(self) -> float:
        return self.end - self.start


class NVMLSampler:
    """Reads every device each `interval_s` seconds in a daemon thread, keeping time-weighted aggregates per window.

    A reading taken at time t stands for the interval since the previous reading (NVML's utilization and power are
    themselves averages over the recent past), so a window's mean is sum(value x interval) / sum(interval), exactly.
    The training thread only calls `close_window`, a short critical section. The first reading is a reference: it
    covers no time. Each of `views` consumers closes a window of its own (GPUMonitor's logging steps, the heartbeat
    publisher's thread), so one reader of NVML serves both. Any error of a reader (other than an unsupported reading,
    which the reader drops itself) stops sampling and is kept in `failure`; the sampler never raises into its caller.

    Args:
        readers: one per device.
        interval_s: seconds between readings.
        clock: the time function (seconds); tests pass a scripted one and call `sample_once` themselves.
        views: how many consumers close windows of their own (`close_window(view)`, views 0 .. views - 1).
    """

    def __init__(
        self,
        readers: Sequence[Reader],
        interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        views: int = 1,
    ) -> None:
        assert interval_s > 0 and views >= 1, (interval_s, views)
        self.readers = list(readers)
        self.interval_s = interval_s
        self.failure: str | None = None
        self.samples = 0
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous: float | None = None
        self._windows: list[Window | None] = [None] * views

    def start(self, threaded: bool = True) -> None:
        """Start the sampling thread, which takes the reference reading first; without `threaded`, take the
        reference reading here and leave the rest to calls of `sample_once`."""
        if not threaded:
            self.sample_once()
            return
        self._thread = threading.Thread(target=self._run, name="GPUMonitor-sampler", daemon=True)
        self._thread.start()

    def sample_once(self, now: float | None = None) -> bool:
        """Read every device at `now` (default: the clock) into the current window; False once sampling failed."""
        if self.failure is not None:
            return False
        now = self._clock() if now is None else now
        try:
            readings = [(reader.device.index, reader.read()) for reader in self.readers]
        except Exception as err:  # NVML failed mid-run: stop sampling, never raise into training
            self.failure = f"{type(err).__name__}: {err}"
            return False
        with self._lock:
            previous, self._previous = self._previous, now
            if previous is None or now <= previous:
                return True
            self.samples += 1
            for view, window in enumerate(self._windows):
                if window is None:
                    window = self._windows[view] = Window(start=previous, end=now, samples=0)
                window.end = now
                window.samples += 1
                for index, values in readings:
                    stats = window.devices.setdefault(index, {})
                    for name, value in values.items():
                        stats.setdefault(name, Stat()).add(value, now - previous)
        return True

    def close_window(self, view: int = 0) -> Window | None:
        """The readings since `view`'s last close (None if there are none yet); its next window starts empty."""
        with self._lock:
            window, self._windows[view] = self._windows[view], None
        return window

    def stop(self) -> bool:
        """Stop the thread and release the readers; idempotent. False if the thread is stuck in an NVML call: then
        the readers are left alone (a leak, not a crash) and NVML should not be shut down under it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 4 * self.interval_s))
            if self._thread.is_alive():
                return False
            self._thread = None
        for reader in self.readers:
            try:
                reader.close()
            except Exception:  # releasing after NVML went away
                pass
        self.readers = []
        return True

    def _run(self) -> None:
        if not self.sample_once():
            return
        deadline = self._clock()
        while True:
            deadline += self.interval_s
            now = self._clock()
            if deadline < now:  # a reading took longer than the interval: skip ahead rather than catch up
                deadline = now + self.interval_s
            if self._stop.wait(deadline - now) or not self.sample_once():
                return


def open_sampler(
    indices: Sequence[int],
    visible: str | None,
    uuids: Sequence[str] | None = None,
    readings: Sequence[str] | None = None,
    interval_s: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    views: int = 1,
) -> tuple[NVMLSampler | None, list[nvml.GpuDevice], str | None]:
    """Initialise NVML and a (not yet started) sampler of the devices behind CUDA ordinals `indices`.

    Returns the sampler and its devices, or (None, [], why not) with NVML shut down again. Arguments as in
    `nvml.resolve_devices` and `NVMLSampler`.
    """
    problem = nvml.init_nvml()
    if problem is not None:
        return None, [], problem
    try:
        devices = nvml.resolve_devices(indices, visible, uuids)
        readers = [DeviceReader(device, readings) for device in devices]
    except Exception as err:
        nvml.shutdown_nvml()
        return None, [], str(err) if isinstance(err, ValueError) else f"NVML failed ({type(err).__name__}: {err})"
    return NVMLSampler(readers, interval_s, clock=clock, views=views), devices, None
