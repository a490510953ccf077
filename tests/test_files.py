"""The one atomic-write helper (`lightning_accel.files`): whole files or none, with the permissions open gives."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import lightning_accel
from lightning_accel.files import atomic_path, atomic_write, remove_stale_temporaries, temporary_target
from lightning_accel.telemetry.heartbeat import write_json_atomic


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_written_file_has_the_umasks_permissions_not_a_temporary_files(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        assert _mode(atomic_write(tmp_path / "report.md", "x")) == 0o640
    finally:
        os.umask(old)
    assert _mode(atomic_write(tmp_path / "shared.json", b"{}", mode=0o644)) == 0o644


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = atomic_write(tmp_path / "bench.json", "old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("disk full")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["bench.json"]


def test_heartbeats_go_through_it_readable_by_teammates(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        write_json_atomic(tmp_path / "run.host.0.json", {"step": 1})
    finally:
        os.umask(old)
    assert _mode(tmp_path / "run.host.0.json") == 0o644
    with pytest.raises(ValueError):
        write_json_atomic(tmp_path / "run.host.0.json", {"loss": float("nan")})
    assert (tmp_path / "run.host.0.json").read_text() == '{"step":1}'


def test_no_other_module_makes_its_own_temporary_files_to_rename() -> None:
    package = Path(lightning_accel.__file__).parent
    own = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.name != "files.py" and "mkstemp(" in path.read_text(encoding="utf-8")
    ]
    assert own == []


def test_a_temporary_is_named_so_it_is_known_for_ours(tmp_path: Path) -> None:
    with atomic_path(tmp_path / "last.ckpt") as tmp:
        assert temporary_target(tmp.name) == "last.ckpt" and tmp.name.startswith(".last.ckpt.accel-")
        tmp.write_text("x")
    for name in (".draft.tmp", ".notes.backup01.tmp", ".last.ckpt.abcd1234.tmp", "last.ckpt.accel-abcd1234.tmp"):
        assert temporary_target(name) is None, name


def test_only_our_own_temporaries_are_removed(tmp_path: Path) -> None:
    """A hidden `.tmp` file of the user's beside our outputs (same suffix, same owner) was removed with ours."""
    ours = tmp_path / ".bench.csv.accel-k2x9q0ab.tmp"
    ours.write_text("half")
    theirs = {
        ".draft.tmp": "a user's draft",
        ".notes.backup01.tmp": "eight characters after a dot",
        ".bench.csv.abcd1234.tmp": "an earlier release's name: left for the user",
        "bench.csv.accel-abcd1234.tmp": "not hidden: not one of ours",
    }
    for name, text in theirs.items():
        (tmp_path / name).write_text(text)
    (tmp_path / ".link.accel-abcd1234.tmp").symlink_to(tmp_path / ".draft.tmp")  # not a regular file
    (tmp_path / ".dir.accel-abcd1234.tmp").mkdir()
    assert remove_stale_temporaries(tmp_path) == [ours]
    assert {name: (tmp_path / name).read_text() for name in theirs} == theirs
    assert (tmp_path / ".link.accel-abcd1234.tmp").is_symlink() and (tmp_path / ".dir.accel-abcd1234.tmp").is_dir()
    assert remove_stale_temporaries(tmp_path / "missing") == []
