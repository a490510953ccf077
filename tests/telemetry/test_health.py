"""Per-card health through the scripted NVML: XID events and their expiry, ECC counts, remapped rows, retired pages,
unsupported readings dropped, and a lost card reported, never raised."""

from __future__ import annotations

import json
from typing import Any

import pytest
from _fake_nvml import (
    FakeClock,
    FakeGPU,
    FakeNVML,
    install,
    nvmlEventTypeDoubleBitEccError,
    nvmlEventTypeSingleBitEccError,
    nvmlEventTypeXidCriticalError,
)

from lightning_accel.telemetry.health import DEFAULT_XID_HOLD_S, CardHealth, HealthReader
from lightning_accel.telemetry.nvml import GpuDevice, resolve_devices

UUIDS = [f"GPU-{c * 8}-1111-2222-3333-444455556666" for c in "ab"]


def _reader(
    monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGPU], *, xid_hold_s: float = DEFAULT_XID_HOLD_S, **fake: Any
) -> tuple[FakeNVML, FakeClock, HealthReader]:
    clock = FakeClock()
    nvml = install(monkeypatch, FakeNVML(gpus, clock=clock, **fake))
    reader = HealthReader(resolve_devices(list(range(len(gpus)))), xid_hold_s=xid_hold_s, clock=clock)
    return nvml, clock, reader


def _at(clock: FakeClock, reader: HealthReader, t: float) -> list[CardHealth]:
    clock.t = t
    return reader.poll()


def test_a_scripted_xid_79_shows_as_79_with_the_time_a_poll_saw_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _, clock, reader = _reader(monkeypatch, [FakeGPU(UUIDS[0], xids=[(100.0, 79)]), FakeGPU(UUIDS[1])])
    before = _at(clock, reader, 50.0)
    assert [card.xid for card in before] == [None, None] and all(card.ok for card in before)
    card, other = _at(clock, reader, 100.0)
    assert (card.xid, card.xid_time, card.xid_age_s) == (79, 100.0, 0.0)
    assert card.problems() == ["XID 79 (GPU has fallen off the bus), 0 s ago"]
    assert other.xid is None and other.ok  # the event is the first card's only
    [later, _] = _at(clock, reader, 130.0)
    assert (later.xid, later.xid_time, later.xid_age_s) == (79, 100.0, 30.0)  # kept, not seen again


def test_an_xid_shows_for_its_stated_time_then_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert HealthReader([]).xid_hold_s == DEFAULT_XID_HOLD_S == 3600.0
    gpu = FakeGPU(UUIDS[0], xids=[(10.0, 43), (200.0, 31)])
    _, clock, reader = _reader(monkeypatch, [gpu], xid_hold_s=60.0)
    _at(clock, reader, 0.0)
    assert _at(clock, reader, 10.0)[0].xid == 43
    assert _at(clock, reader, 69.0)[0].xid == 43  # 59 s after: still shown
    gone = _at(clock, reader, 70.0)[0]
    assert (gone.xid, gone.xid_time, gone.xid_age_s) == (None, None, None) and gone.summary() == "ok"
    assert _at(clock, reader, 205.0)[0].xid == 31  # the next one shows again


def test_the_last_xid_of_a_poll_wins_and_one_before_registration_is_not_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGPU(UUIDS[0], xids=[(1.0, 13), (10.0, 31), (12.0, 43)])
    _, clock, reader = _reader(monkeypatch, [gpu])
    assert _at(clock, reader, 5.0)[0].xid is None  # XID 13 came before the event set existed
    card = _at(clock, reader, 15.0)[0]
    assert (card.xid, card.xid_time) == (43, 15.0)


