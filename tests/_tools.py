"""Real outside tools the end-to-end tests drive (Chromium, Prometheus, promtool): where to find them, and what to do
when one is missing. On a developer's machine the test skips, saying what to install; where `ACCEL_REQUIRE_TOOLS=1`
(`.ci/run` sets it, after installing them) a missing tool fails the test instead, so CI never passes by skipping."""

from __future__ import annotations

import os
import shutil

import pytest

REQUIRE_ENV = "ACCEL_REQUIRE_TOOLS"
INSTALL = {
    "chromium": "apt-get install -y chromium",
    "prometheus": "apt-get install -y prometheus",
    "promtool": "apt-get install -y prometheus",
    "playwright": "pip install 'lightning_accel[dev]'",
}


def missing(what: str, why: str) -> None:
    """Skip (or, under ACCEL_REQUIRE_TOOLS=1, fail) because `what` is missing."""
    message = f"{what} is missing ({why}); install it with `{INSTALL.get(what, what)}`"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{message}: {REQUIRE_ENV}=1 requires it", pytrace=False)
    pytest.skip(message)


def tool(name: str, *candidates: str) -> str:
    """The path of the executable `name` (or of the first of `candidates` found)."""
    for candidate in (name, *candidates):
        path = shutil.which(candidate)
        if path:
            return path
    missing(name, "not on PATH")
    raise AssertionError("unreachable")
