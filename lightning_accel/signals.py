"""The stop signal this process received and has not acted on yet, shared by whoever can act on it.

`StopOnSignal` notes a signal here from its handler; work that runs before the training loop (the DataLoaderTuner's
trials) asks `pending_signal()` between its steps and ends with `SignalExit` instead of running on for a minute. Plain
Python: the tuners import it without importing a callback.
"""

from __future__ import annotations

__all__ = ["SignalExit", "clear_signal", "note_signal", "pending_signal"]

_pending = 0


class SignalExit(SystemExit):
    """Raised on every rank at the step where the ranks agreed to stop; the process exits with 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def note_signal(signum: int) -> None:
    """Record `signum` (from a signal handler: no I/O, no lock)."""
    global _pending
    _pending = signum


def clear_signal() -> None:
    """The pending signal was acted on, or its handler is gone."""
    global _pending
    _pending = 0


def pending_signal() -> int:
    """The stop signal received and not acted on yet; 0 if none."""
    return _pending
