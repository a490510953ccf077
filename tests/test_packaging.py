"""The built wheel ships `py.typed` (PEP 561), so type checkers read lightning_accel's annotations."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ("pyproject.toml", "README.md", "lightning_accel", "conf", "examples", "hydra_plugins")
"""What the wheel is built from: copied, so a stale `build/` of the checkout cannot put a deleted file back."""


def test_wheel_ships_py_typed(tmp_path: Path) -> None:
    source = tmp_path / "source"
    for name in SHIPPED:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    wheel = next(tmp_path.glob("lightning_accel-*.whl"))
    assert "lightning_accel/py.typed" in zipfile.ZipFile(wheel).namelist()
