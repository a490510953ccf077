"""`lightning_accel.thread_env`, the thread plan applied by accel-train: OMP_WAIT_POLICY before torch loads, the
`threads` group, the environment the launched ranks inherit and torch's pools in each rank (the plan itself:
tests/system/test_thread_plan.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from omegaconf import DictConfig

from lightning_accel.checks import check_run
from lightning_accel.errors import ConfigError
from lightning_accel.run_plan import RunPlan, build_run_plan
from lightning_accel.system.threads import plan_threads
from lightning_accel.thread_env import PLANNED_ENV, apply_thread_plan, set_early_environment, thread_plan_for

SMOKE = ["trainer=smoke", "trainer.accelerator=cpu", "data.max_chars=200000"]


def _plan(cfg: DictConfig) -> RunPlan:
    """The plan as accel-train builds it: shape -> checks -> plan."""
    return build_run_plan(cfg, check_run(cfg))


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {}, "PASSIVE"),
        (["threads.wait_policy=active"], {}, "ACTIVE"),
        (["threads=torch"], {}, None),
        ([], {"OMP_WAIT_POLICY": "active"}, "active"),  # yours wins
    ],
)
def test_the_wait_policy_is_set_before_torch_loads(argv: list[str], env: dict[str, str], expected: str | None) -> None:
    added = set_early_environment(argv, env)
    assert env.get("OMP_WAIT_POLICY") == expected
    assert (PLANNED_ENV in env) == bool(added)


@pytest.mark.slow
def test_libgomp_reads_the_policy_only_if_set_before_import_torch() -> None:
    """Why accel-train sets the wait policy in its entry (`lightning_accel.train_entry`), before the command loads
    torch: OMP_DISPLAY_ENV=VERBOSE shows what libgomp read at load. Its `OMP_WAIT_POLICY` line says PASSIVE when
    unset too; the spin count tells them apart (0: passive)."""
    code = (
        "import sys; from lightning_accel.thread_env import set_early_environment\n"
        "if sys.argv[1] == 'before': set_early_environment([])\n"
        "import torch\n"
        "if sys.argv[1] == 'after': set_early_environment([])\n"
        "torch.ones(4096).sum()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", PLANNED_ENV)}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    seen = {}
    for when in ("before", "after"):
        done = subprocess.run([sys.executable, "-c", code, when], env=env, capture_output=True, text=True, check=True)
        seen[when] = re.search(r"GOMP_SPINCOUNT = '(\d+)'", done.stderr).group(1)
    assert seen == {"before": "0", "after": "300000"}  # after: libgomp's default, spin 300000 times, then sleep


def test_the_threads_group_plans_per_rank_on_this_node(compose_train) -> None:
    plan = _plan(compose_train(["trainer.accelerator=cpu"]))
    assert plan.threads is not None and plan.threads.ranks == 1 and plan.threads.wait_policy == "PASSIVE"
    ddp = _plan(compose_train(["trainer.accelerator=cpu", "strategy=ddp", "trainer.devices=2"]))
    assert ddp.threads is not None and ddp.threads.ranks == 2
    assert ddp.threads.intra_op == max(1, int(ddp.threads.cpus) // 2)
    fixed = _plan(compose_train(["trainer.accelerator=cpu", "threads.intra_op=3", "data.num_workers=1"]))
    assert fixed.threads is not None and fixed.threads.intra_op == 3 and fixed.threads.num_workers == 1
    off = _plan(compose_train(["trainer.accelerator=cpu", "threads=torch"]))
    assert off.threads is None and any("threads=torch" in note for note in off.notes)


@pytest.mark.parametrize(
    ("override", "named"),
    [("threads.mode=fast", "`threads.mode=fast`"), ("threads.wait_policy=spin", "`threads.wait_policy=spin`")],
)
def test_a_bad_threads_setting_is_named(compose_train, override: str, named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        _plan(compose_train(["trainer.accelerator=cpu", override]))


def test_what_a_parent_rank_planned_is_not_read_as_the_users(compose_train) -> None:
    cfg = compose_train(["trainer.accelerator=cpu"])
    shape = _plan(cfg).shape
    inherited = {"OMP_NUM_THREADS": "7", "OMP_WAIT_POLICY": "PASSIVE", PLANNED_ENV: "OMP_NUM_THREADS,OMP_WAIT_POLICY"}
    plan = thread_plan_for(cfg, shape, env=inherited)
    assert plan is not None and plan.kept == {} and plan.intra_op == max(1, int(plan.cpus))
    assert plan.set["OMP_NUM_THREADS"] == str(plan.intra_op)
    users = thread_plan_for(cfg, shape, env={"OMP_NUM_THREADS": "7"})
    assert users is not None and users.intra_op == 7 and users.kept == {"OMP_NUM_THREADS": "7"}


def test_apply_sets_torch_and_the_environment_and_the_undo_restores_them() -> None:
    before = torch.get_num_threads()
    env: dict[str, str] = {}
    undo = apply_thread_plan(plan_threads(cpus=3, env={}), env)
    try:
        assert torch.get_num_threads() == 3
        assert env["OMP_NUM_THREADS"] == "3" and env["OMP_WAIT_POLICY"] == "PASSIVE"
        assert set(env[PLANNED_ENV].split(",")) == {*env} - {PLANNED_ENV}
    finally:
        undo()
    assert torch.get_num_threads() == before and env == {}


@pytest.mark.slow
def test_ddp_ranks_run_with_the_planned_threads_and_wait_policy(ddp_smoke_run) -> None:
    """Both ranks of a 2-process CPU DDP run (conftest's session run, `OMP_DISPLAY_ENV=VERBOSE`, started without
    OMP_WAIT_POLICY, OMP_NUM_THREADS, MKL_NUM_THREADS or a thread plan): libgomp loaded with OMP_WAIT_POLICY=PASSIVE
    (spin count 0 in what OMP_DISPLAY_ENV prints), and each rank's log shows the planned intra-op threads in force."""
    result = ddp_smoke_run.result
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (ddp_smoke_run.cwd / "outputs" / "runs").iterdir()
    assert re.findall(r"GOMP_SPINCOUNT = '(\d+)'", result.stderr) == ["0", "0"]
    for name in ("train.log", "train_rank1.log"):
        text = (run_dir / name).read_text()
        line = next(line for line in text.splitlines() if "threads: " in line)
        planned = int(re.search(r"\((\d+) intra-op thread", line).group(1))
        assert f"this rank: {planned} intra-op thread(s)" in line and "OMP_WAIT_POLICY=PASSIVE" in line, line
        assert "for 2 rank(s)" in line


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_pinned_ranks_each_take_their_own_slice_and_the_undo_restores_it(monkeypatch) -> None:
    """The launching rank pins itself and exports the sets; a launched rank, which inherits the pinned mask, widens
    to its own slice. The undo restores the affinity and the environment."""
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs 2 CPUs")
    first, second = sorted(before)[:2]
    plan = plan_threads(cpus=2, ranks=2, env={}, cpu_sets=((first,), (second,)))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    env: dict[str, str] = {}
    undo = apply_thread_plan(plan, env)
    try:
        assert os.sched_getaffinity(0) == {first}
        assert env["ACCEL_CPU_SETS"] == f"{first};{second}" and "ACCEL_CPU_SETS" in env[PLANNED_ENV]
        child_env = dict(env)
        monkeypatch.setenv("LOCAL_RANK", "1")
        child_undo = apply_thread_plan(plan_threads(cpus=1, env={}), child_env)  # its own plan saw one CPU
        assert os.sched_getaffinity(0) == {second}  # the parent's slice for rank 1, not what it inherited
        child_undo()
        assert os.sched_getaffinity(0) == {first}
    finally:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        undo()
    assert os.sched_getaffinity(0) == before and env == {}


