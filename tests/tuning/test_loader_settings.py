"""The DataLoader setting names have one home: `tuning.dataloader.settings.LOADER_KEYS`."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from torch.utils.data import DataLoader

import lightning_accel
from lightning_accel.autotune.search import Space
from lightning_accel.tuning.dataloader.settings import LOADER_KEYS, LoaderSettings


def test_the_names_are_the_tuners_settings_and_dataloader_arguments() -> None:
    assert set(LOADER_KEYS) == set(LoaderSettings().as_dict())
    assert set(LOADER_KEYS) <= set(inspect.signature(DataLoader).parameters)
    assert Space().loader_keys <= frozenset(LOADER_KEYS)  # accel-tune pins only what the presets may set


def test_no_other_module_spells_the_list_out() -> None:
    package = Path(lightning_accel.__file__).parent
    spelled = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                names = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                if len(names & set(LOADER_KEYS)) >= 3:
                    spelled.append(f"{path.relative_to(package)}:{node.lineno}")
    assert spelled == []
