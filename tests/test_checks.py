"""check_config: bad settings fail before anything is built or spawned, naming the setting, value and fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_accel.checks import check_combinations, check_config
from lightning_accel.errors import ConfigError


@pytest.mark.parametrize("devices", ["1", "2", "-1", "auto", "'2'", "'0,1'", "[0,1]"])
def test_valid_devices_pass(compose_train, devices: str) -> None:
    check_config(compose_train([f"trainer.devices={devices}"]))


@pytest.mark.parametrize(
    ("override", "setting", "fix"),
    [
        ("trainer.devices=abc", "`trainer.devices='abc'`", "`trainer.devices=2`"),
        ("trainer.devices=0", "`trainer.devices=0`", "-1 for all devices"),
        ("trainer.devices=[]", "`trainer.devices=[]`", "`trainer.devices=[0,1]`"),
        ("trainer.accelerator=gpux", "`trainer.accelerator='gpux'`", "`cpu`"),
        ("trainer.precision=fp4", "`trainer.precision='fp4'`", "`precision=NAME`"),
        ("float32_matmul_precision=tf32", "`float32_matmul_precision='tf32'`", "`high`"),
        ("trainer.strategy=ddpp", "`trainer.strategy='ddpp'`", "`strategy=NAME`"),
        ("trainer.accumulate_grad_batches=0", "`trainer.accumulate_grad_batches=0`", ">= 1"),
        ("trainer.max_steps=ten", "`trainer.max_steps='ten'`", "integer"),
        ("seed=abc", "`seed='abc'`", "must be an integer within"),
        # found by a fault probe: tracebacks or silent acceptance before
        ("trainer.devices=[0,0]", "`trainer.devices=[0, 0]` names a device twice", "`trainer.devices=[0,1]`"),
        ("trainer.val_check_interval=0", "`trainer.val_check_interval=0`", "an integer >= 1"),
        ("trainer.val_check_interval=1.5", "`trainer.val_check_interval=1.5`", "0 < x <= 1.0"),
        ("trainer.max_steps=0", "`trainer.max_steps=0` trains nothing", "`fit=false`"),
        ("trainer.max_steps=0 scheduler=onecycle", "`trainer.max_steps=0` trains nothing", "`fit=false`"),
        ("data.val_fraction=1.5", "`data.val_fraction=1.5`", "within [0, 1)"),
        ("data.val_fraction=0.6 data.test_fraction=0.5", "leaves no training data", "below 1"),
        ("nccl.preset=bogus", "`nccl.preset='bogus'`", "`nccl=NAME`"),
        (
            "model=classifier data=stdlib_text",
            "`model=classifier` (DigitsClassifier) trains on `data=digits`",
            "drop the `data=` override",
        ),
        ("model=gpt data=digits", "`model=gpt` (GPTLanguageModel) trains on `data=stdlib_text`", "`data=stdlib_text`"),
        (
            "trainer.accelerator=cpu trainer.devices=1000",
            "`trainer.devices=1000` starts 1000 CPU processes",
            "use at most",
        ),
    ],
)
def test_bad_setting_names_setting_value_and_fix(compose_train, override: str, setting: str, fix: str) -> None:
    cfg = compose_train(override.split())
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert setting in str(err.value)
    assert fix in str(err.value)


def test_strategy_dict_needs_a_target(compose_train) -> None:
    cfg = compose_train(["~trainer.strategy", "+trainer.strategy={backend: gloo}"])
    with pytest.raises(ConfigError, match="needs a `_target_`"):
        check_config(cfg)


@pytest.mark.slow
def test_cli_rejects_bad_devices_before_any_process_starts(run_cli, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli(
        ["trainer.devices=abc", "trainer.accelerator=cpu", "strategy=ddp", f"hydra.run.dir={run_dir}"], cwd=tmp_path
    )
    assert result.returncode == 2, result.stderr
    assert "accel-train: error: `trainer.devices='abc'`" in result.stderr
    assert "Traceback" not in result.stderr
    # Nothing was built: no second rank, no checkpoints, no logger output.
    assert not (run_dir / "train_rank1.log").exists()
    assert not (run_dir / "checkpoints").exists()
    assert not (run_dir / "csv").exists()


def test_cli_unknown_option_lists_the_valid_ones(run_cli, tmp_path: Path) -> None:
    result = run_cli(["preset=nope", "--cfg", "job"], cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    line = next(line for line in result.stderr.splitlines() if line.startswith("accel-train: error:"))
    assert line.startswith("accel-train: error: `preset=nope` is not an option of `preset`: ")
    assert "the options there are: amp, baseline, ddp" in line


_LIGHTNING_ACC = "lightning.pytorch.callbacks.GradientAccumulationScheduler"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["accumulation=schedule", "trainer.accumulate_grad_batches=4"],
            "`trainer.accumulate_grad_batches=4` conflicts with `callbacks.accumulation`",
        ),
        (
            ["accumulation=global_batch", "callbacks.accumulation.global_batch_size=100"],
            "`callbacks.accumulation.global_batch_size=100` is not a multiple of `data.batch_size=32` x world size 1 "
            "= 32; use 96 or 128",
        ),
        (
            ["accumulation=global_batch", "trainer.devices=3", "strategy=ddp", "trainer.accelerator=cpu"],
            "`callbacks.accumulation.global_batch_size=128` is not a multiple of `data.batch_size=32` x world size 3",
        ),
        (
            ["accumulation=schedule", f"+callbacks.lightning_acc._target_={_LIGHTNING_ACC}"],
            "are all accumulation callbacks",
        ),
    ],
)
def test_accumulation_conflicts_fail_before_launch(compose_train, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_config(compose_train(overrides))
    assert message in str(err.value)


@pytest.mark.parametrize("devices", ["1", "2", "4", "auto"])
def test_global_batch_that_divides_passes(compose_train, devices: str) -> None:
    check_config(compose_train(["accumulation=global_batch", f"trainer.devices={devices}"]))


_MODEL_PARALLEL = "lightning.pytorch.strategies.ModelParallelStrategy"
_GET_METHOD = "hydra.utils.get_method"
_FP16_HOOK = "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook"


@pytest.mark.parametrize(
    ("visible", "overrides", "message", "fix"),
    [
        (
            0,
            ["trainer.accelerator=gpu"],
            "`trainer.accelerator=gpu` but this process sees no CUDA device",
            "use `trainer.accelerator=cpu`",
        ),
        (
            2,
            ["trainer.accelerator=gpu", "trainer.devices=4", "strategy=ddp"],
            "`trainer.devices=4` but only 2 CUDA device(s) are visible",
            "use `trainer.devices=2`",
        ),
        (
            2,
            ["trainer.accelerator=cuda", "trainer.devices=[0,3]", "strategy=ddp"],
            "names device(s) [3]",
            "use indices below 2",
        ),
        (2, ["trainer.devices='0,2'", "strategy=ddp"], "names device(s) [2]", "use indices below 2"),
        (0, ["trainer.strategy=fsdp"], "`trainer.strategy='fsdp'` needs CUDA GPUs", "use `strategy=model_parallel`"),
        (0, ["trainer.strategy=deepspeed_stage_2", "trainer.accelerator=cpu"], "needs CUDA GPUs", "use `strategy=ddp`"),
        (
            2,
            [f"trainer.strategy={{_target_: {_MODEL_PARALLEL}}}", "precision=fp16_mixed"],
            "`trainer.precision=16-mixed` is not supported by `strategy=model_parallel`",
            "use `precision=bf16_mixed`",
        ),
        (
            0,
            ["trainer.precision=transformer-engine"],
            "needs a CUDA GPU (Transformer Engine)",
            "use `precision=bf16_mixed`",
        ),
        (
            0,
            [
                "strategy=ddp",
                "trainer.accelerator=cpu",
                f"+trainer.strategy.ddp_comm_hook._target_={_GET_METHOD}",
                f"+trainer.strategy.ddp_comm_hook.path={_FP16_HOOK}",
            ],
            "has no effect on the CPU",
            "remove it (`~trainer.strategy.ddp_comm_hook`)",
        ),
        (
            0,
            ["micro_batch=auto", "strategy=model_parallel", "precision=bf16_mixed"],
            "(MicroBatchFinder, `micro_batch=auto`) runs on one device or under DDP",
            "use `micro_batch=none`",
        ),
        (
            0,
            ["micro_batch=auto", "strategy=pipeline", "trainer.devices=2"],
            "not with `strategy=pipeline`",
            "or `strategy=ddp`",
        ),
        (
            0,
            ["compile=default", "strategy=pipeline", "trainer.devices=2"],
            "(Compile, `compile=...`) cannot compile the model under `strategy=pipeline`",
            "use `compile=none`",
        ),
        (
            0,
            ["compile=max-autotune", "strategy=model_parallel", "precision=bf16_mixed", "parallel_plan=null"],
            "compiles each block through `callbacks.parallelize`",
            "`parallel_plan.block_classes`",
        ),
    ],
)
def test_invalid_combination_names_the_fix(
    compose_train, monkeypatch: pytest.MonkeyPatch, visible: int, overrides: list[str], message: str, fix: str
) -> None:
    monkeypatch.setattr("lightning_accel.shape._visible_cuda_devices", lambda: visible)
    with pytest.raises(ConfigError) as err:
        check_config(compose_train(overrides))
    assert message in str(err.value)
    assert fix in str(err.value)


@pytest.mark.parametrize(
    ("visible", "overrides"),
    [
        (0, ["trainer.devices=4", "strategy=ddp"]),  # 4 CPU processes
        (2, ["trainer.accelerator=gpu", "trainer.devices=2", "strategy=ddp"]),
        (2, ["trainer.accelerator=gpu", "trainer.devices=-1", "strategy=ddp"]),
        (1, ["trainer.strategy=fsdp"]),  # auto picks the GPU
        (0, [f"trainer.strategy={{_target_: {_MODEL_PARALLEL}}}", "precision=bf16_mixed"]),
        (0, ["micro_batch=auto", "strategy=ddp", "trainer.devices=2", "accumulation=global_batch"]),
        (0, ["compile=default", "strategy=ddp", "trainer.devices=2"]),
        (0, ["compile=reduce-overhead", "strategy=model_parallel", "precision=bf16_mixed"]),
    ],
)
def test_valid_combinations_pass(compose_train, monkeypatch: pytest.MonkeyPatch, visible: int, overrides) -> None:
    monkeypatch.setattr("lightning_accel.shape._visible_cuda_devices", lambda: visible)
    check_config(compose_train(overrides))


@pytest.mark.slow
def test_check_only_validates_and_prints_the_non_default_trainer_settings(run_cli, tmp_path: Path) -> None:
    proc = run_cli(["check=true", "preset=amp", "trainer.max_steps=7"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "the config is valid; nothing was built or launched" in proc.stdout
    assert "max_steps" in proc.stdout and "│ 7 " in proc.stdout.replace("  ", " ")
    assert "precision 'amp' ->" in proc.stdout
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("metrics.csv"))


@pytest.mark.slow
def test_cli_rejects_a_bad_combination_before_launch(run_cli, tmp_path: Path) -> None:
    proc = run_cli(["trainer.accelerator=cpu", "trainer.strategy=fsdp", "trainer.devices=2"], tmp_path)
    assert proc.returncode == 2
    assert "accel-train: error: `trainer.strategy='fsdp'` needs CUDA GPUs" in proc.stderr
    assert "Traceback" not in proc.stderr and "train_rank1.log" not in {p.name for p in tmp_path.rglob("*")}


def test_ddp_grad_compression_sets_the_comm_hook_on_cuda(compose_train) -> None:
    """The plan carries the hook into the Trainer's strategy; the config itself is left as composed."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from lightning_accel.precision import ResolvedPrecision
    from lightning_accel.run_plan import RunPlan, plan_grad_compression
    from lightning_accel.shape import run_shape

    cfg = compose_train(["strategy=ddp", "ddp_grad_compression=bf16", "trainer.accelerator=gpu"])
    before = OmegaConf.to_yaml(cfg)
    hook, note = plan_grad_compression(cfg, run_shape(cfg, visible_cuda=2))
    assert hook is not None and note is not None and "bf16" in note
    precision = ResolvedPrecision(requested="32-true", value="32-true", device="cuda", reason="as asked")
    plan = RunPlan(
        shape=run_shape(cfg, visible_cuda=2), precision=precision, float32_matmul_precision=None, comm_hook=hook
    )
    strategy = plan.trainer_kwargs(cfg)["strategy"]
    assert strategy._ddp_comm_hook is default_hooks.bf16_compress_hook
    assert OmegaConf.to_yaml(cfg) == before and "ddp_comm_hook" not in cfg.trainer.strategy


