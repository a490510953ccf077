"""A byte-level language-modelling corpus made at run time from the Python standard library's own source files."""

from __future__ import annotations

import functools
import math
import os
import sysconfig
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_accel.examples._settings import check_split_settings

__all__ = ["StdlibTextDataModule", "read_stdlib_corpus"]

# Folders left out of the corpus: third-party code, the test suites and the two large legacy tools.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})


@functools.lru_cache(maxsize=4)
def read_stdlib_corpus(max_chars: int, root: str | None = None) -> bytes:
    """The first `max_chars` bytes of the standard library's `.py` files, concatenated in a sorted walk.

    The walk is deterministic for a given Python installation; results are cached in memory, nothing is written.

    Args:
        max_chars: the most bytes to return.
        root: the folder to walk; None takes `sysconfig.get_paths()["stdlib"]`.
    """
    root = root if root is not None else sysconfig.get_paths()["stdlib"]
    chunks: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name), "rb") as f:
                chunk = f.read(max_chars - total)
            chunks.append(chunk)
            total += len(chunk)
            if total >= max_chars:
                return b"".join(chunks)
    return b"".join(chunks)


class _ByteWindows(Dataset):
    """Windows of `block_size + 1` bytes starting every `stride` bytes, returned as `(x, y)` shifted by one."""

    def __init__(self, data: torch.Tensor, block_size: int, stride: int, read_delay_s: float = 0.0) -> None:
        self.data = data
        self.block_size = block_size
        self.stride = stride
        self.read_delay_s = read_delay_s

    def __len__(self) -> int:
        return max(0, (len(self.data) - self.block_size - 1) // self.stride + 1)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} is out of range for {len(self)} windows")
        if self.read_delay_s:
            time.sleep(self.read_delay_s)  # the storage's latency (simulated): waits without using a CPU
        start = index * self.stride
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class StdlibTextDataModule(pl.LightningDataModule):
    """Byte-level (vocabulary 256) next-byte prediction on the standard library's Python source.

    The corpus is read at `setup` from the interpreter's own `.py` files (no download, nothing written to disk),
    then split by position into train, validation and test, in that order. Windows start every `block_size` bytes,
    so their inputs `x` do not overlap and every byte after a split's first is a target exactly once per epoch.
    Training windows are shuffled (and an incomplete last batch dropped); validation and test keep their order.

    After `setup`, `unigram_bpc` is the entropy in bits per character of the training split's byte frequencies,
    the score of a model that ignores context, and `uniform_bpc` is `log2` of the number of distinct training bytes.
    A language model should score well below both.

    The defaults (2.5 MB, 64-byte blocks, batches of 32) make a 1,098-step epoch that the default
    `GPTLanguageModel` trains in about a minute on two CPU cores, to roughly 2.3 bits per character on the test split
    against a unigram baseline of about 4.5.

    Args:
        block_size: context length in bytes; each item is `(x, y)` of `block_size` tokens, `y` shifted by one.
        batch_size: windows per batch.
        max_chars: corpus size in bytes.
        val_fraction: share of the corpus held out for validation.
        test_fraction: share of the corpus held out for testing (the end of the corpus).
        num_workers: DataLoader worker processes.
        pin_memory: pin host batches for faster copies to the GPU.
        persistent_workers: keep workers alive between epochs; only used when `num_workers > 0`.
        seed: seed of the training shuffle; None shuffles from torch's global RNG (`seed=null` in accel-train).
        read_delay_ms: simulate storage that takes this long to read each window (a sleep that uses no CPU), so the
            input-bound path (DataLoader workers, the DataLoaderTuner, accel-tune's input moves) shows on any machine.

    Raises:
        ValueError: for a non-positive size, fractions outside (0, 1) or summing to 1 or more, or a corpus too
            small to hold one window per split.

    Example::

        dm = StdlibTextDataModule(block_size=128, batch_size=64)
        dm.setup("fit")
        x, y = next(iter(dm.train_dataloader()))  # (64, 128) int64 each
    """

    vocab_size: int = 256

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 32,
        max_chars: int = 2_500_000,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        seed: int | None = 0,
        read_delay_ms: float = 0.0,
    ) -> None:
        super().__init__()
        if read_delay_ms < 0:
            raise ValueError(f"`data.read_delay_ms={read_delay_ms}` must be >= 0.")
        self.read_delay_ms = read_delay_ms
        check_split_settings(
            val_fraction, test_fraction, num_workers, block_size=block_size, batch_size=batch_size, max_chars=max_chars
        )
        self.save_hyperparameters()
        self.block_size = block_size
        self.batch_size = batch_size
        self.max_chars = max_chars
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.seed = seed
        self.unigram_bpc: float = math.nan
        self.uniform_bpc: float = math.nan
        self.train_data: torch.Tensor | None = None
        self.val_data: torch.Tensor | None = None
        self.test_data: torch.Tensor | None = None

    @override
    def setup(self, stage: str) -> None:
        if self.train_data is not None:
            return
        corpus = read_stdlib_corpus(self.max_chars)
        data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        n_val = int(len(data) * self.val_fraction)
        n_test = int(len(data) * self.test_fraction)
        n_train = len(data) - n_val - n_test
        if min(n_train, n_val, n_test) < self.block_size + 1:
            raise ValueError(
                f"`data.max_chars={self.max_chars}` gives a {len(data)}-byte corpus split into {n_train}/{n_val}/"
                f"{n_test} train/val/test bytes, but each split needs at least `data.block_size + 1 = "
                f"{self.block_size + 1}`; raise `data.max_chars` or the fractions, or lower `data.block_size`."
            )
        self.train_data = data[:n_train]
        self.val_data = data[n_train : n_train + n_val]
        self.test_data = data[n_train + n_val :]
        counts = torch.bincount(self.train_data.long(), minlength=self.vocab_size).double()
        probs = counts[counts > 0] / counts.sum()
        self.unigram_bpc = float(-(probs * probs.log2()).sum())
        self.uniform_bpc = math.log2(len(probs))

    def _loader(self, data: torch.Tensor | None, train: bool) -> DataLoader:
        if data is None:
            raise RuntimeError("`StdlibTextDataModule.setup()` must run before asking for a dataloader.")
        return DataLoader(
            _ByteWindows(data, self.block_size, stride=self.block_size, read_delay_s=self.read_delay_ms / 1000.0),
            batch_size=self.batch_size,
            shuffle=train,
            drop_last=train,
            generator=torch.Generator().manual_seed(self.seed) if train and self.seed is not None else None,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers and self.num_workers > 0,
        )

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_data, train=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_data, train=False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_data, train=False)
