"""The stop signal this process received and has not acted on yet, shared by whoever can act on it, and how many
stop signals arrived since the stop began.

`StopOnSignal` notes a signal here from its handler; work that runs before the training loop (the DataLoaderTuner's
trials) asks `pending_signal()` between its steps and ends with `SignalExit` instead of running on for a minute.

A user who insists gets a faster way out, whoever holds the handler at that moment: the first SIGINT or SIGTERM stops
at the next step with a checkpoint; a second, while the first is being handled, changes nothing but is said (the
process still ends with 128 + N of the first once the checkpoint is written); a third ends the process at once with
that code (`end_at_once`). A command that owns its process (accel-train) keeps `exit_on_signals` installed around the
run, so a signal that comes after the callback's handler is gone (while the stop unwinds, a checkpoint is flushed, the
loggers close) still counts, instead of killing the process by the signal (exit -2) or raising `KeyboardInterrupt`.
Plain Python: the tuners import it without importing a callback.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType

__all__ = [
    "SignalExit",
    "clear_signal",
    "end_at_once",
    "exit_on_signals",
    "forget_stop",
    "insist",
    "note_signal",
    "pending_signal",
    "stop_signal",
]

_pending = 0  # received, not acted on yet
_first = 0  # the first stop signal of the stop under way (kept once acted on: the process is on its way out)
_count = 0  # stop signals received since `_first`


class SignalExit(SystemExit):
    """Raised on every rank at the step where the ranks agreed to stop; the process exits with 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def note_signal(signum: int) -> int:
    """Record `signum` (from a signal handler: no I/O, no lock); returns how many stop signals arrived since the
    stop began, this one included (1: the first)."""
    global _pending, _first, _count
    _pending = _pending or signum
    _first = _first or signum
    _count += 1
    return _count


def clear_signal() -> None:
    """The pending signal was acted on, or its handler is gone (the count of the stop under way is kept)."""
    global _pending
    _pending = 0


def pending_signal() -> int:
    """The stop signal received and not acted on yet; 0 if none."""
    return _pending


def stop_signal() -> int:
    """The first signal of the stop under way (acted on or not); 0 if none."""
    return _first


def forget_stop() -> None:
    """A new fit starts with no stop under way (a notebook's next fit after a stopped one)."""
    global _pending, _first, _count
    _pending = _first = _count = 0


def end_at_once(signum: int, why: str = "") -> None:
    """End the process now with 128 + `signum`: no checkpoint, no cleanup (the last checkpoint written stands: every
    save is atomic). Says so on stderr first (`os.write`: the main thread may hold the stream's lock)."""
    name = signal.Signals(signum).name
    os.write(2, f"{why or 'a third stop signal'}: ending at once with exit {128 + signum} ({name})\n".encode())
    os._exit(128 + signum)


def insist(signum: int, count: int, who: str) -> None:
    """What a second or later stop signal does (`count` from `note_signal`): the second is said, the third and any
    after it end the process at once with 128 + the first signal."""
    first = _first or signum
    if count >= 3:
        end_at_once(first, f"{who}: {signal.Signals(signum).name} a third time")
    if count == 2:
        text = (
            f"{who}: {signal.Signals(signum).name} again: the stop goes on and the process exits {128 + first} once "
            "the checkpoint is written; a third signal ends it at once\n"
        )
        os.write(2, text.encode())


def exit_on_signals(signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM)) -> Callable[[], None]:
    """Handlers for a command that owns its process (accel-train), for the time no callback holds the signals: before
    the Trainer's setup, between stages, and while a stop unwinds. A first signal here ends the run with `SignalExit`
    (nothing of a fit to save); a repeat during a stop counts towards the third, which ends the process at once. A
    signal the process inherited as ignored (`nohup`, a background job) stays ignored. Returns the undo.

    Once the interpreter exits (its `atexit` callbacks, after the threads are joined) the signals are ignored: the
    exit code is decided, and Python's finalization resets every handler it set to the default, so a signal during
    the slow rest of it (torch's modules torn down) would otherwise kill the process by the signal (exit -2).
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {}
    for number in signals:
        if signal.getsignal(number) is signal.SIG_IGN:
            continue
        previous[number] = signal.signal(number, _on_signal)

    def at_exit() -> None:  # the exit code is decided and the threads are joined
        for number in previous:
            signal.signal(number, signal.SIG_IGN)

    atexit.register(at_exit)

    def undo() -> None:
        atexit.unregister(at_exit)
        for number, handler in previous.items():
            if signal.getsignal(number) is _on_signal:
                signal.signal(number, handler)

    return undo


def _on_signal(signum: int, frame: FrameType | None) -> None:
    count = note_signal(signum)
    if count == 1:
        clear_signal()  # acted on here: the exit
        raise SignalExit(signum)
    insist(signum, count, "accel-train")
