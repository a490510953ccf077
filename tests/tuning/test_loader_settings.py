"""The DataLoader setting names have one home: `tuning.dataloader.loader_settings.LOADER_KEYS`; a rebuilt loader
draws from the random streams as the user's."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import lightning_accel
from lightning_accel.autotune.search import Space
from lightning_accel.tuning.dataloader.loader_settings import LOADER_KEYS, LoaderSettings
from lightning_accel.tuning.dataloader.timing import SeedKeepingDataLoader, rebuild_loader


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


def _epochs(loader: DataLoader, epochs: int) -> tuple[list[list[int]], torch.Tensor]:
    """Each epoch's sample order and a dropout-like draw after it, from a seeded global RNG."""
    torch.manual_seed(0)
    orders, draws = [], []
    for _ in range(epochs):
        orders.append([int(i) for batch in loader for i in batch])
        draws.append(torch.rand(()))
    return orders, torch.stack(draws)


def test_workers_made_persistent_draw_from_the_random_streams_as_the_users_loader() -> None:
    """A persistent iterator is reused and draws no base seed on later epochs; the rebuilt loader draws it, so the
    shuffle and the draws between epochs are the user's loader's (and a plain persistent loader's are not)."""
    users = DataLoader(range(12), batch_size=4, shuffle=True)
    persistent = LoaderSettings(num_workers=1, prefetch_factor=2, persistent_workers=True)
    rebuilt = rebuild_loader(users, persistent)
    assert isinstance(rebuilt, SeedKeepingDataLoader)
    assert isinstance(rebuild_loader(rebuilt, persistent), SeedKeepingDataLoader)  # tuned again: still the user's
    plain = DataLoader(range(12), batch_size=4, shuffle=True, num_workers=1, persistent_workers=True)
    expected = _epochs(users, 3)
    got = _epochs(rebuilt, 3)
    assert got[0] == expected[0] and torch.equal(got[1], expected[1])
    drifted = _epochs(plain, 3)
    assert drifted[0][0] == expected[0][0] and drifted[0][1:] != expected[0][1:]  # the drift this loader removes
    already = rebuild_loader(plain, persistent)  # the user's own persistent workers: drawn as theirs, once
    assert type(already) is DataLoader and _epochs(already, 3)[0] == drifted[0]