def test_ecc_counts_of_both_counters_and_ecc_events(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGPU(
        UUIDS[0],
        ecc={
            ("corrected", "volatile"): 3,
            ("corrected", "aggregate"): 40,
            ("uncorrected", "volatile"): lambda t: 1 if t >= 10 else 0,
            ("uncorrected", "aggregate"): lambda t: 7 if t >= 10 else 6,
        },
        ecc_events=[(5.0, nvmlEventTypeSingleBitEccError), (10.0, nvmlEventTypeDoubleBitEccError)],
    )
    _, clock, reader = _reader(monkeypatch, [gpu, FakeGPU(UUIDS[1], ecc={("corrected", "aggregate"): 9})])
    first, worn = _at(clock, reader, 0.0)
    counts = (
        first.ecc_corrected_volatile,
        first.ecc_corrected_aggregate,
        first.ecc_uncorrected_volatile,
        first.ecc_uncorrected_aggregate,
    )
    assert counts == (3, 40, 0, 6)
    assert first.problems() == ["6 uncorrected ECC error(s) over the card's life"]
    assert worn.ecc_corrected_aggregate == 9 and worn.ok  # corrected errors are wear, not a problem
    card = _at(clock, reader, 10.0)[0]
    assert (card.ecc_uncorrected_volatile, card.ecc_uncorrected_aggregate) == (1, 7)
    assert (card.single_bit_events, card.double_bit_events) == (1, 1)
    assert "1 uncorrected ECC error(s) since the driver loaded" in card.problems()
    assert "1 double-bit ECC event(s) seen" in card.problems()


def test_remapped_rows_on_ampere_and_newer(monkeypatch: pytest.MonkeyPatch) -> None:
    pending = FakeGPU(UUIDS[0], remapped_rows=(5, lambda t: 2, 1, 0))
    failed = FakeGPU(UUIDS[1], architecture=7, remapped_rows=(0, 0, 0, 1))
    nvml, clock, reader = _reader(monkeypatch, [pending, failed])
    first, second = _at(clock, reader, 0.0)
    assert (first.remapped_rows_corrected, first.remapped_rows_uncorrected) == (5, 2)
    assert (first.row_remap_pending, first.row_remap_failure) == (True, False)
    assert first.problems() == ["row remapping pending: reset the GPU to apply it"]
    assert second.row_remap_failure is True and second.problems() == ["row remapping failed: the card needs service"]
    assert first.retired_pages_single_bit is None and first.retired_pages_pending is None
    assert nvml.calls["nvmlDeviceGetRetiredPages"] == 0  # not asked where rows are remapped


def test_retired_pages_before_ampere(monkeypatch: pytest.MonkeyPatch) -> None:
    pages = {"single_bit": 2, "double_bit": 1}
    volta = FakeGPU(UUIDS[0], architecture=5, retired_pages=pages, retired_pages_pending=True)
    nvml, clock, reader = _reader(monkeypatch, [volta])
    for t in (0.0, 1.0, 2.0):
        card = _at(clock, reader, t)[0]
    assert (card.retired_pages_single_bit, card.retired_pages_double_bit, card.retired_pages_pending) == (2, 1, True)
    assert card.remapped_rows_corrected is None and card.row_remap_pending is None
    assert card.problems() == ["page retirement pending: reset the GPU to apply it"]
    assert nvml.calls["nvmlDeviceGetRemappedRows"] == 1  # unsupported once, not asked again


def test_unsupported_readings_are_dropped_and_not_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGPU(
        UUIDS[0],
        xids=[(2.0, 79)],
        unsupported={"nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetSupportedEventTypes", "nvmlDeviceGetRemappedRows"},
        architecture=7,  # retired pages unsupported too
    )
    nvml, clock, reader = _reader(monkeypatch, [gpu], missing={"nvmlEventSetWait_v2"})
    for t in (0.0, 1.0, 2.0):
        card = _at(clock, reader, t)[0]
    assert card.ecc_uncorrected_volatile is None and card.ecc_corrected_aggregate is None
    assert card.remapped_rows_corrected is None and card.retired_pages_double_bit is None
    assert card.error == "" and card.xid == 79  # XID alone registered; events through nvmlEventSetWait
    assert nvml.calls["nvmlDeviceGetTotalEccErrors"] == 4  # each of the four counts once
    assert nvml.calls["nvmlDeviceGetRetiredPages"] == 2 and nvml.calls["nvmlEventSetWait_v2"] == 1
    assert nvml.calls["nvmlEventSetWait"] >= 3


def test_a_card_without_the_event_types_registers_none(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml, clock, reader = _reader(monkeypatch, [FakeGPU(UUIDS[0], event_types=0, xids=[(1.0, 79)])])
    card = _at(clock, reader, 2.0)[0]
    assert card.xid is None and card.ok and nvml.calls["nvmlEventSetCreate"] == 0


def test_a_lost_card_is_reported_lost_never_raised_and_not_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGPU(UUIDS[0], xids=[(15.0, 79)], ecc={("uncorrected", "volatile"): 2})
    nvml, clock, reader = _reader(monkeypatch, [gpu], fail_at=20.0)
    seen = _at(clock, reader, 15.0)[0]
    assert (seen.lost, seen.xid) == (False, 79)
    lost = _at(clock, reader, 20.0)[0]
    assert lost.lost and lost.xid == 79 and lost.ecc_uncorrected_volatile == 2  # readings from before are kept
    assert lost.problems()[0].startswith("lost: the GPU fell off the bus") and not lost.ok
    asked = sum(nvml.calls.values())
    assert _at(clock, reader, 30.0)[0].lost and sum(nvml.calls.values()) == asked


def test_one_call_answering_gpu_is_lost_marks_only_that_card(monkeypatch: pytest.MonkeyPatch) -> None:
    lost = FakeGPU(UUIDS[0], errors={"nvmlDeviceGetRemappedRows": 15})  # NVML_ERROR_GPU_IS_LOST
    _, clock, reader = _reader(monkeypatch, [lost, FakeGPU(UUIDS[1])])
    first, second = _at(clock, reader, 0.0)
    assert first.lost and not second.lost and second.ok


def test_other_failures_are_named_on_the_card_and_never_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    flaky = FakeGPU(UUIDS[0], errors={"nvmlDeviceGetTotalEccErrors": 999})  # NVML_ERROR_UNKNOWN
    nvml, clock, reader = _reader(monkeypatch, [flaky, FakeGPU(UUIDS[1])])
    first, second = _at(clock, reader, 0.0)
    assert first.error.startswith("nvmlDeviceGetTotalEccErrors: NVMLError_Unknown") and not first.lost
    assert first.problems()[-1].startswith("a health reading failed:") and second.ok

    def broken(*args: Any) -> Any:
        raise RuntimeError("a binding bug")

    monkeypatch.setattr(nvml, "nvmlDeviceGetRemappedRows", broken)
    assert _at(clock, reader, 1.0)[1].error == "nvmlDeviceGetRemappedRows: RuntimeError: a binding bug"
    monkeypatch.setattr(nvml, "nvmlDeviceGetRemappedRows", lambda device: (1, 2))  # an answer of the wrong shape
    assert _at(clock, reader, 2.0)[1].error.startswith("ValueError: not enough values to unpack")
    denied = GpuDevice(0, 3, "", "", None, why="NVMLError_NoPermission: Insufficient Permissions")
    [card] = HealthReader([denied], clock=clock).poll()
    assert card.error == denied.why and not card.lost


def test_a_mig_device_reads_its_parent_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGPU(UUIDS[0], xids=[(1.0, 94)], mig=[FakeGPU("MIG-aaaa", gpu_instance_id=1)])
    _, clock, reader = _reader(monkeypatch, [gpu])
    _at(clock, reader, 0.0)
    card = _at(clock, reader, 1.0)[0]
    assert (card.uuid, card.xid, card.error) == ("MIG-aaaa", 94, "")


def test_to_json_names_every_field_and_the_problems(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml, clock, reader = _reader(monkeypatch, [FakeGPU(UUIDS[0], xids=[(0.0, 48)])])
    card = _at(clock, reader, 0.0)[0]
    data = json.loads(json.dumps(card.to_json()))
    assert set(data) == set(CardHealth.__dataclass_fields__) | {"problems"}
    assert data["xid"] == 48 and data["problems"] == ["XID 48 (double-bit ECC error), 0 s ago"]
    reader.close()
    assert nvml._event_sets == {}  # freed
    assert _at(clock, reader, 1.0)[0].error == ""  # a poll after close still answers


def test_the_event_types_are_nvmls() -> None:
    from lightning_accel.telemetry import health

    assert health._XID_EVENT == nvmlEventTypeXidCriticalError
    with pytest.raises(ValueError, match="xid_hold_s=0"):
        HealthReader([], xid_hold_s=0)
