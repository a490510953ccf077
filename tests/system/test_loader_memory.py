"""The DataLoader workers' host memory against the cgroup's limit: the estimate, and accel-train's refusal before
launch with a fake `memory.max`."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from lightning_accel.checks import check_loader_memory
from lightning_accel.errors import ConfigError
from lightning_accel.system import loader_memory
from lightning_accel.system.loader_memory import WORKER_BYTES, estimate_loader_memory, measure_worker_bytes

MIB = 2**20
V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw\n"


def test_workers_prefetched_batches_and_pinned_copies_add_up() -> None:
    estimate = estimate_loader_memory(
        limit_bytes=4096 * MIB,
        ranks=2,
        num_workers=3,
        prefetch_factor=2,
        batch_bytes=10 * MIB,
        worker_bytes=100 * MIB,
        pin_memory=True,
        rank_bytes=1024 * MIB,
    )
    assert estimate.workers_bytes() == 2 * (3 * 100 * MIB + 2 * 3 * 2 * 10 * MIB)  # 840 MiB
    assert estimate.available_bytes == 2048 * MIB and estimate.fits
    assert estimate.most_workers == 7  # 2 x 7 x (100 + 40) = 1960 MiB <= 2048; 8 would need 2240
    assert "2 rank(s) x 3 worker(s) x (2 prefetched x 10 MiB batches + pinned copies + 100 MiB each)" in (
        estimate.describe()
    )
    assert estimate_loader_memory(limit_bytes=None, batch_bytes=1, num_workers=64).fits


def test_no_workers_means_no_prefetch_and_bad_numbers_are_refused() -> None:
    assert estimate_loader_memory(limit_bytes=1, batch_bytes=10**9, num_workers=0).workers_bytes() == 0
    with pytest.raises(ValueError, match="num_workers=-1"):
        estimate_loader_memory(limit_bytes=None, batch_bytes=1, num_workers=-1)


def fake_memory_max(root: Path, limit: int) -> Path:
    for name, text in {
        "proc/self/cgroup": "0::/job\n",
        "proc/self/mountinfo": V2_MOUNT,
        "sys/fs/cgroup/job/memory.max": f"{limit}\n",
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_accel_train_refuses_a_loader_the_memory_limit_cannot_hold(compose_train, tmp_path: Path) -> None:
    root = str(fake_memory_max(tmp_path / "root", 1024 * MIB))
    big = compose_train(["data.num_workers=8", "data.batch_size=4096", "data.block_size=256"])  # 16 MiB batches
    with pytest.raises(ConfigError) as err:
        check_loader_memory(big, ranks=1, root=root, rank_bytes=512 * MIB, worker_bytes=256 * MIB)
    message = str(err.value)
    assert message.startswith("`data.num_workers=8` would be OOM-killed: 1 rank(s) x 8 worker(s)")
    assert "against the cgroup's memory limit 1.00 GiB (" in message and "job/memory.max" in message
    assert re.search(r"use `data.num_workers=1` \(the most that fit\)", message), message
    small = compose_train(["data.num_workers=1"])
    estimate = check_loader_memory(small, ranks=1, root=root, rank_bytes=512 * MIB, worker_bytes=256 * MIB)
    assert estimate is not None and estimate.fits
    assert check_loader_memory(compose_train([]), ranks=1, root=root) is None  # num_workers=0: nothing to hold


def test_a_workers_footprint_is_measured_once_from_a_real_worker() -> None:
    import psutil

    loader_memory._measured.clear()
    measured = measure_worker_bytes()
    assert measured is not None
    parent = psutil.Process().memory_full_info()
    # a forked worker holds its own pages only (USS): more than a Python interpreter's few MiB, less than everything
    # this process maps (torch and Lightning loaded)
    assert 4 * MIB < measured < parent.rss, (measured / MIB, parent.rss / MIB)
    assert loader_memory._measured == {os.getpid(): measured}
    assert measure_worker_bytes() == measured  # once per process: the second call starts no worker


def test_the_check_measures_the_footprint_only_against_a_limit(
    compose_train, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def fake_measure(timeout_s: float = 60.0) -> int | None:
        calls.append(1)
        return 100 * MIB

    monkeypatch.setattr(loader_memory, "measure_worker_bytes", fake_measure)
    cfg = compose_train(["data.num_workers=8", "data.batch_size=4096", "data.block_size=256"])  # 16 MiB batches
    unlimited = check_loader_memory(cfg, ranks=1, root=str(tmp_path / "nothing"), rank_bytes=0)
    assert unlimited is not None and unlimited.fits and unlimited.worker_bytes_note == "assumed" and calls == []
    root = str(fake_memory_max(tmp_path / "root", 1024 * MIB))
    with pytest.raises(ConfigError) as err:
        check_loader_memory(cfg, ranks=1, root=root, rank_bytes=512 * MIB)
    assert "+ 100 MiB each, measured) = 1.03 GiB" in str(err.value) and calls == [1]
    assert "use `data.num_workers=3` (the most that fit)" in str(err.value)  # 3 x (100 + 32) <= 512 < 4 x 132

    monkeypatch.setattr(loader_memory, "measure_worker_bytes", lambda timeout_s=60.0: None)  # no USS here
    with pytest.raises(ConfigError, match=r"\+ 256 MiB each, assumed\)"):
        check_loader_memory(cfg, ranks=1, root=root, rank_bytes=512 * MIB)
    assert WORKER_BYTES == 256 * MIB
