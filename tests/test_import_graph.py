"""The package's import graph, read from the source with `ast`: no circle of imports, and no module that imports one
of a higher floor (ARCHITECTURE.md's "Floors" table, which `FLOORS` mirrors).

Every import counts, wherever it stands: at the top of a module, inside a function, or under `if TYPE_CHECKING:`.
Relative imports are resolved; `import a.b` and `from a.b import c` count `a.b` and the `__init__` of each package
above it (Python runs them first), except the importer's own packages (already running) and the package root, whose
`__init__` imports nothing at run time (`test_the_package_root_imports_nothing_at_run_time`). `from a import b`
counts the module `a.b` when there is one (and `a` as the package above it), else `a`.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_accel"
# Where each installed package's files are (pyproject.toml's `package-dir`; `test_the_source_roots_are_pyprojects`).
SOURCES = {
    PACKAGE: REPO / "lightning_accel",
    f"{PACKAGE}.conf": REPO / "conf",
    f"{PACKAGE}.examples": REPO / "examples",
}

FLOORS: dict[str, int] = {
    **dict.fromkeys(("system", "telemetry", "measure", "errors", "patching", "batches", "files", "signals"), 0),
    **dict.fromkeys(
        ("_lightning", "callbacks", "strategies", "parallel", "tuning", "schedules", "precision", "summary"), 1
    ),
    **dict.fromkeys(("schema", "targets", "conf"), 2),
    **dict.fromkeys(("shape", "thread_env"), 3),
    "checks": 4,
    "run_plan": 5,
    **dict.fromkeys(("launch", "app_config", "compose", "benchmark", "autotune"), 6),
    **dict.fromkeys(("train", "train_entry", "doctor", "bench", "tune", "gpu_check", "dash", "examples"), 7),
}
"""Each room (a top-level module or package of `lightning_accel`) and its floor: ARCHITECTURE.md's table, mirrored.
A module may import its own floor and those below."""

KNOWN_ARROWS: dict[tuple[str, str], str] = {}
"""Arrows the checks below leave out, each with why; the list only shrinks."""


@dataclass(frozen=True)
class Arrow:
    source: str
    target: str
    line: int

    def __str__(self) -> str:
        return f"{_path_of(self.source)}:{self.line} -> {self.target}"


def _path_of(module: str) -> str:
    for prefix, folder in sorted(SOURCES.items(), key=lambda item: -len(item[0])):
        if module == prefix or module.startswith(prefix + "."):
            rest = module[len(prefix) :].lstrip(".").replace(".", "/")
            path = folder / rest
            found = path / "__init__.py" if (path / "__init__.py").is_file() else path.with_suffix(".py")
            return str(found.relative_to(folder.parent))
    raise KeyError(module)


def package_modules() -> dict[str, Path]:
    """`{dotted name: file}` for every module of the installed package (`__init__.py` is its package's name)."""
    found: dict[str, Path] = {}
    for prefix, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if any(not part.isidentifier() for part in parts):
                continue  # not importable (a data folder's script)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((prefix, *parts))] = path
    return found


def _is_within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def imports_of(name: str, path: Path, modules: set[str]) -> list[Arrow]:
    """The arrows from `name` (at `path`) to other modules of the package, as Python would run them."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    arrows: list[Arrow] = []

    def add(target: str, line: int) -> None:
        parts = target.split(".")
        for size in range(2, len(parts) + 1):  # the package root's `__init__` is left out (see the docstring)
            module = ".".join(parts[:size])
            implicit = size < len(parts)
            if module not in modules or module == name or (implicit and _is_within(name, module)):
                continue
            arrows.append(Arrow(name, module, line))

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            named = [f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in modules]
            for module in named:  # `from pkg import module`: the module, and `pkg` as the package above it
                add(module, node.lineno)
            if len(named) < len(node.names):  # a name defined in `source` itself
                add(source, node.lineno)
    return sorted(set(arrows), key=lambda a: (a.target, a.line))


def import_graph() -> dict[str, list[Arrow]]:
    modules = package_modules()
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def strongly_connected(graph: dict[str, list[Arrow]]) -> list[list[str]]:
    """The strongly connected components of `graph` (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, child = work.pop()
            if child == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            targets = [a.target for a in graph.get(node, [])]
            if child < len(targets):
                work.append((node, child + 1))
                target = targets[child]
                if target not in index:
                    work.append((target, 0))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return components


def without_known(graph: dict[str, list[Arrow]]) -> dict[str, list[Arrow]]:
    return {name: [a for a in arrows if (a.source, a.target) not in KNOWN_ARROWS] for name, arrows in graph.items()}


def circles(graph: dict[str, list[Arrow]]) -> list[str]:
    """Each circle: its modules and the arrows between them, with the file and line of each."""
    found = []
    for component in strongly_connected(graph):
        if len(component) > 1:
            members = set(component)
            arrows = [str(a) for name in component for a in graph[name] if a.target in members]
            found.append(f"circle of {', '.join(component)}:\n    " + "\n    ".join(arrows))
    return found


def room(module: str) -> str:
    """`lightning_accel.checks.combinations` -> `checks`; `lightning_accel.conf` -> `conf`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def arrows_up(graph: dict[str, list[Arrow]], floors: dict[str, int]) -> list[str]:
    return [
        f"{arrow} (floor {floors[room(arrow.source)]} imports floor {floors[room(arrow.target)]})"
        for arrows in graph.values()
        for arrow in arrows
        if room(arrow.source) in floors
        and room(arrow.target) in floors
        and floors[room(arrow.target)] > floors[room(arrow.source)]
    ]


def architecture_floors(text: str) -> dict[str, int]:
    """The "Floors" table of ARCHITECTURE.md: `| 3 shape | `shape.py`, `threads.py` |` -> {shape: 3, threads: 3}."""
    section = text.split("\n## Floors", 1)[1].split("\n## ", 1)[0]
    floors: dict[str, int] = {}
    for row in re.findall(r"^\| *(\d+) [^|]*\|([^|]*)\|", section, flags=re.MULTILINE):
        for name in re.findall(r"`([\w]+)(?:\.py|/)`", row[1]):
            floors[name] = int(row[0])
    return floors


def test_the_table_here_is_architecture_md_s() -> None:
    text = (REPO / "lightning_accel" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    assert architecture_floors(text) == FLOORS


def test_every_room_has_a_floor() -> None:
    rooms = {room(name) for name in package_modules()} - {""}
    assert rooms - set(FLOORS) == set(), "a new room: give it its floor in ARCHITECTURE.md's Floors table and FLOORS"
    assert set(FLOORS) - rooms == set(), "a floor for a room that is gone"


def test_the_source_roots_are_pyprojects() -> None:
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    for prefix, folder in SOURCES.items():
        assert f'"{prefix}" = "{folder.name}"' in pyproject


def test_the_package_root_imports_nothing_at_run_time() -> None:
    """The root's `__init__` (left out of the graph) names its public names' homes only for type checkers."""
    tree = ast.parse((REPO / "lightning_accel" / "__init__.py").read_text(encoding="utf-8"))
    runtime = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert [ast.unparse(node) for node in runtime if PACKAGE in ast.unparse(node)] == []


def test_no_circle_of_imports() -> None:
    assert circles(without_known(import_graph())) == []


def test_no_module_imports_a_higher_floor() -> None:
    assert arrows_up(without_known(import_graph()), FLOORS) == []


def test_each_known_arrow_still_exists() -> None:
    """An allowed arrow that is gone is deleted from `KNOWN_ARROWS`, so the list cannot hide a new one later."""
    graph = import_graph()
    present = {(a.source, a.target) for arrows in graph.values() for a in arrows}
    assert set(KNOWN_ARROWS) - present == set()


def _graph_of(tmp_path: Path, files: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Arrow]]:
    root = tmp_path / "lightning_accel"
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    monkeypatch.setitem(SOURCES, PACKAGE, root)
    monkeypatch.delitem(SOURCES, f"{PACKAGE}.conf")
    monkeypatch.delitem(SOURCES, f"{PACKAGE}.examples")
    return import_graph()


def test_the_graph_sees_lazy_type_only_relative_and_parent_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    graph = _graph_of(
        tmp_path,
        {
            "__init__.py": "",
            "low.py": "def f():\n    from lightning_accel.high import g\n",
            "high.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .pkg.leaf import X\n",
            "pkg/__init__.py": "from lightning_accel import low\n",
            "pkg/leaf.py": "from . import sibling\nimport lightning_accel.pkg.sibling\n",
            "pkg/sibling.py": "",
        },
        monkeypatch,
    )
    assert [(a.target, a.line) for a in graph["lightning_accel.low"]] == [("lightning_accel.high", 2)]
    assert [(a.target, a.line) for a in graph["lightning_accel.high"]] == [
        ("lightning_accel.pkg", 3),  # the package above the module runs first
        ("lightning_accel.pkg.leaf", 3),
    ]
    # the importer's own package is running already; the named sibling counts, once per line
    assert [(a.target, a.line) for a in graph["lightning_accel.pkg.leaf"]] == [
        ("lightning_accel.pkg.sibling", 1),
        ("lightning_accel.pkg.sibling", 2),
    ]
    found = circles(graph)
    assert len(found) == 1 and "lightning_accel.high, lightning_accel.low, lightning_accel.pkg" in found[0]
    assert "low.py:2 -> lightning_accel.high" in found[0] and "pkg/__init__.py:1 -> lightning_accel.low" in found[0]
    floors = {"low": 0, "high": 1, "pkg": 1}
    assert arrows_up(graph, floors) == ["lightning_accel/low.py:2 -> lightning_accel.high (floor 0 imports floor 1)"]
