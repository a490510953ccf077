"""The layering of ARCHITECTURE.md, enforced: each module is imported in a fresh interpreter, and what it brought
into `sys.modules` may hold nothing of a higher layer (this package's modules, Lightning, Hydra/OmegaConf).

    facts        system/, telemetry/, measure, errors, patching, batches, files, signals  -> Python, torch, pynvml
    behaviour    _lightning, callbacks/, strategies/, parallel/, tuning/, schedules, precision, summary  -> + lightning
    composition  schema, targets, shape, thread_env, checks/, run_plan, app_config, compose, launch, benchmark/,
                 autotune/, and the commands: train (entered through train_entry), doctor, bench, tune, gpu_check,
                 dash/ (their floors: tests/test_import_graph.py)
                 -> + hydra, omegaconf
"""

from __future__ import annotations

import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_accel

FACTS = ("system", "telemetry", "measure", "errors", "patching", "batches", "files", "signals")
BEHAVIOUR = ("_lightning", "callbacks", "strategies", "parallel", "tuning", "schedules", "precision", "summary")
COMPOSITION = (
    "targets",
    "shape",
    "run_plan",
    "schema",
    "checks",
    "app_config",
    "compose",
    "launch",
    "thread_env",
    "benchmark",
    "autotune",
    "train",
    "train_entry",
    "doctor",
    "bench",
    "tune",
    "gpu_check",
    "dash",
    "conf",
    "examples",
)
LAYERS = {name: 0 for name in FACTS} | {name: 1 for name in BEHAVIOUR} | {name: 2 for name in COMPOSITION}
# Third-party packages a layer may not bring in, by layer.
FORBIDDEN = {0: ("lightning", "hydra", "omegaconf"), 1: ("hydra", "omegaconf"), 2: ()}


def _room(module: str) -> str:
    """`lightning_accel.strategies.pipeline.runner` -> `strategies`; the package itself -> ``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _loaded_after_import(modules: list[str]) -> dict[str, list[str]]:
    """For each module, in order, in one fresh interpreter (after `import lightning_accel`): what importing it added
    to `sys.modules`. Modules of one layer share the interpreter, so what one of them brings in is charged to the
    first that brought it; anything of a higher layer shows up under some module of the layer."""
    script = (
        "import importlib, json, sys\n"
        "import lightning_accel\n"
        "out = {}\n"
        "for name in json.loads(sys.argv[1]):\n"
        "    before = set(sys.modules)\n"
        "    importlib.import_module(name)\n"
        "    out[name] = sorted(set(sys.modules) - before)\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(modules)], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(done.stdout)


def violations(module: str, loaded: list[str], layer: int) -> list[str]:
    """What `module` (of `layer`) brought in that belongs to a higher layer."""
    found = sorted({name.split(".")[0] for name in loaded} & set(FORBIDDEN[layer]))
    for name in loaded:
        room = _room(name)
        if name.startswith("lightning_accel.") and LAYERS.get(room, 0) > layer:
            found.append(name)
    return found


def _modules_of(layer: int) -> list[str]:
    return sorted(
        info.name
        for info in pkgutil.walk_packages(lightning_accel.__path__, "lightning_accel.")
        if LAYERS.get(_room(info.name)) == layer and not info.name.endswith("__main__")
    )


def test_every_module_has_a_layer() -> None:
    rooms = {_room(info.name) for info in pkgutil.walk_packages(lightning_accel.__path__, "lightning_accel.")}
    assert rooms - set(LAYERS) == set(), "a new room: give it its layer in LAYERS (and in ARCHITECTURE.md)"


def test_importing_the_package_brings_in_no_lightning_and_no_hydra() -> None:
    script = "import sys, lightning_accel; print(sorted({n.split('.')[0] for n in sys.modules}))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert not {"lightning", "hydra", "omegaconf", "pynvml_utils"} & set(eval(done.stdout))  # noqa: S307


@pytest.mark.parametrize("layer", [0, 1])
def test_no_module_imports_a_higher_layer(layer: int) -> None:
    modules = _modules_of(layer)
    assert modules, f"no module in layer {layer}"
    loaded = _loaded_after_import(modules)
    broken = {name: found for name in modules if (found := violations(name, loaded[name], layer))}
    assert broken == {}


def _named_imports(path) -> list[tuple[int, str]]:
    """`(line, module)` for every import statement in a file, wherever it stands: at the top, inside a function, or
    under `if TYPE_CHECKING:` (which the import-time check above cannot see)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            if node.module == "lightning_accel":  # `from lightning_accel import compose`
                found += [(node.lineno, f"lightning_accel.{alias.name}") for alias in node.names]
    return found


def _names_above(layer: int, imports: list[tuple[int, str]]) -> list[str]:
    return [
        f"line {line}: {name}"
        for line, name in imports
        if name.split(".")[0] in FORBIDDEN[layer]
        or (name.startswith("lightning_accel.") and LAYERS.get(_room(name), 0) > layer)
    ]


