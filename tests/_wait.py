"""Waiting in tests: poll a condition until it holds; at the deadline, fail naming what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str,
    *,
    interval_s: float = 0.02,
    detail: Callable[[], str] | None = None,
) -> T:
    """Call `predicate` every `interval_s` until it returns something true, and return that.

    An exception raised by `predicate` ends the wait at once (an assertion that the awaited process still runs, say).

    Args:
        predicate: the condition; its first true result is returned.
        timeout_s: how long to wait, from the first call.
        what: what is awaited, for the message ("the first checkpoint").
        interval_s: the pause between two calls.
        detail: called at the deadline; its text ends the message (a log's tail, say).

    Raises:
        TimeoutError: `predicate` was still false after `timeout_s`; the message names `what`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            extra = f"\n{detail()}" if detail is not None else ""
            raise TimeoutError(f"waited {timeout_s:g} s for {what}, in vain{extra}")
        time.sleep(interval_s)