def test_ddp_grad_compression_on_cpu_is_noted_not_dropped(compose_train) -> None:
    from lightning_accel.checks import check_run
    from lightning_accel.errors import LightningAccelWarning
    from lightning_accel.run_plan import build_run_plan

    cfg = compose_train(["strategy=ddp", "ddp_grad_compression=fp16", "trainer.accelerator=cpu", "trainer.devices=2"])
    with pytest.warns(LightningAccelWarning, match="`ddp_grad_compression=fp16` is not applied on the CPU"):
        plan = build_run_plan(cfg, check_run(cfg, visible_cuda=0))
    assert plan.comm_hook is None and any("not applied" in note for note in plan.notes)
    assert "strategy" not in plan.trainer_kwargs(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy=ddp", "ddp_grad_compression=int8"], "`ddp_grad_compression='int8'` is not supported"),
        (["strategy=auto", "+ddp_grad_compression=bf16"], "needs `strategy=ddp`"),
    ],
)
def test_ddp_grad_compression_bad_input(compose_train, overrides: list[str], message: str) -> None:
    from lightning_accel.run_plan import plan_grad_compression
    from lightning_accel.shape import run_shape

    cfg = compose_train(overrides)
    with pytest.raises(ConfigError, match=message):
        plan_grad_compression(cfg, run_shape(cfg, visible_cuda=0))


