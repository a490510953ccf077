"""Preflight: a FAIL stops the fit before its first step, a WARN warns once, and on 2 DDP ranks a bad rank is named.

Run under torchrun (`_torchrun.torchrun`: `python -m torch.distributed.run --standalone --nproc-per-node=2
test_preflight.py OUT`, with `tests/` on PYTHONPATH) this file is the 2-rank scenario: each rank reads a fake tree
whose /dev/shm is 16 GiB, except rank 1's, which is 64 MiB, fits with `Preflight(checks=["shm"], num_workers=2)` and
writes OUT/rank<k>.json with the error it got and its step count.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _tiny import TinyRegression, tiny_loader
from _torchrun import torchrun

from lightning_accel.callbacks.preflight import Preflight, _grouped
from lightning_accel.errors import LightningAccelWarning, PreflightError


def fit(callback: Preflight, root: str, model: TinyRegression | None = None, **trainer_kwargs: Any) -> TinyRegression:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        **trainer_kwargs,
    )
    model = model or TinyRegression()
    trainer.fit(model, tiny_loader())
    return model


def fake_root(root: Path, shm_mib: int | None = None, cpu_max: str | None = None) -> Path:
    """A fake tree: a cgroup v2 container with quota `cpu_max` and, with `shm_mib`, a /dev/shm of that size."""
    files = {"proc/self/cgroup": "0::/\n", "proc/self/mountinfo": "1 0 0:1 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"}
    if cpu_max is not None:
        files["sys/fs/cgroup/cpu.max"] = cpu_max
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    if shm_mib is not None:
        shm = root / "dev" / "shm"
        shm.mkdir(parents=True)
        real, stat = (
            os.statvfs,
            SimpleNamespace(f_frsize=4096, f_bsize=4096, f_blocks=shm_mib * 256, f_bavail=shm_mib * 256),
        )
        os.statvfs = lambda path: stat if str(path) == str(shm) else real(path)  # type: ignore[assignment]
    return root


@pytest.fixture
def restore_statvfs():
    real = os.statvfs
    yield
    os.statvfs = real


def test_a_failure_stops_the_fit_before_the_first_step(tmp_path: Path, restore_statvfs) -> None:
    root = fake_root(tmp_path / "root", shm_mib=64)
    callback, model = Preflight(num_workers=2, root=root), TinyRegression()
    with pytest.raises(PreflightError) as error, warnings.catch_warnings():
        warnings.simplefilter("ignore", LightningAccelWarning)  # num_workers=2 may exceed this machine's CPUs
        fit(callback, str(tmp_path), model)
    assert model.training_steps == 0
    message = str(error.value)
    assert "before its first step" in message and "FAIL shm on rank 0 (node 0, host " in message
    assert "/dev/shm 64.0 MiB" in message and "fix: run the container with `--shm-size=8g`" in message
    assert callback.results[0]["rank"] == 0


def test_a_warning_only_run_completes_and_warns_once(tmp_path: Path) -> None:
    root = fake_root(tmp_path / "root", cpu_max="50000 100000\n")  # half a CPU: below any affinity set
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fit(Preflight(root=root), str(tmp_path))
    assert model.training_steps == 3
    ours = [w for w in caught if issubclass(w.category, LightningAccelWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    text = str(ours[0].message)
    assert "WARN cpus on rank 0" in text and "cgroup quota 0.5 CPUs" in text and "fix: use num_workers=" in text


def test_fail_on_warn_and_a_subset_of_checks(tmp_path: Path) -> None:
    root = fake_root(tmp_path / "root", cpu_max="50000 100000\n")
    with pytest.raises(PreflightError, match="WARN cpus"):
        fit(Preflight(fail_on="WARN", root=root), str(tmp_path))
    callback = Preflight(fail_on="WARN", checks=["bf16", "shm"], root=root)
    assert fit(callback, str(tmp_path)).training_steps == 3
    assert [c["name"] for c in callback.results[0]["checks"]] == ["bf16", "shm"]


def test_a_crash_in_the_checks_warns_and_the_fit_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_accel.callbacks.preflight as preflight

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(preflight, "run_checks", broken)
    with pytest.warns(LightningAccelWarning, match=r"WARN preflight on rank 0 .*RuntimeError: boom"):
        assert fit(Preflight(root=fake_root(tmp_path / "root")), str(tmp_path)).training_steps == 3


def test_the_threads_check_reports_this_ranks_threads_the_neighbours_and_the_wait_policy(tmp_path: Path) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        callback = Preflight(checks=["threads"], interference_s=0.2)
        fit(callback, str(tmp_path))
    finally:
        torch.set_num_threads(before)
    (check,) = callback.results[0]["checks"]
    assert "1 process(es) x (1 intra-op thread(s) + 0 worker(s))" in check["detail"]
    assert "OMP_WAIT_POLICY=" in check["detail"] and "CPU(s) of ours over 0.2 s" in check["detail"]


def test_suite_basics(tmp_path: Path) -> None:
    callback = Preflight(checks=["cpus"], root=fake_root(tmp_path / "root"))
    assert type(pickle.loads(pickle.dumps(callback))) is Preflight
    assert fit(callback, str(tmp_path / "a")).training_steps == fit(callback, str(tmp_path / "b")).training_steps == 3
    assert callback.state_dict() == {}
    assert type(pickle.loads(pickle.dumps(callback))) is Preflight


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fail_on": "ERROR"}, "fail_on='ERROR'"),
        ({"checks": ["gpu"]}, r"unknown check\(s\) \['gpu'\]"),
        ({"num_workers": -1}, "num_workers=-1"),
        ({"num_workers": True}, "num_workers=True"),
        ({"interference_s": -1}, "interference_s=-1"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Preflight(**kwargs)


def test_results_are_grouped_by_check_and_name_their_nodes() -> None:
    bad = {"name": "driver_cuda", "status": "FAIL", "detail": "driver too old", "fix": "upgrade"}
    good = {"name": "driver_cuda", "status": "PASS", "detail": "ok", "fix": ""}
    rows = [
        {"rank": r, "node": r // 2, "host": f"gpu-{r // 2}", "checks": [bad if r in (2, 3, 5) else good]}
        for r in range(6)
    ]
    assert _grouped(rows, ("FAIL",)) == (
        "  FAIL driver_cuda on ranks 2, 3 (node 1, host gpu-1); rank 5 (node 2, host gpu-2): driver too old\n"
        "    fix: upgrade"
    )
    assert _grouped(rows, ("WARN",)) == ""


@pytest.mark.slow
def test_two_ddp_ranks_stop_together_and_name_the_bad_one(tmp_path: Path) -> None:
    proc = torchrun(__file__, str(tmp_path), timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["error"].startswith("PreflightError") and result["steps"] == 0
        assert "FAIL shm on rank 1 (node 0, host " in result["error"] and "rank 0" not in result["error"]


def _ddp_main(out: Path) -> None:
    rank = int(os.environ["RANK"])
    root = fake_root(out / f"root{rank}", shm_mib=64 if rank == 1 else 16384)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
        callbacks=[Preflight(checks=["shm"], num_workers=2, root=root)],
    )
    model, error = TinyRegression(), ""
    try:
        trainer.fit(model, tiny_loader())
    except PreflightError as err:
        error = f"PreflightError: {err}"
    (out / f"rank{rank}.json").write_text(json.dumps({"error": error, "steps": model.training_steps}))
    if torch.distributed.is_initialized():  # else gloo's threads can abort the exit ("terminate called ...")
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _ddp_main(Path(sys.argv[1]))
