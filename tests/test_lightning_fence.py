"""Only `lightning_accel/_lightning.py` names Lightning's private attributes; each of its touchpoints fails with an
error naming the attribute, the feature and the Lightning version when the attribute is missing."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import lightning_accel
from lightning_accel import _lightning

PACKAGE = Path(lightning_accel.__file__).parent
FENCE = PACKAGE / "_lightning.py"
PYPROJECT = PACKAGE.parent / "pyproject.toml"


def _private_names_defined(root: Path) -> set[str]:
    """Every `_name` (not dunder) a source tree defines: functions, classes, module globals, attributes it sets."""
    names: set[str] = set()
    for path in root.rglob("*.py"):
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


@pytest.fixture(scope="module")
def lightning_private() -> set[str]:
    """Lightning's private names that this package does not define for itself (a name both define, such as
    `_trainer`, cannot be told apart by reading, and is left to review)."""
    import lightning

    return _private_names_defined(Path(lightning.__file__).parent) - _private_names_defined(PACKAGE)


def private_uses(path: Path, private: set[str]) -> list[str]:
    """`line: what` for each use of a Lightning private name in one file: an attribute, a string naming one (for
    `getattr`/patching), or an import of a private Lightning name or module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in private:
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in private:
            found.append(f"{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning":
            module_private = any(part.startswith("_") for part in (node.module or "").split("."))
            found += [
                f"{node.lineno}: from {node.module} import {alias.name}"
                for alias in node.names
                if module_private or alias.name.startswith("_")
            ]
    return found


def test_only_the_fence_names_lightning_private_attributes(lightning_private: set[str]) -> None:
    assert {"_combined_loader", "_make_closure", "_signal_connector", "_results"} <= lightning_private
    broken = {
        str(path.relative_to(PACKAGE)): uses
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != FENCE and (uses := private_uses(path, lightning_private))
    }
    assert broken == {}, "route these through lightning_accel/_lightning.py"


def test_the_fence_check_catches_each_kind_of_use(tmp_path: Path, lightning_private: set[str]) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from lightning.fabric.utilities.load import _load_distributed_checkpoint\n"
        "def f(trainer, loop):\n"
        "    trainer._results\n"
        "    getattr(loop, '_combined_loader', None)\n"
    )
    assert private_uses(planted, lightning_private) == [
        "1: from lightning.fabric.utilities.load import _load_distributed_checkpoint",
        "3: ._results",
        "4: '_combined_loader'",
    ]


def test_a_missing_internal_names_the_attribute_the_feature_and_the_version() -> None:
    import lightning

    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace()))
    with pytest.raises(_lightning.LightningInternalsError) as caught:
        _lightning.optimizer_steps_logged(trainer)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "`SimpleNamespace._batches_that_stepped` does not exist in Lightning " + lightning.__version__ in message
    assert "logging at the loggers' step" in message and _lightning.SUPPORTED_LIGHTNING in message
    with pytest.raises(_lightning.LightningInternalsError, match="_make_closure"):
        _lightning.patch_closure_factory(SimpleNamespace(), lambda *a: None, "MicroBatchFinder")
    with pytest.raises(_lightning.LightningInternalsError, match="_combined_loader"):
        _lightning.set_loop_loaders(SimpleNamespace(_combined_loader=None), [], "the DataLoaderTuner")


def test_optional_internals_answer_none_where_absent() -> None:
    empty = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace()))
    assert _lightning.accumulating(empty) is None  # type: ignore[arg-type]
    assert _lightning.signal_connector(empty) is None  # type: ignore[arg-type]
    assert _lightning.ddp_comm_hook(object()) is None
    assert _lightning.save_last_checkpoint(object(), empty) is False  # type: ignore[arg-type]
    assert _lightning.restore_pending_loader_states(SimpleNamespace()) is False


def test_the_epoch_loop_makes_its_iterator_past_the_first_epoch_unless_restarting_or_resuming() -> None:
    def trainer(epoch: int, restarting: bool = False, **fit_loop: bool) -> SimpleNamespace:
        epoch_loop = SimpleNamespace(restarting=restarting)
        return SimpleNamespace(current_epoch=epoch, fit_loop=SimpleNamespace(epoch_loop=epoch_loop, **fit_loop))

    assert _lightning.epoch_loop_makes_iterator(trainer(1)) is True  # Lightning 2.5.0-2.5.2: no `is_resuming`
    assert _lightning.epoch_loop_makes_iterator(trainer(1, is_resuming=False)) is True
    assert _lightning.epoch_loop_makes_iterator(trainer(1, is_resuming=True)) is False
    assert _lightning.epoch_loop_makes_iterator(trainer(1, restarting=True)) is False
    assert _lightning.epoch_loop_makes_iterator(trainer(0)) is False