# -- the run shape: one source for devices, strategy family, data-parallel size, accumulation callback, CPUs --------


@pytest.mark.parametrize(
    ("devices", "count"),
    [(2, 2), ("2", 2), ([0, 1, 3], 3), ("0,1", 2), ("0,", 1), ("auto", None), (-1, None), ("-1", None), (True, None)],
)
def test_count_devices_reads_every_form_of_trainer_devices(devices: object, count: int | None) -> None:
    from lightning_accel.shape import count_devices

    assert count_devices(devices) == count


@pytest.mark.parametrize(
    ("strategy", "family"),
    [
        ("auto", "auto"),
        ("ddp_spawn", "ddp"),
        ("fsdp_cpu_offload", "fsdp"),
        ({"_target_": "lightning.pytorch.strategies.DDPStrategy"}, "ddp"),
        ({"_target_": "lightning_accel.strategies.pipeline.PipelineStrategy"}, "pipeline"),
        ({"_target_": "my.MyPipelineStrategy"}, "MyPipelineStrategy"),
        ({"_target_": "my.Other"}, "Other"),
    ],
)
def test_strategy_family_names_registry_names_and_targets(strategy: object, family: str) -> None:
    from lightning_accel.shape import strategy_family

    assert strategy_family(OmegaConf.create(strategy) if isinstance(strategy, dict) else strategy) == family


