"""Every callback on LightningModules we did not write (`zoo_modules.ZOO`): each cell of examples/callbacks.md's zoo
table is trained and checked against what the cell says.

A cell says one of:

- `same`: optimizer steps, `training_step` calls, final weights and buffers, every logged value and the LR of every
  optimizer step equal the fit without the callback (weights and logs within 1e-6, LRs within 1e-12);
- `trials`: as `same`, but `training_step` ran more often (the callback's timed trials), with nothing left behind;
- `accum`: equal, as `same` checks, to `Trainer(accumulate_grad_batches=2)` without the callback;
- `lr x2`: the LR of every optimizer step is twice the plain fit's, and the steps and calls are the same;
- `split`: both fits in float64, after two optimizer steps, the weights within 1e-10 of the whole batch's, the same
  LRs, and `training_step` once per piece (two per batch), not once more;
- `split*`: as `split` once dropout is off in both fits: pieces draw their own dropout masks;
- `warns`: a LightningAccelWarning naming the case came before the first optimizer step, and the fit trained;
- `refused`: an error naming the callback ended the fit before the first optimizer step.

The table is the promise; this test keeps it. A cell that changes the math without saying so fails here.
"""

from __future__ import annotations

import functools
import re
import tempfile
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from zoo_columns import COLUMNS, LR_FACTOR, default_set
from zoo_modules import ZOO
from zoo_runner import Fit, fit, logged_difference, lr_difference, weight_difference

from lightning_accel.errors import LightningAccelWarning

TABLE = Path(__file__).parents[2] / "examples" / "callbacks.md"
SECTION = "## The zoo"
CODES = ("same", "trials", "accum", "lr x2", "split", "split*", "warns", "refused")
SPLIT_STEPS = 2
"""Optimizer steps of the `split` cells: float rounding of a split sum (1e-8) grows by about 10x per SGD step of the
demo transformer (lr 0.1), so the update is compared where rounding cannot pass for a difference."""
SPLIT_PRECISION = "64-true"
"""Both fits of a `split` cell train in float64: Adam divides a gradient by its own size, so float32 rounding of one
that is zero in exact arithmetic (an attention key projection's bias) becomes a step of the full learning rate, a
different one in each summation order; in float64 that rounding stays far below Adam's epsilon."""


def zoo_table() -> dict[tuple[str, str], str]:
    """{(callback column, module): code} from the zoo section of examples/callbacks.md."""
    text = TABLE.read_text()
    section = text[text.index(SECTION) :]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip(" `") for cell in rows[0].strip("|").split("|")]
    modules = header[1:]
    cells = {}
    for row in rows[2:]:
        values = [cell.strip() for cell in row.strip("|").split("|")]
        column = values[0].strip("`")
        for module, code in zip(modules, values[1:], strict=True):
            cells[column, module] = code.strip("`")
    return cells


CELLS = zoo_table()


def test_the_table_covers_the_whole_zoo() -> None:
    """Every column of the zoo and every module has its cell, in the table's own words."""
    assert {c for c, _ in CELLS} == set(COLUMNS)
    assert {m for _, m in CELLS} == set(ZOO)
    unknown = {cell: code for cell, code in CELLS.items() if code not in CODES}
    assert not unknown, f"codes the test does not know: {unknown}"


def _no_dropout(module: nn.Module) -> None:
    for sub in module.modules():
        if isinstance(sub, nn.Dropout):
            sub.p = 0.0
        elif isinstance(sub, nn.MultiheadAttention):
            sub.dropout = 0.0


@functools.cache
def _plain(
    module: str,
    *,
    accumulate: int = 1,
    dropout: bool = True,
    steps: int = -1,
    defaults: bool = False,
    precision: str | None = None,
) -> Fit:
    """The fit without the column's callback, alone or beside accel-train's default set (cached: every column of a
    module compares with it)."""
    settings: dict[str, Any] = {"accumulate_grad_batches": accumulate, "max_steps": steps}
    if precision:
        settings["precision"] = precision
    entry = ZOO[module]
    extra = default_set(entry.val_key, Path(tempfile.mkdtemp(prefix="zoo-defaults-"))) if defaults else []
    return fit(entry, extra, trainer=settings, adjust=None if dropout else _no_dropout)


def _accel_warnings(result: Fit) -> list[tuple[str, str, int]]:
    known = {cls.__name__ for cls in (LightningAccelWarning, *LightningAccelWarning.__subclasses__())}
    return [w for w in result.warnings if w[0] in known]


