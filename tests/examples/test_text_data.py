"""Tests of the standard-library byte corpus and its data module."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_accel import examples

StdlibTextDataModule = examples.StdlibTextDataModule
read_stdlib_corpus = examples.text_data.read_stdlib_corpus


def _setup(**kwargs: Any) -> StdlibTextDataModule:
    dm = StdlibTextDataModule(**{"block_size": 16, "batch_size": 4, "max_chars": 20_000, **kwargs})
    dm.setup("fit")
    return dm


def test_corpus_is_deterministic_python_source() -> None:
    first = read_stdlib_corpus(50_000)
    read_stdlib_corpus.cache_clear()
    second = read_stdlib_corpus(50_000)
    assert first == second
    assert len(first) == 50_000
    assert b"def " in first and b"import " in first


def test_corpus_walk_is_sorted_and_skips_tests_and_third_party(tmp_path: Path) -> None:
    files = {
        "b.py": b"B",
        "a.py": b"A",
        "notes.txt": b"X",
        "pkg/c.py": b"C",
        "site-packages/d.py": b"D",
        "test/e.py": b"E",
        "pkg/tests/f.py": b"F",
        "idlelib/g.py": b"G",
        "lib2to3/h.py": b"H",
    }
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content)
    assert read_stdlib_corpus(100, str(tmp_path)) == b"ABC"
    assert read_stdlib_corpus(2, str(tmp_path)) == b"AB"


def test_splits_are_contiguous_disjoint_and_sized() -> None:
    dm = _setup(val_fraction=0.1, test_fraction=0.05)
    assert (len(dm.train_data), len(dm.val_data), len(dm.test_data)) == (17_000, 2_000, 1_000)
    corpus = torch.frombuffer(bytearray(read_stdlib_corpus(20_000)), dtype=torch.uint8)
    assert torch.equal(torch.cat([dm.train_data, dm.val_data, dm.test_data]), corpus)


def test_items_are_inputs_and_targets_shifted_by_one() -> None:
    dm = _setup()
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert len(dm.train_dataloader()) == ((len(dm.train_data) - 17) // 16 + 1) // 4  # incomplete batch dropped


def test_eval_windows_are_ordered_and_score_every_byte_once() -> None:
    dm = _setup()
    loader = dm.val_dataloader()
    xs, ys = zip(*loader, strict=True)
    x, y = torch.cat(xs), torch.cat(ys)
    assert x.shape[0] == (len(dm.val_data) - 17) // 16 + 1
    assert torch.equal(x.flatten(), dm.val_data[: x.numel()].long())  # inputs do not overlap, order kept
    assert torch.equal(y.flatten(), dm.val_data[1 : 1 + y.numel()].long())


def test_train_shuffle_follows_the_seed() -> None:
    def first_batch(seed: int) -> torch.Tensor:
        return next(iter(_setup(seed=seed).train_dataloader()))[0]

    assert torch.equal(first_batch(0), first_batch(0))
    assert not torch.equal(first_batch(0), first_batch(1))


def test_baselines_are_sane() -> None:
    dm = _setup(max_chars=200_000)
    assert 3.0 < dm.unigram_bpc < 7.0
    assert dm.unigram_bpc < dm.uniform_bpc <= math.log2(dm.vocab_size)


def test_persistent_workers_only_with_workers() -> None:
    dm = _setup(persistent_workers=True)
    assert dm.train_dataloader().persistent_workers is False


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": 0}, "`data.block_size=0` must be >= 1"),
        ({"batch_size": -1}, "`data.batch_size=-1`"),
        ({"val_fraction": 1.5}, "`data.val_fraction=1.5`"),
        ({"val_fraction": 0.5, "test_fraction": 0.5}, "must be below 1"),
        ({"num_workers": -2}, "`data.num_workers=-2`"),
    ],
)
def test_invalid_arguments_name_the_setting(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StdlibTextDataModule(**kwargs)


def test_too_small_corpus_names_max_chars() -> None:
    with pytest.raises(ValueError, match="`data.max_chars=100`"):
        _setup(max_chars=100)


def test_seed_none_shuffles_from_the_global_rng() -> None:
    """`accel-train seed=null` (the README's "leave the RNGs alone") crashed in `manual_seed(None)`."""
    dm = _setup(seed=None)
    torch.manual_seed(1)
    first = next(iter(dm.train_dataloader()))[0]
    torch.manual_seed(1)
    assert torch.equal(next(iter(dm.train_dataloader()))[0], first)  # the global RNG decides


def test_a_read_delay_makes_the_loader_wait() -> None:
    """`read_delay_ms=5`: a batch of 8 windows takes >= 40 ms to load in the main process."""
    import time

    dm = StdlibTextDataModule(max_chars=50_000, batch_size=8, read_delay_ms=5.0)
    dm.setup("fit")
    started = time.perf_counter()
    next(iter(dm.train_dataloader()))
    assert time.perf_counter() - started >= 0.04
    with pytest.raises(ValueError, match="read_delay_ms=-1"):
        StdlibTextDataModule(read_delay_ms=-1)