def test_run_shape_is_computed_once_from_the_config() -> None:
    from lightning_accel.shape import run_shape

    cfg = OmegaConf.create(
        {
            "trainer": {
                "accelerator": "auto",
                "devices": "0,1",
                "num_nodes": 2,
                "precision": "bf16-mixed",
                "strategy": {
                    "_target_": "lightning_accel.strategies.pipeline.PipelineStrategy",
                    "data_parallel_size": 2,
                },
            },
            "callbacks": {
                "acc": {"_target_": "lightning.pytorch.callbacks.GradientAccumulationScheduler"},
                "other": {"_target_": "x.NotAnAccumulationSchedulerAtAll"},
                "off": None,
            },
        }
    )
    shape = run_shape(cfg, visible_cuda=2, cpus=3)
    assert (shape.on_cuda, shape.visible_cuda, shape.cpus) == (True, 2, 3)
    assert (shape.devices_per_node, shape.num_nodes, shape.world_size) == (2, 2, 4)
    assert (shape.family, shape.distributed, shape.data_parallel_size()) == ("pipeline", True, 2)
    assert shape.precision == "bf16-mixed" and shape.accumulation_callback == "acc"
    assert run_shape(cfg, visible_cuda=0, cpus=3).on_cuda is False  # auto without a GPU is the CPU


