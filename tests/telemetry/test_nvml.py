"""NVML reading: unit conversions, throttle reasons, dropped readings, GPM, and CUDA_VISIBLE_DEVICES / MIG mapping."""

from __future__ import annotations

import pytest
from _fake_nvml import FakeClock, FakeGPU, FakeNVML, NVMLError, install

from lightning_accel.telemetry.nvml import resolve_devices
from lightning_accel.telemetry.readings import DeviceReader

UUIDS = [f"GPU-{c * 8}-1111-2222-3333-444455556666" for c in "abcd"]


def _fake(monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGPU] | None = None, **kwargs: object) -> FakeNVML:
    return install(monkeypatch, FakeNVML(gpus or [FakeGPU(uuid) for uuid in UUIDS], **kwargs))


def test_a_reading_converts_nvml_units(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGPU(
        UUIDS[0],
        memory_used_mib=20_389.75,
        memory_total_mib=81_559.0,
        power_mw=350_500.0,
        power_limit_mw=700_000.0,
        sm_clock_mhz=990.0,
        pcie_rx_kb_s=12_000.0,
        pcie_tx_kb_s=3_000.0,
        energy_mj=lambda t: 7_200_000.0 * (1 + t),
    )
    clock = FakeClock()
    _fake(monkeypatch, [gpu], clock=clock)
    [device] = resolve_devices([0])
    reader = DeviceReader(device)
    first = reader.read()
    assert first == {
        "utilization_pct": 90.0,
        "memory_utilization_pct": 40.0,
        "memory_used_mib": 20_389.75,
        "memory_total_mib": 81_559.0,
        "memory_used_pct": 25.0,
        "power_w": 350.5,
        "power_limit_w": 700.0,
        "power_pct": pytest.approx(50.07142857),
        "temperature_c": 60.0,
        "sm_clock_mhz": 990.0,
        "sm_clock_pct": 50.0,
        "memory_clock_mhz": 2619.0,
        "memory_clock_pct": 100.0,
        "throttle_thermal_frac": 0.0,
        "throttle_power_frac": 0.0,
        "throttle_hw_slowdown_frac": 0.0,
        "throttle_any_frac": 0.0,
        "pcie_rx_mb_s": 12.0,
        "pcie_tx_mb_s": 3.0,
        "energy_wh": 0.0,  # energy counts from the first reading; GPM needs two samples
    }
    clock.advance(0.5)
    second = reader.read()
    assert second["energy_wh"] == pytest.approx(3_600_000.0 / 3.6e6)  # 0.5 s x 7.2e6 mJ/s = 1 Wh
    assert {
        k: second[k] for k in ("sm_activity_pct", "sm_occupancy_pct", "tensor_activity_pct", "dram_bw_util_pct")
    } == {"sm_activity_pct": 80.0, "sm_occupancy_pct": 30.0, "tensor_activity_pct": 50.0, "dram_bw_util_pct": 60.0}
    assert device.name == "NVIDIA H100 80GB HBM3" and device.uuid == UUIDS[0]


@pytest.mark.parametrize(
    ("mask", "thermal", "power", "hw"),
    [
        (0x0, 0, 0, 0),
        (0x1, 0, 0, 0),
        (0x4, 0, 1, 0),
        (0x8, 0, 0, 1),
        (0x20, 1, 0, 0),
        (0x40, 1, 0, 0),
        (0x80, 0, 1, 0),
        (0x24, 1, 1, 0),
    ],
)
def test_throttle_reasons(monkeypatch: pytest.MonkeyPatch, mask: int, thermal: int, power: int, hw: int) -> None:
    _fake(monkeypatch, [FakeGPU(UUIDS[0], throttle_mask=mask)])
    values = DeviceReader(resolve_devices([0])[0], readings=["throttle"]).read()
    assert values == {
        "throttle_thermal_frac": thermal,
        "throttle_power_frac": power,
        "throttle_hw_slowdown_frac": hw,
        "throttle_any_frac": float(bool(thermal or power or hw)),
    }


def test_unsupported_readings_are_dropped_once_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    unsupported = {
        "nvmlDeviceGetPcieThroughput",
        "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceGetMaxClockInfo",
        "nvmlDeviceGetEnforcedPowerLimit",
    }
    fake = _fake(monkeypatch, [FakeGPU(UUIDS[0], unsupported=unsupported, architecture=8)])  # Ampere: no GPM
    reader = DeviceReader(resolve_devices([0])[0])
    readings = [reader.read() for _ in range(4)]
    assert all(r == readings[0] for r in readings)
    assert set(readings[0]) == {
        "utilization_pct",
        "memory_utilization_pct",
        "memory_used_mib",
        "memory_total_mib",
        "memory_used_pct",
        "power_w",
        "temperature_c",
        "sm_clock_mhz",
        "memory_clock_mhz",
        "throttle_thermal_frac",
        "throttle_power_frac",
        "throttle_hw_slowdown_frac",
        "throttle_any_frac",
    }
    assert reader.dropped == {"pcie_rx", "pcie_tx", "energy", "power_limit", "gpm"}
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 2  # rx once, tx once, then never again
    assert fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == 1
    assert fake.calls["nvmlDeviceGetEnforcedPowerLimit"] == 1
    assert fake.calls["nvmlGpmSampleGet"] == 0 and fake.calls["nvmlGpmSampleAlloc"] == 0


def test_gpm_metrics_missing_on_a_device_are_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    _fake(monkeypatch, [FakeGPU(UUIDS[0], gpm={2: lambda t: 10.0 * t, 5: 7.0})], clock=clock)
    reader = DeviceReader(resolve_devices([0])[0], readings=["gpm"])
    assert reader.read() == {}
    clock.advance(2.0)
    assert reader.read() == {"sm_activity_pct": 20.0, "tensor_activity_pct": 7.0}


def test_other_nvml_errors_propagate(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    _fake(monkeypatch, [FakeGPU(UUIDS[0])], clock=clock, fail_at=1.0)
    reader = DeviceReader(resolve_devices([0])[0])
    reader.read()
    clock.advance(1.0)
    with pytest.raises(NVMLError, match="GPU is lost"):
        reader.read()


@pytest.mark.parametrize(
    ("visible", "nvml_indices"),
    [
        (None, [0, 1, 2, 3]),
        ("2,0", [2, 0]),
        (" 3 , 1 ", [3, 1]),
        (f"{UUIDS[2]},{UUIDS[0]}", [2, 0]),
        ("GPU-cccc,GPU-aaaa", [2, 0]),  # unique UUID prefixes, as CUDA takes them
        (f"{UUIDS[3][4:]},1", [3, 1]),  # without the GPU- prefix
    ],
)
def test_cuda_visible_devices_maps_ordinals(
    monkeypatch: pytest.MonkeyPatch, visible: str | None, nvml_indices: list[int]
) -> None:
    _fake(monkeypatch)
    devices = resolve_devices(range(len(nvml_indices)), visible)
    assert [d.nvml_index for d in devices] == nvml_indices
    assert [d.index for d in devices] == list(range(len(nvml_indices)))
    assert [d.uuid for d in devices] == [UUIDS[i] for i in nvml_indices]


@pytest.mark.parametrize(
    ("visible", "seen"),
    [("1,7,2", 1), ("1,-1,2", 1), ("1,GPU-ffff,2", 1), ("GPU-,0", 0), ("", 0), ("0,GPU-zz", 1)],
)
def test_the_visible_list_ends_at_the_first_entry_naming_no_device(
    monkeypatch: pytest.MonkeyPatch, visible: str, seen: int
) -> None:
    _fake(monkeypatch)
    assert len(resolve_devices(range(seen), visible)) == seen
    with pytest.raises(ValueError, match=rf"`device_indices` entry {seen} names no GPU.* leaves {seen} of the 4 "):
        resolve_devices(range(seen + 1), visible)


def test_cuda_uuids_beat_the_visible_list(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(monkeypatch)  # CUDA_DEVICE_ORDER=FASTEST_FIRST may order devices unlike NVML; CUDA's own UUIDs decide
    devices = resolve_devices([0, 1], "0,1", uuids=[UUIDS[3][4:], "not-a-known-uuid"])
    assert [d.nvml_index for d in devices] == [3, 1]


def test_mig_device_by_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    migs = [
        FakeGPU(
            "MIG-1234abcd-0000", memory_used_mib=1_000.0, memory_total_mib=9_856.0, gpu_instance_id=7, gpm={2: 11.0}
        ),
        FakeGPU(
            "MIG-5678ef00-0000", memory_used_mib=4_928.0, memory_total_mib=9_856.0, gpu_instance_id=9, gpm={2: 33.0}
        ),
    ]
    gpus = [FakeGPU(UUIDS[0]), FakeGPU(UUIDS[1], power_mw=250_000.0, temperature_c=55.0, mig=migs)]
    clock = FakeClock()
    fake = _fake(monkeypatch, gpus, clock=clock)
    assert [d.uuid for d in resolve_devices(range(3), None)] == [UUIDS[0], migs[0].uuid, migs[1].uuid]
    [device] = resolve_devices([0], "MIG-5678")
    assert (device.uuid, device.nvml_index, device.gpu_instance_id, device.parent) == (migs[1].uuid, 1, 9, gpus[1])
    reader = DeviceReader(device)
    reader.read()
    clock.advance(1.0)
    values = reader.read()
    assert "utilization" in reader.dropped and "utilization_pct" not in values  # NVML has none for a MIG device
    assert values["memory_used_mib"] == 4_928.0 and values["memory_used_pct"] == 50.0  # the MIG slice's memory
    assert (values["power_w"], values["temperature_c"]) == (250.0, 55.0)  # the parent GPU's
    assert values["sm_activity_pct"] == 33.0 and fake.calls["nvmlGpmMigSampleGet"] == 2


# Faults the strict fake brings out: each test fails on the code before its fix.


def test_a_gpu_this_process_may_not_open_is_left_out_and_the_others_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(monkeypatch, denied={1})  # nvmlDeviceGetCount counts GPU 1; its handle raises NO_PERMISSION (cgroups)
    devices = resolve_devices([0, 1, 2])  # CUDA enumerates only the GPUs it may open
    assert [(d.index, d.nvml_index, d.uuid) for d in devices] == [(0, 0, UUIDS[0]), (1, 2, UUIDS[2]), (2, 3, UUIDS[3])]
    assert [d.uuid for d in resolve_devices([0, 1], "0,2")] == [UUIDS[0], UUIDS[3]]
    [reader_device] = resolve_devices([0], UUIDS[3])
    assert DeviceReader(reader_device, readings=["power"]).read()["power_w"] == 400.0


def test_throttle_falls_back_to_throttle_reasons_on_a_driver_without_event_reasons(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    missing = {"nvmlDeviceGetCurrentClocksEventReasons"}  # an older driver's libnvidia-ml
    fake = _fake(monkeypatch, [FakeGPU(UUIDS[0], throttle_mask=0x20)], missing=missing)
    reader = DeviceReader(resolve_devices([0])[0], readings=["throttle"])
    assert reader.read()["throttle_thermal_frac"] == 1.0 and reader.read()["throttle_any_frac"] == 1.0
    assert "throttle" not in reader.dropped and fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 2


def test_memory_used_leaves_out_what_the_driver_reserves(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(monkeypatch, [FakeGPU(UUIDS[0], memory_used_mib=20_000.0, memory_reserved_mib=600.0)])
    values = DeviceReader(resolve_devices([0])[0], readings=["memory"]).read()
    assert values["memory_used_mib"] == 20_000.0  # the v2 struct's `used`; v1's would be 20 600 MiB


def test_memory_falls_back_to_the_v1_struct_on_an_older_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(
        monkeypatch,
        [FakeGPU(UUIDS[0], memory_used_mib=20_000.0, memory_reserved_mib=600.0)],
        missing={"nvmlDeviceGetMemoryInfo_v2"},
    )
    reader = DeviceReader(resolve_devices([0])[0], readings=["memory"])
    assert reader.read()["memory_used_mib"] == 20_600.0 and "memory" not in reader.dropped


def test_temperature_reads_the_versioned_call_and_falls_back_on_an_older_driver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _fake(monkeypatch, [FakeGPU(UUIDS[0], temperature_c=71.0)])
    assert DeviceReader(resolve_devices([0])[0], readings=["temperature"]).read() == {"temperature_c": 71.0}
    assert fake.calls["nvmlDeviceGetTemperatureV"] == 1 and fake.calls["nvmlDeviceGetTemperature"] == 0
    fake = _fake(monkeypatch, [FakeGPU(UUIDS[0], temperature_c=71.0)], missing={"nvmlDeviceGetTemperatureV"})
    assert DeviceReader(resolve_devices([0])[0], readings=["temperature"]).read() == {"temperature_c": 71.0}


def test_a_mig_device_carries_its_own_nvml_name(monkeypatch: pytest.MonkeyPatch) -> None:
    mig = FakeGPU("MIG-1234abcd-0000", gpu_instance_id=7, mig_profile="1g.10gb")
    _fake(monkeypatch, [FakeGPU(UUIDS[0], mig=[mig])], binding="12")  # the 12.x binding returns bytes
    assert resolve_devices([0])[0].name == "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
