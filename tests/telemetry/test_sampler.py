"""The background sampler: exact time-weighted windows from scripted readings, failures, and the real thread."""

from __future__ import annotations

import math
import time

import pytest
from _fake_nvml import FakeClock, FakeGPU, FakeNVML, install
from _wait import wait_until

from lightning_accel.telemetry.nvml import resolve_devices
from lightning_accel.telemetry.readings import DeviceReader
from lightning_accel.telemetry.sampler import NVMLSampler, Stat


def _sampler(monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGPU], clock: FakeClock, **kwargs: object) -> NVMLSampler:
    install(monkeypatch, FakeNVML(gpus, clock=clock, **kwargs))
    readers = [DeviceReader(d, readings=["utilization", "memory", "energy"]) for d in resolve_devices(range(len(gpus)))]
    return NVMLSampler(readers, interval_s=0.5, clock=clock)


def test_windows_are_exact_time_weighted_aggregates(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    gpus = [
        FakeGPU("GPU-a", utilization=lambda t: 10.0 * t, energy_mj=lambda t: 3_600.0 * t),
        FakeGPU("GPU-b", utilization=lambda t: 100.0 if t < 2 else 0.0),
    ]
    sampler = _sampler(monkeypatch, gpus, clock)
    sampler.start(threaded=False)  # the reference reading at t=0 covers no time
    assert sampler.close_window() is None
    for t in (1.0, 1.5, 3.5):  # irregular intervals: 1 s, 0.5 s, 2 s
        clock.t = t
        assert sampler.sample_once()
    window = sampler.close_window()
    assert (window.start, window.end, window.samples, window.seconds) == (0.0, 3.5, 3, 3.5)
    util = window.devices[0]["utilization_pct"]  # readings 10, 15, 35 held for 1, 0.5, 2 s
    assert (util.mean, util.min, util.max, util.last, util.seconds) == ((10 + 7.5 + 70) / 3.5, 10.0, 35.0, 35.0, 3.5)
    other = window.devices[1]["utilization_pct"]  # 100, 100, 0 held for 1, 0.5, 2 s
    assert (other.mean, other.min, other.max) == (150 / 3.5, 0.0, 100.0)
    assert window.devices[0]["energy_wh"].last == pytest.approx(3.5 * 3_600.0 / 3.6e6)
    clock.t = 4.0
    sampler.sample_once()
    second = sampler.close_window()
    assert (second.start, second.end, second.devices[0]["utilization_pct"].mean) == (3.5, 4.0, 40.0)
    assert sampler.close_window() is None and sampler.samples == 4


def test_explicit_times_and_a_clock_that_stands_still(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(10.0)
    sampler = _sampler(monkeypatch, [FakeGPU("GPU-a", utilization=lambda t: t)], clock)
    sampler.start(threaded=False)
    assert sampler.sample_once(now=10.0)  # no time passed: nothing to weigh
    assert sampler.close_window() is None
    clock.t = 12.0
    assert sampler.sample_once()
    assert sampler.close_window().devices[0]["utilization_pct"].mean == 12.0


def test_a_failure_stops_sampling_and_keeps_what_was_read(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    sampler = _sampler(monkeypatch, [FakeGPU("GPU-a", utilization=50.0)], clock, fail_at=2.0)
    sampler.start(threaded=False)
    clock.t = 1.0
    assert sampler.sample_once()
    clock.t = 2.0
    assert not sampler.sample_once()
    assert sampler.failure == "NVMLError_GpuIsLost: GPU is lost"
    clock.t = 3.0
    assert not sampler.sample_once()  # never again
    window = sampler.close_window()
    assert (window.samples, window.end, window.devices[0]["utilization_pct"].mean) == (1, 1.0, 50.0)
    sampler.stop()
    sampler.stop()  # idempotent


def _threaded_sampler(monkeypatch: pytest.MonkeyPatch) -> tuple[NVMLSampler, FakeNVML]:
    """A sampler of one fake GPU on the real clock, its thread started, every 10 ms."""
    fake = install(monkeypatch, FakeNVML([FakeGPU("GPU-a", utilization=70.0)], clock=time.monotonic))
    [device] = resolve_devices([0])
    sampler = NVMLSampler([DeviceReader(device)], interval_s=0.01)
    sampler.start()
    return sampler, fake


def test_the_thread_samples_on_its_own_and_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    sampler, fake = _threaded_sampler(monkeypatch)
    wait_until(lambda: sampler.samples >= 5, timeout_s=30, what="5 readings by the sampler's thread")
    window = sampler.close_window()
    thread = sampler._thread
    sampler.stop()
    assert thread is not None and not thread.is_alive()  # joined: no reading can follow
    assert sampler._thread is None and not sampler.readers
    assert window is not None and window.samples >= 5 and window.devices[0]["utilization_pct"].mean == 70.0
    assert fake.calls["nvmlGpmSampleFree"] == 2  # GPM buffers released


@pytest.mark.slow  # counts readings against the wall clock
def test_the_thread_samples_on_a_timer_not_in_a_busy_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    started = time.monotonic()
    sampler, _ = _threaded_sampler(monkeypatch)
    time.sleep(0.25)  # the span measured, not a wait for something
    window = sampler.close_window()
    elapsed = time.monotonic() - started
    sampler.stop()
    assert window is not None and window.samples <= elapsed / 0.01 + 2


def test_stat_merge_and_mean() -> None:
    first, second = Stat(), Stat()
    first.add(10.0, 1.0)
    second.add(40.0, 2.0)
    first.merge(second)
    assert (first.mean, first.min, first.max, first.last, first.seconds) == (30.0, 10.0, 40.0, 40.0, 3.0)
    assert math.isnan(Stat().mean)


def test_each_view_closes_a_window_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPUMonitor's logging steps and the heartbeat publisher read one sampler; neither takes the other's readings."""
    clock = FakeClock()
    install(monkeypatch, FakeNVML([FakeGPU("GPU-a", utilization=lambda t: 10.0 * t)], clock=clock))
    readers = [DeviceReader(d, readings=["utilization"]) for d in resolve_devices([0])]
    sampler = NVMLSampler(readers, interval_s=0.5, clock=clock, views=2)
    sampler.start(threaded=False)
    for t in (1.0, 2.0):
        clock.t = t
        sampler.sample_once()
    assert sampler.close_window(1).devices[0]["utilization_pct"].mean == 15.0  # the publisher's, t in (0, 2]
    clock.t = 4.0
    sampler.sample_once()
    assert sampler.close_window(0).devices[0]["utilization_pct"].mean == pytest.approx((10 + 20 + 40 * 2) / 4)
    assert sampler.close_window(1).devices[0]["utilization_pct"].mean == 40.0  # only what came after its close
    assert sampler.close_window(0) is None and sampler.samples == 3