def test_run_shape_counts_cpus_through_the_cgroup_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_accel.shape import run_shape
    from lightning_accel.system.cgroup import CpuBudget

    budget = CpuBudget(affinity=64, quota=1.5)
    monkeypatch.setattr("lightning_accel.system.cgroup.read_cpu_budget", lambda *a, **k: budget)
    cfg = OmegaConf.create({"trainer": {"accelerator": "cpu", "devices": 9}})
    assert run_shape(cfg, visible_cuda=0).cpus == budget.effective == 2
    with pytest.raises(ConfigError, match=r"`trainer.devices=9` starts 9 CPU processes, but this process may use 2"):
        check_combinations(cfg, visible_cuda=0)


def test_a_pipeline_global_batch_splits_over_its_data_parallel_replicas_not_its_stages() -> None:
    """2 pipeline ranks share each batch: global batch 48 from 16 per batch is 3 micro-batches (over the world
    size it would be 48 / (16 x 2), refused)."""
    from lightning_accel.checks.group_settings import _check_accumulation
    from lightning_accel.shape import run_shape

    def cfg(strategy: object, global_batch: int) -> object:
        scheduler = {
            "_target_": "lightning_accel.callbacks.AccumulationScheduler",
            "global_batch_size": global_batch,
            "micro_batch_size": 16,
        }
        return OmegaConf.create(
            {
                "trainer": {"accelerator": "cpu", "devices": 2, "strategy": strategy},
                "callbacks": {"accumulation": scheduler},
            }
        )

    pipeline = {"_target_": "lightning_accel.strategies.pipeline.PipelineStrategy", "data_parallel_size": 1}
    piped = cfg(pipeline, 48)
    _check_accumulation(piped, run_shape(piped, visible_cuda=0, cpus=2))
    ddp = cfg("ddp", 48)
    with pytest.raises(ConfigError, match=r"global_batch_size=48` is not a multiple of `[\w.]*batch_size=16` x"):
        _check_accumulation(ddp, run_shape(ddp, visible_cuda=0, cpus=2))


def test_your_own_pipeline_strategy_is_not_checked_as_ours() -> None:
    """A `_target_` of your own whose name says pipeline keeps its own arguments (ours refuses unknown ones)."""
    strategy = {"_target_": "my_pkg.MyPipelineStrategy", "extra_knob": 3}
    check_combinations(
        OmegaConf.create({"trainer": {"accelerator": "cpu", "devices": 2, "strategy": strategy}}), visible_cuda=0
    )
    ours = {"_target_": "lightning_accel.strategies.pipeline.PipelineStrategy", "extra_knob": 3}
    with pytest.raises(ConfigError, match="extra_knob"):
        check_combinations(
            OmegaConf.create({"trainer": {"accelerator": "cpu", "devices": 2, "strategy": ours}}), visible_cuda=0
        )


def test_compile_without_a_compiler_is_refused_before_launch(compose_train, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_accel.system import software

    monkeypatch.setattr("lightning_accel.shape._visible_cuda_devices", lambda: 0)
    monkeypatch.setattr(software.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError, match="inductor needs a C\\+\\+ compiler") as err:
        check_config(compose_train(["compile=default"]))
    assert err.value.setting == "callbacks.compile.backend"
    check_config(compose_train(["compile=default", "callbacks.compile.backend=aot_eager"]))  # no kernels to build
