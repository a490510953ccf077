"""A DataLoader worker killed (SIGKILL) during a run: the error names the cgroup's memory limit when its OOM-kill count
grew, with the figures, and the last checkpoint stands."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import lightning_accel.checks as checks
import lightning_accel.checks.worker_memory as worker_memory
from lightning_accel.errors import WorkerKilledError
from lightning_accel.system.cgroup import read_oom_kills

MIB = 2**20
V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw\n"
V1_MOUNTS = "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"


def fake_cgroup(root: Path, oom_kill: int, limit: int = 1024 * MIB) -> Path:
    files = {
        "proc/self/cgroup": "0::/job\n",
        "proc/self/mountinfo": V2_MOUNT,
        "sys/fs/cgroup/job/memory.max": f"{limit}\n",
        "sys/fs/cgroup/job/memory.events": f"low 0\nhigh 0\nmax 3\noom 1\noom_kill {oom_kill}\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_oom_kills_are_read_from_v2_and_v1(tmp_path: Path) -> None:
    assert read_oom_kills(fake_cgroup(tmp_path / "v2", 2)) == (2, str(tmp_path / "v2/sys/fs/cgroup/job/memory.events"))
    v1 = tmp_path / "v1"
    for name, text in {
        "proc/self/cgroup": "5:memory:/job\n",
        "proc/self/mountinfo": V1_MOUNTS,
        "sys/fs/cgroup/memory/job/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 4\n",
    }.items():
        (v1 / name).parent.mkdir(parents=True, exist_ok=True)
        (v1 / name).write_text(text)
    assert read_oom_kills(v1) == (4, str(v1 / "sys/fs/cgroup/memory/job/memory.oom_control"))
    assert read_oom_kills(tmp_path / "nothing") is None


def test_the_error_names_the_memory_limit_only_when_it_killed(tmp_path: Path, monkeypatch) -> None:
    last = tmp_path / "last.ckpt"
    last.write_text("x")
    trainer = SimpleNamespace(global_step=7, checkpoint_callback=SimpleNamespace(last_model_path=str(last)))
    died = RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly")
    monkeypatch.setattr(worker_memory, "CGROUP_ROOT", str(fake_cgroup(tmp_path / "root", oom_kill=3)))
    named = checks.worker_killed_error(died, trainer, oom_kills_before=2)
    assert isinstance(named, WorkerKilledError)
    assert str(named).startswith("DataLoader worker (pid 4242) was killed by the cgroup's memory limit: 1.00 GiB ("), (
        named
    )
    assert "1 OOM kill(s) during the run" in str(named) and "at global step 7" in str(named)
    assert f"the last checkpoint stands: {last} (resume with `ckpt_path=last`)" in str(named)
    older = checks.worker_killed_error(died, trainer, oom_kills_before=3)  # the count did not grow
    assert older is not None and "not by the cgroup's memory limit (no OOM kill counted in" in str(older)
    assert checks.worker_killed_error(RuntimeError("something else"), trainer) is None


def test_a_worker_that_kills_itself_gives_the_named_error_and_last_ckpt_stands(
    compose_train, tmp_path: Path, monkeypatch
) -> None:
    """A real worker SIGKILLs itself mid-fit under a (fake) cgroup whose OOM-kill count grows: accel-train's run
    raises the named error, with the figures, and the last.ckpt saved before stands."""
    from lightning_accel.train import run

    root = fake_cgroup(tmp_path / "root", oom_kill=0)
    monkeypatch.setattr(worker_memory, "CGROUP_ROOT", str(root))
    real = checks.worker_killed_error

    def after_the_kill(*args, **kwargs):  # the kernel's count, as a real OOM kill would have raised it
        fake_cgroup(root, oom_kill=1)
        return real(*args, **kwargs)

    monkeypatch.setattr(checks, "worker_killed_error", after_the_kill)  # read by the run when it fails
    cfg = compose_train(
        [
            "trainer=smoke",
            "trainer.accelerator=cpu",
            "data.max_chars=200000",
            "data._target_=_killer_data.KilledWorkerData",
            "+data.kill_after=320",  # 10 batches of 32
            "data.num_workers=1",
            "trainer.max_steps=40",
            "trainer.val_check_interval=3",
            "test=false",
            "logger=none",
            "~callbacks.lr_monitor",
        ]
    )
    with pytest.raises(WorkerKilledError, match="was killed by the cgroup's memory limit: 1.00 GiB") as err:
        run(cfg)
    assert "the last checkpoint stands: " in str(err.value)
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