def test_every_internal_the_fence_names_exists_in_this_lightning() -> None:
    """The installed Lightning has every attribute the fence reads, on the objects it reads them from."""
    import lightning.pytorch as pl
    from lightning.fabric.utilities import load, seed
    from lightning.pytorch.loops import _FitLoop, _TrainingEpochLoop
    from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
    from lightning.pytorch.trainer import call

    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    fit_loop, epoch_loop = trainer.fit_loop, trainer.fit_loop.epoch_loop
    assert isinstance(fit_loop, _FitLoop) and isinstance(epoch_loop, _TrainingEpochLoop)
    assert _lightning.loop_combined_loader(fit_loop, "test") is None and _lightning.optimizer_steps_logged(trainer) == 0
    assert _lightning.loop_data_fetcher(fit_loop, "test") is None and _lightning.accumulating(trainer) is not None
    assert isinstance(epoch_loop.automatic_optimization, _AutomaticOptimization)
    assert _lightning.backward_skipped(epoch_loop.automatic_optimization) is False
    assert _lightning.epoch_loop_makes_iterator(trainer) is False  # the first epoch
    assert _lightning.signal_connector(trainer) is not None and _lightning.cluster_environment(trainer) is not None
    assert _lightning.distributed_checkpoint_metadata_name() == "meta.pt"
    for module, name in [
        (call, "_call_callback_hooks"),
        (call, "_call_lightning_module_hook"),
        (load, "_load_distributed_checkpoint"),
        (seed, "_collect_rng_states"),
        (seed, "_set_rng_states"),
    ]:
        assert callable(getattr(module, name)), name
    states = _lightning.collect_rng_states(include_cuda=False)
    _lightning.set_rng_states(states)
    undo = _lightning.patch_hydra_subprocess_cmd(lambda *a, **k: None, "test")
    undo()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="reads pyproject.toml with tomllib (Python 3.11+)")
def test_pyproject_the_fence_and_ci_agree_on_the_lightning_range() -> None:
    """pyproject's requirement is `SUPPORTED_LIGHTNING`, and `.ci/contract` tests its floor and its newest minor."""
    import tomllib
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    contract = PACKAGE.parent / ".ci" / "contract"
    if not (PYPROJECT.is_file() and contract.is_file()):
        pytest.skip("an installed lightning_accel, not a checkout: no pyproject.toml or .ci/ beside it")
    requirements = [Requirement(r) for r in tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]]
    (lightning,) = [r for r in requirements if r.name == "lightning"]
    assert lightning.specifier == SpecifierSet(_lightning.SUPPORTED_LIGHTNING)
    floor = Version(next(s.version for s in lightning.specifier if s.operator == ">="))
    cap = Version(next(s.version for s in lightning.specifier if s.operator == "<"))
    tested = re.search(r'^LIGHTNING_RELEASES=\("([^"]+)" "([^"]+)\.\*"\)', contract.read_text(), re.M)
    assert tested, '`.ci/contract` names its two releases as LIGHTNING_RELEASES=("<oldest>" "<newest minor>.*")'
    oldest, newest_minor = Version(tested[1]), Version(tested[2])
    assert oldest == floor  # the floor itself, not a later patch of its minor
    assert newest_minor in lightning.specifier  # and the cap is the next, untested, minor:
    assert cap == Version(f"{newest_minor.major}.{newest_minor.minor + 1}")


def test_the_last_batch_and_the_stepping_estimate_touchpoints() -> None:
    """The fetcher's look-ahead, the loop's batch index and the Trainer's step estimate: present in this Lightning,
    named when absent, and the estimate's patch touches one Trainer and is undone."""
    import lightning.pytorch as pl
    from lightning.pytorch.loops import fetchers

    kwargs = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer, other = pl.Trainer(max_steps=7, **kwargs), pl.Trainer(max_steps=7, **kwargs)
    assert _lightning.train_fetcher_prefetches(trainer, "test") is None  # no fetcher before the fit
    assert _lightning.epoch_loop_batch_idx(trainer) == -1
    trainer.fit_loop._data_fetcher = fetchers._PrefetchDataFetcher()
    assert _lightning.train_fetcher_prefetches(trainer, "test") is True
    assert _lightning.train_fetcher_done(trainer, "test") is False
    trainer.fit_loop._data_fetcher = fetchers._DataLoaderIterDataFetcher()
    assert _lightning.train_fetcher_prefetches(trainer, "test") is False
    trainer.fit_loop._data_fetcher = None
    with pytest.raises(_lightning.LightningInternalsError, match="_data_fetcher"):
        _lightning.train_fetcher_done(trainer, "test")

    undo = _lightning.patch_estimated_stepping_batches(trainer, lambda lightning: lightning() * 10, "test")
    try:
        assert (trainer.estimated_stepping_batches, other.estimated_stepping_batches) == (70, 7)
    finally:
        undo()
    assert trainer.estimated_stepping_batches == 7
    with pytest.raises(_lightning.LightningInternalsError, match="estimated_stepping_batches.*the feature"):
        _lightning.patch_estimated_stepping_batches(SimpleNamespace(), lambda lightning: 0, "the feature")  # type: ignore[arg-type]
