"""What the tests read back from an accel-train run directory."""

from __future__ import annotations

import re
from pathlib import Path


def config_digests(run_dir: Path) -> dict[str, str]:
    """{log file name: sha256 of the resolved config it logged}, for every rank's log in `run_dir`."""
    found = {}
    for log_file in sorted(run_dir.glob("*.log")):
        match = re.search(r"resolved config sha256=([0-9a-f]{64})", log_file.read_text())
        assert match, f"{log_file} has no config digest"
        found[log_file.name] = match.group(1)
    return found
