"""The package's layout: no two modules share a file name and none is over `MAX_LINES` lines; the built wheel ships
every subpackage and `py.typed` (PEP 561), so type checkers read lightning_accel's annotations, and each of its
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
    shipped = set(zipfile.ZipFile(wheel).namelist())
    assert "lightning_accel/py.typed" in shipped
    packages = [p.relative_to(REPO).as_posix() for p in sorted((REPO / "lightning_accel").rglob("__init__.py"))]
    assert "lightning_accel/gpu_check/__init__.py" in packages
    assert [p for p in packages if p not in shipped] == [], "list these in pyproject.toml's [tool.setuptools] packages"
    entry_points = configparser.ConfigParser(delimiters=("=",))
    entry_points.read_string(
        zipfile.ZipFile(wheel).read(next(n for n in shipped if n.endswith("entry_points.txt"))).decode()
    )
    scripts = dict(entry_points["console_scripts"])
    assert scripts["accel-train"] == "lightning_accel.train_entry:accel_train"
    for name, target in scripts.items():  # the installed `accel-train` & co call these
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function, None)), f"{name} = {target}"


PACKAGE = REPO / "lightning_accel"
MAX_LINES = 600
"""No module of the package is longer: a file holds one idea (a module over it is split by what it holds)."""
SHARED = ("__init__.py", "__main__.py")
"""The file names every package may have."""
KNOWN: dict[str, str] = {}
"""Known exceptions, each on its way out in a branch of its own (none now). Delete an entry when its change lands: the
test fails on an entry nothing needs any more."""


def layout_problems(root: Path) -> list[str]:
    """Every file name two modules under `root` share (`SHARED` aside) and every module over `MAX_LINES` lines."""
    paths: dict[str, list[str]] = {}
    problems = []
    for path in sorted(root.rglob("*.py")):
        if path.name not in SHARED:
            paths.setdefault(path.name, []).append(path.relative_to(root).as_posix())
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES:
            problems.append(f"{path.name} is over {MAX_LINES} lines")
    problems += [f"duplicate name {name}" for name, found in paths.items() if len(found) > 1]
    return sorted(problems)


def test_no_two_modules_share_a_file_name_and_none_is_over_600_lines() -> None:
    problems = layout_problems(PACKAGE)
    assert [p for p in problems if p not in KNOWN] == [], "rename or split these (names that say what they hold)"
    assert [k for k in KNOWN if k not in problems] == [], "these have landed: delete their entries from KNOWN"


def test_the_layout_check_sees_a_shared_name_and_a_long_module(tmp_path: Path) -> None:
    for folder in ("a", "b", "b/c"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "a" / "settings.py").write_text("x = 1\n")
    (tmp_path / "b" / "c" / "settings.py").write_text("x = 1\n")
    (tmp_path / "b" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "b" / "just_fits.py").write_text("x = 1\n" * MAX_LINES)
    assert layout_problems(tmp_path) == ["duplicate name settings.py", f"long.py is over {MAX_LINES} lines"]
