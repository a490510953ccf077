"""Per-card health through NVML: XID events, ECC error counts, remapped rows and retired pages, and a lost card.

`HealthReader.poll()` reads every card once and returns a frozen `CardHealth` per card; it never raises, so a failure
in monitoring never stops training or the dash. The reader holds one NVML event set per card across polls and drains
it without blocking (`nvmlEventSetWait_v2(set, 0)`), so a poll costs a few NVML calls per card. Readings a card (or
its driver) does not give are dropped (None) and not asked again.

What each field says, and how it is read:

- `xid`, `xid_time`, `xid_age_s`: the last XID critical-error event of the card (`nvmlEventTypeXidCriticalError`),
  stamped with the reader's clock when a poll saw it (NVML's event carries no time; it is at most one poll interval
  late). It shows for `xid_hold_s` seconds (default `DEFAULT_XID_HOLD_S`, one hour), then it is dropped: an XID is an
  event, not a state, and one that shows forever (as dcgm-exporter's does) hides the next one.
- `single_bit_events`, `double_bit_events`: single- and double-bit ECC events seen since the reader started, where
  the card reports those event types.
- `ecc_<corrected|uncorrected>_<volatile|aggregate>`: `nvmlDeviceGetTotalEccErrors`; volatile counts since the driver
  last loaded, aggregate over the card's life. None where ECC is off or unsupported.
- `remapped_rows_<corrected|uncorrected>`, `row_remap_pending`, `row_remap_failure`: `nvmlDeviceGetRemappedRows`
  (Ampere and newer). A pending remap takes effect at the next GPU reset; a failure means the card needs service.
- `retired_pages_<single_bit|double_bit>`, `retired_pages_pending`: `nvmlDeviceGetRetiredPages` for the two causes and
  `nvmlDeviceGetRetiredPagesPendingStatus`, read only where remapped rows are unsupported (cards before Ampere).
- `lost`: any call raised NVML_ERROR_GPU_IS_LOST (the card fell off the bus). It stays lost for the reader's life
  (only a reset brings a card back); the readings from before the loss are kept, and the card is not asked again.
- `error`: a reading that failed this poll for another reason (the NVML error, named), else "".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from lightning_accel.telemetry import nvml
from lightning_accel.telemetry.nvml import GpuDevice, unsupported

__all__ = ["DEFAULT_XID_HOLD_S", "XID_MEANINGS", "CardHealth", "HealthReader"]

# Values from nvml.h (a stable ABI), used as numbers so that a fake module needs only the functions.
_SINGLE_BIT_EVENT, _DOUBLE_BIT_EVENT, _XID_EVENT = 0x1, 0x2, 0x8  # nvmlEventType*
_EVENTS = _XID_EVENT | _SINGLE_BIT_EVENT | _DOUBLE_BIT_EVENT
_ERROR_TYPES = (("corrected", 0), ("uncorrected", 1))  # NVML_MEMORY_ERROR_TYPE_*
_COUNTERS = (("volatile", 0), ("aggregate", 1))  # NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC
_CAUSES = (("single_bit", 0), ("double_bit", 1))  # NVML_PAGE_RETIREMENT_CAUSE_*
_TIMEOUT, _GPU_IS_LOST = 10, 15  # NVML_ERROR_TIMEOUT, NVML_ERROR_GPU_IS_LOST
_FEATURE_ENABLED = 1
_DRAIN = 64  # events taken from one card's set per poll at most: an event storm cannot hold a poll up
_WAIT, _WAIT_V1 = "nvmlEventSetWait_v2", "nvmlEventSetWait"

DEFAULT_XID_HOLD_S = 3600.0
"""Seconds an XID shows after a poll saw it (`HealthReader(xid_hold_s=...)`)."""
XID_MEANINGS = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup after earlier errors",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
"""What the common XIDs mean (NVIDIA's XID catalogue), for `CardHealth.problems`."""


@dataclass(frozen=True, slots=True)
class CardHealth:
    """The health of one card at one poll; a reading the card does not give is None."""

    index: int
    """CUDA ordinal of the device in the reading process (`cuda:<index>`)."""
    uuid: str
    lost: bool = False
    """NVML said GPU_IS_LOST: the card fell off the bus."""
    xid: int | None = None
    """The last XID seen within `xid_hold_s`."""
    xid_time: float | None = None
    """When a poll saw it, by the reader's clock (Unix seconds by default)."""
    xid_age_s: float | None = None
    single_bit_events: int = 0
    double_bit_events: int = 0
    ecc_corrected_volatile: int | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_corrected_aggregate: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    remapped_rows_corrected: int | None = None
    remapped_rows_uncorrected: int | None = None
    row_remap_pending: bool | None = None
    row_remap_failure: bool | None = None
    retired_pages_single_bit: int | None = None
    retired_pages_double_bit: int | None = None
    retired_pages_pending: bool | None = None
    error: str = ""
    """A reading that failed this poll for a reason other than unsupported or lost."""

    def problems(self) -> list[str]:
        """What is wrong with the card, in words, worst first; empty for a healthy card. Corrected errors and
        remapped rows are wear, not problems; uncorrected errors, pending or failed repairs, an XID and a lost card
        are."""
        found = []
        if self.lost:
            found.append("lost: the GPU fell off the bus or cannot be reached (GPU_IS_LOST); reset it or reboot")
        if self.xid is not None:
            meaning = XID_MEANINGS.get(self.xid, "see NVIDIA's XID catalogue")
            age = "" if self.xid_age_s is None else f", {self.xid_age_s:.0f} s ago"
            found.append(f"XID {self.xid} ({meaning}){age}")
        if self.row_remap_failure:
            found.append("row remapping failed: the card needs service")
        if self.row_remap_pending:
            found.append("row remapping pending: reset the GPU to apply it")
        if self.retired_pages_pending:
            found.append("page retirement pending: reset the GPU to apply it")
        if self.ecc_uncorrected_volatile:
            found.append(f"{self.ecc_uncorrected_volatile} uncorrected ECC error(s) since the driver loaded")
        if self.ecc_uncorrected_aggregate:
            found.append(f"{self.ecc_uncorrected_aggregate} uncorrected ECC error(s) over the card's life")
        if self.double_bit_events:
            found.append(f"{self.double_bit_events} double-bit ECC event(s) seen")
        if self.error:
            found.append(f"a health reading failed: {self.error}")
        return found

    @property
    def ok(self) -> bool:
        return not self.problems()

    def summary(self) -> str:
        """`ok`, or the problems joined by `; `."""
        return "; ".join(self.problems()) or "ok"

    def to_json(self) -> dict[str, Any]:
        """Every field by name, plus `problems` (a list of str): the shape the dash state and the Prometheus exporter
        read."""
        return {**asdict(self), "problems": self.problems()}


_READINGS = frozenset(f.name for f in fields(CardHealth)) - {"index", "uuid", "lost", "error"}


class _Lost(Exception):
    """The card answered GPU_IS_LOST: stop reading it."""


@dataclass(slots=True, eq=False)
class _Card:
    """What the reader keeps for one card across polls."""

    device: GpuDevice
    handle: Any
    """The whole GPU's handle (a MIG device's parent): health belongs to the physical card."""
    event_set: Any = None
    events_ready: bool = False
    """Events are registered, or cannot be (unsupported): not tried again."""
    wait: str = _WAIT
    lost: bool = False
    xid: int | None = None
    xid_time: float | None = None
    values: dict[str, Any] = field(default_factory=dict)
    skip: set[tuple[Any, ...]] = field(default_factory=set)
    """Calls this card answered as unsupported: not asked again."""
    error: str = ""


class HealthReader:
    """Reads the health of `devices` through NVML, holding one event set per card across polls.

    NVML must be initialised (`nvml.init_nvml`) for as long as the reader is used; `close` frees the event sets.

    Args:
        devices: the devices to watch (`nvml.resolve_devices`); a MIG device is read through its parent GPU.
        xid_hold_s: seconds an XID shows after a poll saw it; then it is dropped.
        clock: the time XIDs are stamped with and expire by (`time.time`: Unix seconds, which Prometheus can take).

    Raises:
        ValueError: for a `xid_hold_s` that is not a positive number.

    Example::

        reader = HealthReader(resolve_devices([0, 1]))
        for card in reader.poll():
            print(card.index, card.summary())
    """

    def __init__(
        self,
        devices: Sequence[GpuDevice],
        *,
        xid_hold_s: float = DEFAULT_XID_HOLD_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not xid_hold_s > 0:
            raise ValueError(f"`xid_hold_s={xid_hold_s!r}` must be a positive number of seconds, e.g. 3600.")
        self.xid_hold_s = float(xid_hold_s)
        self._clock = clock
        self._cards = [_Card(device, device.parent or device.handle) for device in devices]

    def poll(self) -> list[CardHealth]:
        """One reading of every card, in the order of `devices`; never raises."""
        now = self._clock()
        return [self._poll_card(card, now) for card in self._cards]

    def close(self) -> None:
        """Free the event sets; never raises."""
        for card in self._cards:
            if card.event_set is not None:
                try:
                    nvml.pynvml.nvmlEventSetFree(card.event_set)
                except Exception:  # a lost card or NVML shut down already: nothing left to free
                    pass
                card.event_set, card.events_ready = None, True

    # one card
    def _poll_card(self, card: _Card, now: float) -> CardHealth:
        card.error = ""
        if not card.device.accessible:
            card.error = card.device.why
        elif not card.lost:
            try:
                self._read(card, now)
            except _Lost:
                card.lost = True
            except Exception as err:  # a bug or an odd binding must not stop training: reported on the card
                card.error = f"{type(err).__name__}: {err}"
        if card.xid_time is not None and now - card.xid_time >= self.xid_hold_s:
            card.xid = card.xid_time = None
        age = None if card.xid_time is None else max(0.0, float(now) - card.xid_time)
        values = {key: value for key, value in card.values.items() if key in _READINGS}
        return CardHealth(
            card.device.index,
            card.device.uuid,
            lost=card.lost,
            xid=card.xid,
            xid_time=card.xid_time,
            xid_age_s=age,
            error=card.error,
            **values,
        )

    def _read(self, card: _Card, now: float) -> None:
        if not card.events_ready:
            self._register(card)
        if card.event_set is not None:
            self._drain(card, now)
        values = card.values
        for kind, error_type in _ERROR_TYPES:
            for counter, counter_type in _COUNTERS:
                count = self._ask(card, "nvmlDeviceGetTotalEccErrors", error_type, counter_type)
                values[f"ecc_{kind}_{counter}"] = None if count is None else int(count)
        rows = self._ask(card, "nvmlDeviceGetRemappedRows")
        if rows is not None:
            corrected, uncorrected, pending, failure = rows
            values.update(
                remapped_rows_corrected=int(corrected),
                remapped_rows_uncorrected=int(uncorrected),
                row_remap_pending=bool(pending),
                row_remap_failure=bool(failure),
            )
        elif ("nvmlDeviceGetRemappedRows",) in card.skip:  # before Ampere: retired pages instead
            for cause, source in _CAUSES:
                pages = self._ask(card, "nvmlDeviceGetRetiredPages", source)
                values[f"retired_pages_{cause}"] = None if pages is None else len(pages)
            pending = self._ask(card, "nvmlDeviceGetRetiredPagesPendingStatus")
            values["retired_pages_pending"] = None if pending is None else int(pending) == _FEATURE_ENABLED

    def _ask(self, card: _Card, function: str, *args: Any) -> Any:
        """`pynvml.<function>(card's handle, *args)`, or None where the card does not give it (remembered) or it
        failed (named in `card.error`).

        Raises:
            _Lost: the card answered GPU_IS_LOST.
        """
        key = (function, *args)
        if key in card.skip:
            return None
        try:
            return getattr(nvml.pynvml, function)(card.handle, *args)
        except Exception as err:
            self._failed(card, key, err)
            return None

    def _failed(self, card: _Card, key: tuple[Any, ...], err: BaseException) -> None:
        if getattr(err, "value", None) == _GPU_IS_LOST:
            raise _Lost from err
        if unsupported(err):
            card.skip.add(key)
        else:
            card.error = f"{key[0]}: {type(err).__name__}: {err}"

    def _register(self, card: _Card) -> None:
        """Create the card's event set and register the XID and ECC events it supports (XID alone where the driver
        does not say which it supports)."""
        supported = self._ask(card, "nvmlDeviceGetSupportedEventTypes")
        wanted = _XID_EVENT if supported is None else _EVENTS & int(supported)
        if card.error or not wanted:
            card.events_ready = not card.error  # a failure is tried again next poll
            return
        pynvml = nvml.pynvml
        event_set = None
        try:
            event_set = pynvml.nvmlEventSetCreate()
            pynvml.nvmlDeviceRegisterEvents(card.handle, wanted, event_set)
        except Exception as err:
            if event_set is not None:
                try:
                    pynvml.nvmlEventSetFree(event_set)
                except Exception:  # freeing after a failed registration: nothing more to do
                    pass
            card.events_ready = unsupported(err)
            self._failed(card, ("nvmlDeviceRegisterEvents",), err)
            return
        card.event_set, card.events_ready = event_set, True

    def _drain(self, card: _Card, now: float) -> None:
        """Take the events waiting in the card's set, without blocking."""
        for _ in range(_DRAIN):
            try:
                data = getattr(nvml.pynvml, card.wait)(card.event_set, 0)
            except Exception as err:
                if getattr(err, "value", None) == _TIMEOUT:  # none waiting
                    return
                if card.wait == _WAIT and unsupported(err):  # a driver without the _v2 symbol
                    card.wait = _WAIT_V1
                    continue
                if unsupported(err):
                    card.event_set = None
                self._failed(card, (card.wait,), err)
                return
            kind = int(data.eventType)
            if kind & _XID_EVENT:
                card.xid, card.xid_time = int(data.eventData), float(now)
            if kind & _SINGLE_BIT_EVENT:
                card.values["single_bit_events"] = card.values.get("single_bit_events", 0) + 1
            if kind & _DOUBLE_BIT_EVENT:
                card.values["double_bit_events"] = card.values.get("double_bit_events", 0) + 1