# --- pinning that cannot happen is said, never a traceback -------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
@pytest.mark.parametrize(
    ("sets", "cpus"),
    [("4096", "0-1"), ("0;60000-60001", "0-1,60000-60001"), ("x;y", "0-1"), ("999999999999", "")],
    ids=["a-cpu-not-in-the-budget", "a-cpu-the-os-refuses", "garbage", "an-absurd-cpu"],
)
def test_a_stale_or_forged_cpu_set_from_a_parent_leaves_the_rank_unpinned_with_a_warning(
    monkeypatch, sets: str, cpus: str
) -> None:
    """An `OSError` in `_pin` ("Invalid argument") ended accel-train with a traceback."""
    from lightning_accel.errors import LightningAccelWarning

    before = os.sched_getaffinity(0)
    env = {"ACCEL_CPU_SETS": sets, "ACCEL_CPUS": cpus, PLANNED_ENV: "ACCEL_CPUS,ACCEL_CPU_SETS"}
    monkeypatch.setenv("LOCAL_RANK", "1" if ";" in sets else "0")
    with pytest.warns(LightningAccelWarning, match="is not pinned: ACCEL_CPU_SETS=.* cannot be used") as said:
        undo = apply_thread_plan(plan_threads(cpus=1, env={}), env)
    undo()
    assert "Unset ACCEL_CPU_SETS and ACCEL_CPUS" in str(said[0].message)
    assert os.sched_getaffinity(0) == before


def test_pin_true_on_fewer_cpus_than_ranks_says_nothing_is_pinned(compose_train, monkeypatch) -> None:
    """One CPU for two ranks: nothing was pinned and nothing was said."""
    from lightning_accel.errors import LightningAccelWarning

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    cfg = compose_train([*SMOKE, "threads.pin=true", "strategy=ddp", "trainer.devices=2"])
    plan = thread_plan_for(cfg, _plan(cfg).shape, env={})
    assert plan is not None and plan.cpu_sets == ()
    expected = "not pinned: `threads.pin=true` gives each rank CPUs of its own, and the 1 CPU(s) here (0) cannot be "
    assert expected + "split between 2 ranks" in plan.describe()
    env: dict[str, str] = {}
    with pytest.warns(LightningAccelWarning, match="cannot be split between 2 ranks"):
        apply_thread_plan(plan, env)()