@pytest.mark.parametrize("layer", [0, 1])
def test_no_module_names_a_higher_layer_even_for_types_or_lazily(layer: int) -> None:
    """Type-only and function-level imports count too: a behaviour module that names a composition type (even under
    `if TYPE_CHECKING:`) depends on it."""
    from pathlib import Path

    root = Path(lightning_accel.__file__).parent
    broken = {}
    for name in _modules_of(layer):
        relative = name.removeprefix("lightning_accel.").replace(".", "/")
        path = root / f"{relative}.py" if (root / f"{relative}.py").exists() else root / relative / "__init__.py"
        if found := _names_above(layer, _named_imports(path)):
            broken[name] = found
    assert broken == {}


def test_the_source_check_sees_an_import_under_type_checking(tmp_path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_accel.run_plan import RunShape\n"
        "def f():\n    import hydra\n"
    )
    assert _names_above(1, _named_imports(module)) == ["line 3: lightning_accel.run_plan", "line 5: hydra"]


def test_the_check_catches_a_lower_layer_that_imports_a_higher_one() -> None:
    """The composition helpers, checked as if they were a callback (layer 1), break the rules (Hydra, the shape)."""
    loaded = _loaded_after_import(["lightning_accel.compose"])["lightning_accel.compose"]
    found = violations("lightning_accel.compose", loaded, 1)
    assert "hydra" in found and "lightning_accel.shape" in found
    assert violations("lightning_accel.compose", loaded, 2) == []


def _imported_names() -> dict[str, set[tuple[str, str]]]:
    """`{module: {(name, importing file)}}` for every `from lightning_accel... import name` in the package, the
    tests and the examples."""
    import ast
    from pathlib import Path

    here = Path(__file__).resolve().parents[1]
    found: dict[str, set[tuple[str, str]]] = {}
    for root in ("lightning_accel", "tests", "examples"):
        for path in (here / root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.ImportFrom)
                    and node.level == 0
                    and (node.module or "").startswith("lightning_accel")
                ):
                    found.setdefault(node.module or "", set()).update((a.name, path.name) for a in node.names)
    return found


def test_every_all_is_complete_and_true() -> None:
    """Each module has an `__all__`; it names only what exists, every public function and class the module defines,
    and every public name that another module (or a test, or an example) imports from it."""
    import importlib
    import importlib.util
    import inspect

    imported = _imported_names()
    problems = []
    for info in pkgutil.walk_packages(lightning_accel.__path__, "lightning_accel."):
        module = importlib.import_module(info.name)
        public = getattr(module, "__all__", None)
        if public is None:
            problems.append(f"{info.name}: no __all__")
            continue
        problems += [
            f"{info.name}.__all__ names {name}, which does not exist" for name in public if not hasattr(module, name)
        ]
        defined = [
            name
            for name, value in vars(module).items()
            if not name.startswith("_")
            and (inspect.isfunction(value) or inspect.isclass(value))
            and value.__module__ == info.name
        ]
        problems += [
            f"{info.name} defines {name}, which its __all__ leaves out (or name it _{name})"
            for name in defined
            if name not in public
        ]
        for name, where in sorted(imported.get(info.name, ())):
            submodule = info.ispkg and importlib.util.find_spec(f"{info.name}.{name}") is not None
            if not name.startswith("_") and name != "*" and name not in public and not submodule:
                problems.append(f"{where} imports {info.name}.{name}, which its __all__ leaves out")
    assert problems == []


def test_every_test_module_has_its_own_name() -> None:
    # pytest imports test modules by basename (rootdir-relative, no packages): two tests/**/test_x.py stop collection.
    tests = Path(__file__).resolve().parent
    names: dict[str, list[str]] = {}
    for path in tests.rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}


def test_code_cites_only_what_the_repo_holds() -> None:
    # the issue tracker and the team's style notes are not in the repo: cite neither by number
    root = Path(__file__).resolve().parents[1]
    cited = []
    for folder in ("lightning_accel", "tests", "conf", "examples", "hydra_plugins", "README.md"):
        for path in (root / folder).rglob("*") if (root / folder).is_dir() else [root / folder]:
            if path.suffix in (".py", ".yaml", ".md") and path.is_file():
                for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                    if re.search(r"STYLE habit|STYLE\.md|\b[Ii]ssue \d+\b", line) and "github.com" not in line:
                        cited.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert cited == []


def test_the_formatter_is_never_switched_off() -> None:
    root = Path(__file__).resolve().parents[1]
    markers = ("fmt" + ": " + "skip", "fmt" + ": " + "off")  # spelled apart, so that this file does not hold them
    found = [
        str(path.relative_to(root))
        for folder in ("lightning_accel", "tests", "examples", "conf", "hydra_plugins")
        for path in (root / folder).rglob("*.py")
        if any(marker in path.read_text(encoding="utf-8") for marker in markers)
    ]
    assert found == []
