"""The RunPlan is built once from the composed config and never written back into it: train and accel-bench read it."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import pytest
from omegaconf import DictConfig, OmegaConf

from lightning_accel.checks import CheckedRun
from lightning_accel.run_plan import RunPlan, build_run_plan


def _snapshot(cfg: DictConfig) -> tuple[object, str, dict[str, object]]:
    """Everything that could change: the raw tree (interpolations as written), its YAML, and its node flags."""
    flags = {"readonly": OmegaConf.is_readonly(cfg), "struct": OmegaConf.is_struct(cfg)}
    return OmegaConf.to_container(cfg, resolve=False), OmegaConf.to_yaml(cfg), flags


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer=smoke"],
        ["trainer=smoke", "precision=amp", "nccl=auto"],  # `${accel_precision:...}` resolved into the plan only
        ["trainer=smoke", "strategy=ddp", "trainer.devices=2", "ddp_grad_compression=bf16"],  # hook not applied here
        ["trainer=smoke", "preset=ddp", "trainer.devices=2"],
        ["trainer=smoke", "accumulation=global_batch", "scheduler=onecycle", "micro_batch=auto"],
        ["trainer=smoke", "strategy=model_parallel", "trainer.devices=2"],
    ],
)
def test_planning_and_building_leave_the_composed_config_as_it_was(compose_train, overrides: list[str]) -> None:
    from lightning_accel.train import build, plan_run

    cfg = compose_train(["trainer.accelerator=cpu", *overrides])
    before = _snapshot(cfg)
    untouched = copy.deepcopy(cfg)
    plan = plan_run(cfg)
    assert isinstance(plan, RunPlan)
    datamodule, model, trainer, _ = build(cfg, plan)
    assert _snapshot(cfg) == before
    # as the deep copy (unresolved: `==` resolves `${now:...}`, which moves on between the two sides' resolutions)
    assert OmegaConf.to_container(cfg, resolve=False) == OmegaConf.to_container(untouched, resolve=False)
    assert trainer.precision == plan.precision.value  # the plan's decisions reach the Trainer as arguments
    with pytest.raises(Exception):  # noqa: B017, PT011 - frozen: a decision cannot be edited after the fact
        plan.precision = None  # type: ignore[misc]


def test_a_whole_fit_leaves_the_composed_config_as_it_was(compose_train, tmp_path: Path) -> None:
    from lightning_accel.train import run

    cfg = compose_train(
        [
            "trainer=smoke",
            "trainer.accelerator=cpu",
            "trainer.max_steps=2",
            "precision=amp",
            "data.max_chars=20000",
            f"paths.log_dir={tmp_path}",
        ]
    )
    before = _snapshot(cfg)
    run(cfg)
    assert _snapshot(cfg) == before


def test_the_plan_is_built_once_per_launch(compose_train, monkeypatch: pytest.MonkeyPatch) -> None:
    """One plan for the run: the checks, the precision and the shape are not recomputed by later steps."""
    import lightning_accel.run_plan as run_plan
    import lightning_accel.train as train

    built = []
    real = run_plan.build_run_plan

    def counting(cfg: DictConfig, checked: CheckedRun) -> RunPlan:
        built.append(1)
        return real(cfg, checked)

    monkeypatch.setattr(train, "build_run_plan", counting)
    cfg = compose_train(["trainer=smoke", "trainer.accelerator=cpu", "check=true"])
    train.run(cfg)
    assert built == [1]


def test_accel_bench_plans_its_stages_from_the_run_plan(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from lightning_accel.benchmark import stage_plan

    plans = []
    real = build_run_plan

    def recording(cfg: DictConfig, checked: CheckedRun) -> RunPlan:
        plans.append(real(cfg, checked))
        return plans[-1]

    monkeypatch.setattr(stage_plan, "build_run_plan", recording)
    plan = stage_plan.plan_stage("amp", ["preset=amp", "trainer.accelerator=cpu"], str(tmp_path), visible_cuda=0)
    assert len(plans) == 1 and plan.precision == plans[0].precision.value


# -- accel-bench's path: compose -> shape -> checks -> plan, each module once ---------------------------------------

_FLOW = {
    "lightning_accel.benchmark.stage_config": "stage_config",
    "lightning_accel.shape": "shape",
    "lightning_accel.checks": "checks",
    "lightning_accel.run_plan": "run_plan",
    "lightning_accel.thread_env": "thread_env",
}


def _visits(call: Callable[[], object]) -> list[str]:
    """The flow's modules in the order `call` enters their functions, a stay in one module counted once. Methods and
    properties of the values a step returns (`RunShape.distributed`) read that value, and a first import runs a
    module's body: neither is a visit."""
    import sys

    stays: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        module = str(frame.f_globals.get("__name__", ""))
        step = next((name for prefix, name in _FLOW.items() if f"{module}.".startswith(f"{prefix}.")), None)
        code = frame.f_code
        if step is None or code.co_name == "<module>" or (code.co_argcount and code.co_varnames[0] in ("self", "cls")):
            return  # not ours, a first import running the module's body, or a method of a value
        if not stays or stays[-1] != step:
            stays.append(step)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return stays


@pytest.mark.parametrize("stage", ["amp", "ddp"])  # ddp on the CPU: the stage gets `trainer.devices=2` on the way
def test_a_bench_stage_goes_compose_shape_checks_plan_once_each(
    stage: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from lightning_accel.benchmark import stage_plan

    monkeypatch.setattr("lightning_accel.shape._usable_cpus", lambda: 2)  # 2 CPU ranks, on any machine
    plans: list[object] = []
    stays = _visits(
        lambda: plans.append(
            stage_plan.plan_stage(stage, [f"preset={stage}", "trainer.accelerator=cpu"], str(tmp_path), visible_cuda=0)
        )
    )
    assert plans[0].status == "ok", plans[0]  # type: ignore[attr-defined]
    assert stays == ["stage_config", "shape", "checks", "run_plan", "thread_env"]


def test_the_users_overrides_go_compose_shape_checks(tmp_path: Path) -> None:
    from lightning_accel.benchmark.stage_config import compose_user_config

    assert _visits(lambda: compose_user_config(["trainer.accelerator=cpu"], str(tmp_path))) == [
        "stage_config",
        "shape",
        "checks",
    ]
