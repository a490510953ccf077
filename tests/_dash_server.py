"""Start a real `accel-dash` in a subprocess and stop it: `with dash_server([...]) as (url, proc): ...`.

`module` picks what runs (`lightning_accel.dash`, or `_fake_dash`, which first installs a fake NVML); the URL is read
from the line accel-dash prints once it listens (`--port 0` picks a free port, so tests never collide).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from _env import clean_env
from _wait import wait_until

TESTS = Path(__file__).parent


@contextmanager
def dash_server(
    args: Sequence[str], module: str = "lightning_accel.dash", env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    full_env = clean_env(
        PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), PYTHONUNBUFFERED="1", **(env or {})
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        start_new_session=True,
    )
    try:
        line = wait_until(
            lambda: _first_line(proc),
            timeout_s=60,
            what="accel-dash to listen",
            detail=lambda: proc.stderr.read() if proc.poll() is not None else "",
        )
        match = re.search(r"http://\S+/", line)
        assert match, line
        yield match.group(0).rstrip("/"), proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        proc.stderr_text = proc.stderr.read()  # type: ignore[attr-defined]  # what it said, for the test to read
        proc.stdout.close()
        proc.stderr.close()


def _first_line(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is not None:
        raise AssertionError(f"accel-dash exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
    return proc.stdout.readline()