def _assert_equal_math(result: Fit, reference: Fit, *, calls: bool = True, weights: float = 1e-6) -> None:
    assert result.error is None, f"the fit failed: {result.error!r}"
    assert result.optimizer_steps == reference.optimizer_steps, "optimizer steps"
    if calls:
        assert result.training_steps == reference.training_steps, "training_step calls"
    assert weight_difference(result, reference) <= weights, "final weights"
    assert lr_difference(result, reference) <= 1e-12, "LR of every optimizer step"


def _ids(value: str) -> str:
    return re.sub(r"\W+", "-", value)


HEAVY = frozenset({"lstm", "transformer", "resnet", "glue"})
"""The zoo's modules whose fits take seconds each on 2 CPUs: their cells carry `slow` (CI runs them), the default tier
keeps every column on the light modules."""


def _cell_params(cells: Any) -> list[Any]:
    return [pytest.param(*cell, marks=pytest.mark.slow) if cell[1] in HEAVY else cell for cell in sorted(cells)]


@pytest.mark.parametrize(("column", "module"), _cell_params(CELLS), ids=_ids)
def test_zoo_cell(column: str, module: str, tmp_path: Path) -> None:
    _check_cell(column, module, tmp_path, defaults=False)


@pytest.mark.slow  # the same cells beside accel-train's default set: the default tier has its own column
# on the light modules: each column's interplay with the default set is the same on every module, and the heavy
# modules' own traits (BatchNorm, LSTM hiddens, a frozen backbone) are the cells above
@pytest.mark.parametrize(
    ("column", "module"), sorted(c for c in CELLS if c[0] != "default set" and c[1] not in HEAVY), ids=_ids
)
def test_zoo_cell_beside_the_default_set(column: str, module: str, tmp_path: Path) -> None:
    _check_cell(column, module, tmp_path, defaults=True)


def _check_cell(column: str, module: str, tmp_path: Path, *, defaults: bool) -> None:
    code = CELLS[column, module]
    entry = ZOO[module]
    context = types.SimpleNamespace(entry=entry, tmp=tmp_path)
    dropout = not code.endswith("*")
    split = code.startswith("split")
    steps = SPLIT_STEPS if split else -1
    precision = SPLIT_PRECISION if split else None
    own = COLUMNS[column](context)
    extra = default_set(entry.val_key, tmp_path / "defaults") if defaults else []
    kinds = {type(callback) for callback in own}
    callbacks = [*own, *(callback for callback in extra if type(callback) not in kinds)]  # the column's stands in
    settings = {"max_steps": steps, **({"precision": precision} if precision else {})}
    result = fit(entry, callbacks, adjust=None if dropout else _no_dropout, trainer=settings)
    plain = _plain(module, dropout=dropout, steps=steps, defaults=defaults, precision=precision)

    if code == "refused":
        assert result.error is not None, "the fit ran: the cell says it is refused"
        assert result.error_at_step == 0, f"refused only after {result.error_at_step} optimizer steps"
        name = column.split("(")[0].split()[0]
        assert name in str(result.error) or column == "default set", f"the error does not name {name}: {result.error}"
        return
    if code == "warns":
        assert result.error is None, f"the fit failed: {result.error!r}"
        early = [w for w in _accel_warnings(result) if w[2] == 0]
        assert early, f"no LightningAccelWarning before the first optimizer step: {_accel_warnings(result)}"
        assert result.optimizer_steps == plain.optimizer_steps
        return
    if code in ("same", "trials"):
        _assert_equal_math(result, plain, calls=code == "same")
        assert logged_difference(result, plain) <= 1e-6, "logged values"
        if code != "same":
            assert result.training_steps > plain.training_steps, "no trial ran: the cell says `same`"
        return
    if code == "accum":
        reference = _plain(module, accumulate=2, defaults=defaults)
        _assert_equal_math(result, reference)
        assert logged_difference(result, reference) <= 1e-6, "logged values"
        return
    if code == "lr x2":
        assert result.error is None and result.optimizer_steps == plain.optimizer_steps
        assert result.training_steps == plain.training_steps
        assert len(result.lrs) == len(plain.lrs)
        for scaled, base in zip(result.lrs, plain.lrs, strict=True):
            assert torch.allclose(torch.tensor(scaled), LR_FACTOR * torch.tensor(base), rtol=1e-9, atol=0.0)
        return
    assert code in ("split", "split*")
    _assert_equal_math(result, plain, calls=False, weights=1e-10)
    assert result.training_steps == 2 * plain.training_steps, "training_step once per piece, no other call"
