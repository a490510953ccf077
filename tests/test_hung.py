"""The test helpers' hang reports: a torchrun launch that hangs fails with every rank's Python stacks."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from _torchrun import torchrun

HANGS = """
import os, time

def wait_for_a_peer_that_never_comes(rank):
    print("rank", rank, "waiting", flush=True)
    time.sleep(3600)

wait_for_a_peer_that_never_comes(os.environ["RANK"])
"""


def test_a_hung_torchrun_launch_reports_where_each_rank_waits(tmp_path: Path) -> None:
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    with pytest.raises(subprocess.TimeoutExpired) as err:
        torchrun(script, ranks=2, timeout=15)
    stderr = err.value.stderr
    assert isinstance(stderr, str)
    assert stderr.count("in wait_for_a_peer_that_never_comes") == 2, stderr[-3000:]  # both ranks' stacks
    assert "Extension modules" not in stderr  # faulthandler's module lists are left out
