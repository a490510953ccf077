"""The test helpers' hang reports: a torchrun launch that hangs fails with every rank's Python stacks."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from _torchrun import torchrun

HANGS = """
import faulthandler, os, signal, sys, time

def wait_for_a_peer_that_never_comes(rank):
    print("rank", rank, "waiting", flush=True)
    time.sleep(3600)

def stacks_in_turn(signum, frame):  # launcher and ranks share one stderr: each writes its stacks in turn
    time.sleep(2 + 2 * int(os.environ["RANK"]))  # after the launcher's own stacks, which come at once
    faulthandler.dump_traceback(sys.stderr)
    os._exit(1)

signal.signal(signal.SIGABRT, stacks_in_turn)
wait_for_a_peer_that_never_comes(os.environ["RANK"])
"""


@pytest.mark.slow
def test_a_hung_torchrun_launch_reports_where_each_rank_waits(tmp_path: Path) -> None:
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    with pytest.raises(subprocess.TimeoutExpired) as err:
        torchrun(script, ranks=2, timeout=15)
    stderr = err.value.stderr
    assert isinstance(stderr, str)
    assert stderr.count("in wait_for_a_peer_that_never_comes") == 2, stderr[-3000:]  # both ranks' stacks
    assert "Extension modules" not in stderr  # faulthandler's module lists are left out
