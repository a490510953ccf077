"""The built wheel ships `py.typed` (PEP 561), so type checkers read lightning_accel's annotations, and each of its
console scripts names a function that exists."""

from __future__ import annotations

import configparser
import importlib
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
    names = zipfile.ZipFile(wheel).namelist()
    assert "lightning_accel/py.typed" in names
    entry_points = configparser.ConfigParser(delimiters=("=",))
    entry_points.read_string(
        zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    )
    scripts = dict(entry_points["console_scripts"])
    assert scripts["accel-train"] == "lightning_accel.train_entry:accel_train"
    for name, target in scripts.items():  # the installed `accel-train` & co call these
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function, None)), f"{name} = {target}"
