"""PipelineStrategy on 2 CPU ranks (gloo): GPipe, 1F1B and interleaved 1F1B train and validate as one process does,
checkpoints resume the same curve and consolidate into the plain GPT, `accel-train preset=pipeline` runs; the stage
planning, the settings and the errors, without ranks; no patch outlives a fit that raised."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import re
import subprocess
import warnings
from pathlib import Path
from typing import Any

import _pipeline_cases as cases
import pytest
import torch
from _torchrun import torchrun

from lightning_accel import examples
from lightning_accel.checks import check_config
from lightning_accel.errors import ConfigError, ConfigTypeError, LightningAccelWarning
from lightning_accel.strategies.checkpoint_io import replace_directory
from lightning_accel.strategies.pipeline import (
    PipelineSettings,
    PipelineStrategy,
    check_dcp_metadata,
    check_microbatches,
    check_pipeline_settings,
    check_precision,
    consolidate_checkpoint,
    load_metadata,
    microbatches_for,
    plan_pipeline_stages,
    prune_to_stages,
    schedule_spec,
    split_batch,
    stage_ranks,
)
from lightning_accel.strategies.pipeline.strategy import _check_module

STEPS = cases.EPOCHS * cases.BATCHES_PER_EPOCH
TOLERANCE = 1e-4  # relative, fp32: micro-batch losses are scaled so that they sum to the batch mean
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b"]  # the three, also run on 4 ranks
ZERO_BUBBLE = ["looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"]  # torch 2.13 has them all
N_PARAMS = 69  # tensors in GPT-tiny with 4 blocks


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return cases.reference()


@dataclasses.dataclass
class Launch:
    """What one torchrun launch of _pipeline_cases.py left: each rank's record of each case, and how it ended."""

    records: list[dict[str, Any]]
    """Per rank, case name -> its result, `{"error": traceback}` or `{"not_run": reason}`; {} for a rank that wrote
    nothing."""
    ended: str
    """How the launch ended (exit status, the end of stderr), shown for a case without a result."""

    def case(self, name: str) -> list[dict[str, Any]]:
        """`name`'s result on every rank; fails the calling test, and only it, with what each rank recorded."""
        problems, launch_broke = [], False
        for rank, records in enumerate(self.records):
            record = records.get(name)
            if record is None or "not_run" in record:
                problems.append(f"rank {rank}: " + (record["not_run"] if record else "no result"))
                launch_broke = True
            elif "error" in record:
                problems.append(f"rank {rank} raised:\n{record['error']}")
        if problems:
            ended = f"\n{self.ended}" if launch_broke else ""
            pytest.fail(f"case {name!r}: " + "\n".join(problems) + ended, pytrace=False)
        return [records[name] for records in self.records]


def _launch(out: Path, ranks: int, *names: str) -> Launch:
    """Every case in `names` in one torchrun launch of `ranks` processes; a case that raises fails only its tests."""
    try:
        proc = torchrun(cases.__file__, str(out), *names, ranks=ranks, env={"OMP_NUM_THREADS": "1"})
        ended = f"the launch exited with {proc.returncode}; its stderr ends:\n{proc.stderr[-4000:]}"
    except subprocess.TimeoutExpired as err:
        stderr = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else err.stderr or ""
        ended = f"the launch ran past {err.timeout:.0f} s and was killed; its stderr ends:\n{stderr[-4000:]}"
    files = [out / f"rank{rank}.json" for rank in range(ranks)]
    return Launch([json.loads(f.read_text()) if f.is_file() else {} for f in files], ended)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """Every 2-rank case of _pipeline_cases.py in one torchrun launch (~15 s on 2 idle cores)."""
    available = [name for name in ZERO_BUBBLE if _available(name)]
    names = [
        *SCHEDULES,
        *available,
        "accumulate",
        "accumulation_scheduler",
        "resume",
        "bf16-mixed",
        "bf16-true",
        "split_points",
        "short_val",
        "raises_mid_epoch",
    ]
    return _launch(tmp_path_factory.mktemp("pipeline"), 2, *names)


def _available(schedule: str) -> bool:
    try:
        schedule_spec(schedule)
    except ConfigError:
        return False
    return True


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_reference_learns_and_clips(reference: dict[str, Any]) -> None:
    losses = reference["losses"]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.5
    assert reference["clipped"] > STEPS // 2  # clipping acts, so its norm must span both stages


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES + ZERO_BUBBLE)
def test_two_stages_match_one_process(two_ranks: Launch, reference: Any, schedule: str) -> None:
    if schedule in ZERO_BUBBLE and not _available(schedule):
        pytest.skip(f"torch {torch.__version__} has no {schedule} schedule")  # the error for it is tested below
    rank0, rank1 = two_ranks.case(schedule)
    train, val = _relative(rank0["losses"], reference["losses"]), _relative(rank0["val"], reference["val"])
    print(f"{schedule}, pp=2: max relative difference over {STEPS} steps: train loss {train:.1e}, val loss {val:.1e}")
    assert rank0["global_step"] == rank1["global_step"] == STEPS
    assert _relative(rank0["losses"], reference["losses"]) < TOLERANCE
    assert _relative(rank0["val"], reference["val"]) < TOLERANCE and len(rank0["val"]) == cases.EPOCHS
    assert rank1["losses"] == rank0["losses"] and rank1["val"] == rank0["val"]  # the broadcast loss, on every rank
    # each rank holds only its stages: together the whole model, apart nothing in common
    expected = {
        "gpipe": ([0], [1]),
        "1f1b": ([0], [1]),
        "zbv_zero_bubble": ([0, 3], [1, 2]),
        "dualpipev": ([0, 3], [1, 2]),
    }.get(schedule, ([0, 2], [1, 3]))
    assert (rank0["local_stages"], rank1["local_stages"]) == expected
    full = sum(p.numel() for p in cases.make_model().parameters())
    assert rank0["n_params"] + rank1["n_params"] == full and 0 < rank0["n_params"] < full


@pytest.mark.slow
def test_a_short_last_validation_batch_runs_under_1f1b(two_ranks: Launch, reference: Any) -> None:
    """3 samples left over: fewer than 1F1B's 2 stages need as micro-batches; they go through the stages in order."""
    rank0, rank1 = two_ranks.case("short_val")
    assert rank0["global_step"] == STEPS and len(rank0["val"]) == cases.EPOCHS
    assert rank0["val"] == rank1["val"] and all(math.isfinite(v) for v in rank0["val"])
    assert _relative(rank0["losses"], reference["losses"]) < TOLERANCE  # training is untouched
    assert rank0["val"] != two_ranks.case("1f1b")[0]["val"]  # the extra samples were evaluated


def test_micro_batch_rules_of_each_schedule_are_config_errors(compose_train) -> None:
    check_microbatches("gpipe", 1, 2, 2)
    with pytest.raises(ConfigError, match=r"^`n_microbatches=1` is fewer than the 2 pipeline stages"):
        check_microbatches("1f1b", 1, 2, 2)
    with pytest.raises(ConfigError, match=r"^`n_microbatches=9` is not a multiple of its 2 rounds"):
        check_microbatches("interleaved_1f1b", 9, 8, 4)
    check_microbatches("interleaved_1f1b", 8, 8, 4)
    with pytest.raises(ConfigError, match=r"`trainer.strategy.n_microbatches=1` is fewer than the 2 pipeline stages"):
        check_config(
            compose_train(
                [
                    "preset=pipeline",
                    "trainer.accelerator=cpu",
                    "trainer.strategy.n_microbatches=1",
                    "trainer.strategy.schedule=1f1b",
                ]
            )
        )


@pytest.mark.slow
def test_split_points_make_uneven_stages(two_ranks: Launch, reference: Any) -> None:
    """`split_points=["blocks.1"]`: stage 0 runs the embeddings and 1 block, stage 1 the other 3 and the head."""
    rank0, rank1 = two_ranks.case("split_points")
    block = sum(p.numel() for p in cases.make_model().blocks[0].parameters())
    assert rank1["n_params"] - rank0["n_params"] > block  # 3 blocks + the head outweigh 1 block + the embeddings
    assert _relative(rank0["losses"], reference["losses"]) < TOLERANCE
    assert _relative(rank0["val"], reference["val"]) < TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("case", ["accumulate", "accumulation_scheduler"])
def test_accumulation_adds_batches_after_micro_batches(two_ranks: Launch, reference: Any, case: str) -> None:
    """2 batches of 4 (each 4 micro-batches of 1) per optimizer step train as one batch of 8, whether
    `accumulate_grad_batches=2` or `AccumulationScheduler({0: 2})` sets the window."""
    run = two_ranks.case(case)[0]
    assert run["global_step"] == STEPS and len(run["losses"]) == 2 * STEPS
    per_step = [(a + b) / 2 for a, b in zip(run["losses"][::2], run["losses"][1::2], strict=True)]
    assert _relative(per_step, reference["losses"]) < TOLERANCE
    assert _relative(run["val"], reference["val"]) < TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "tolerance"), [("bf16-mixed", 2e-3), ("bf16-true", 2e-2)])
def test_bf16_presets_follow_the_fp32_curve(
    two_ranks: Launch, reference: Any, precision: str, tolerance: float
) -> None:
    run, other = two_ranks.case(precision)
    print(
        f"{precision}, pp=2: max relative difference from fp32 over {STEPS} steps "
        f"{_relative(run['losses'], reference['losses']):.1e}"
    )
    assert run["global_step"] == STEPS and other["losses"] == run["losses"]
    assert _relative(run["losses"], reference["losses"]) < tolerance


@pytest.mark.slow
def test_checkpoint_resumes_and_consolidates(two_ranks: Launch, reference: Any) -> None:
    runs = two_ranks.case("resume")
    for resume in runs:
        full, resumed = resume["full"], resume["resumed"]
        assert resume["checkpoint_is_directory"]
        assert resumed["global_step"] == STEPS and len(resumed["losses"]) == STEPS // 2
        print(
            f"resume from step 10: max relative difference over steps 11-20 "
            f"{_relative(resumed['losses'], full['losses'][STEPS // 2 :]):.1e}"
        )
        assert _relative(resumed["losses"], full["losses"][STEPS // 2 :]) < 1e-6
        assert _relative(resumed["val"], full["val"][1:]) < 1e-6
    consolidated = runs[0]
    assert consolidated["consolidated_keys_match"]
    print(
        f"consolidated checkpoint, plain GPT: val loss {consolidated['consolidated_val']:.6f}, "
        f"pipeline {consolidated['full']['val'][-1]:.6f}"
    )
    assert abs(consolidated["consolidated_val"] - consolidated["full"]["val"][-1]) < TOLERANCE * reference["val"][-1]


@pytest.mark.slow
def test_no_patch_remains_after_a_fit_that_raises_mid_epoch(two_ranks: Launch) -> None:
    """The clipping patch is undone by the strategy's `on_exception` itself: the case holds `teardown` back (Lightning
    calls it after an exception too), so that it cannot be what undid it."""
    for run in two_ranks.case("raises_mid_epoch"):
        assert run["raised"] == "mid-epoch failure" and run["global_step"] == 3
        assert run["patched_while_training"] and not run["patch_left_after_on_exception"]


@pytest.mark.slow
def test_pp2_x_dp2_on_four_ranks(tmp_path: Path, reference: dict[str, Any]) -> None:
    """pp=2 x dp=2: replicated and FSDP2-sharded stages; 4 CPU processes (~60 s on 2 cores), so `-m slow` only."""
    launch = _launch(
        tmp_path, 4, *SCHEDULES, "resume", "fsdp_resume", "fsdp_interleaved", "fsdp_accumulation_scheduler"
    )
    for case in [*SCHEDULES, "fsdp_interleaved"]:
        for run in launch.case(case):
            assert _relative(run["losses"], reference["losses"]) < TOLERANCE, case
            assert _relative(run["val"], reference["val"]) < TOLERANCE, case
    for case in ("resume", "fsdp_resume"):
        runs = launch.case(case)
        for run in runs:
            full, resumed = run["full"], run["resumed"]
            assert _relative(full["losses"], reference["losses"]) < TOLERANCE
            assert _relative(resumed["losses"], full["losses"][STEPS // 2 :]) < 1e-6
        assert abs(runs[0]["consolidated_val"] - reference["val"][-1]) < TOLERANCE * reference["val"][-1]
    for run in launch.case("fsdp_accumulation_scheduler"):
        windows = run["losses"]
        per_step = [(a + b) / 2 for a, b in zip(windows[::2], windows[1::2], strict=True)]
        assert _relative(per_step, reference["losses"]) < TOLERANCE
    assert sum(r["dtensor_params"] for r in launch.case("fsdp_interleaved")) == 2 * N_PARAMS  # every tensor sharded


# -- stage planning, without ranks -------------------------------------------------------------------------------


def test_even_split_and_split_points() -> None:
    assert plan_pipeline_stages(5, block_list="blocks", n_stages=2).blocks == [[0, 1, 2], [3, 4]]
    plan = plan_pipeline_stages(6, block_list="layers", split_points=["layers.1", "layers.4"])
    assert plan.blocks == [[0], [1, 2, 3], [4, 5]] and plan.split_points() == ["layers.1", "layers.4"]
    assert stage_ranks(4, 2, "loop") == [0, 1, 0, 1]
    assert stage_ranks(4, 2, "v") == [0, 1, 1, 0]  # ZBV / DualPipeV: rank 0 holds the first and the last stage


@pytest.mark.parametrize(
    ("kwargs", "message", "setting"),
    [
        (
            {"split_points": ["blocks.9"]},
            r"`split_points` names 'blocks.9', which is not a block of the model",
            "split_points",
        ),
        ({"split_points": ["blocks.2", "blocks.1"]}, r"must be distinct, in increasing order", "split_points"),
        ({"n_stages": 5}, r"`n_stages=5` is more stages than the model's 4 blocks", "n_stages"),
        ({"split_points": ["blocks.2"], "n_stages": 3}, r"`n_stages=3` disagrees", "n_stages"),
    ],
)
def test_bad_splits_name_the_argument(kwargs: dict[str, Any], message: str, setting: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        plan_pipeline_stages(4, block_list="blocks", **kwargs)
    assert err.value.setting == setting and "trainer.strategy" not in str(err.value)


def test_stages_keep_plain_names_and_compose_to_the_plain_forward() -> None:
    torch.manual_seed(0)
    model = examples.GPTLanguageModel(block_size=8, n_layer=4, n_head=2, n_embd=16)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    idx = torch.randint(0, 256, (3, 8))
    expected = model(idx)
    plan = plan_pipeline_stages(4, block_list="blocks", n_stages=4)
    views = prune_to_stages(model, plan, [0, 1, 2, 3])  # every stage on one rank: the chain is the whole model
    hidden = idx
    for view in views:
        hidden = view(hidden)
    torch.testing.assert_close(hidden, expected)
    assert set(model.state_dict()) == set(reference)  # nothing renamed
    first = prune_to_stages(examples.GPTLanguageModel(block_size=8, n_layer=4, n_head=2, n_embd=16), plan, [1, 3])
    assert len(first) == 2
    owner = first[0]
    assert owner.tok_emb is None and owner.lm_head is None and isinstance(owner.blocks[0], torch.nn.Identity)
    assert {k.split(".")[1] for k in owner.state_dict() if k.startswith("blocks.")} == {"1"}


def test_schedule_lookup_names_the_torch_version(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.pipelining import schedules

    spec = schedule_spec("interleaved_1f1b")
    assert schedule_spec("1f1b").schedule_class is schedules.Schedule1F1B and schedule_spec("1f1b").single_stage
    assert (spec.stages_per_rank, spec.placement, spec.single_stage) == (2, "loop", False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.placement = "v"  # type: ignore[misc]
    with pytest.raises(ConfigError, match=r"`schedule='pipedream'` is not a pipeline schedule"):
        schedule_spec("pipedream")
    monkeypatch.delattr(schedules, "ScheduleZBVZeroBubble")
    with pytest.raises(ConfigError, match=re.escape(f"which torch {torch.__version__} does not have; use one of")):
        PipelineStrategy(schedule="zbv_zero_bubble")


def test_an_old_torch_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.pipelining import schedules

    def old_init(self: Any, stage: Any, n_microbatches: int, loss_fn: Any = None) -> None: ...

    monkeypatch.setattr(schedules.PipelineScheduleSingle, "__init__", old_init)
    with pytest.raises(ConfigError, match=re.escape(f"(scale_grads=False), which torch {torch.__version__} lacks")):
        PipelineStrategy()


def test_fewer_micro_batches_than_stages_warns() -> None:
    with pytest.warns(LightningAccelWarning, match=r"`n_microbatches=2` is fewer than the 4"):
        assert microbatches_for(2, 4) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert microbatches_for(None, 4) == 4 and microbatches_for(8, 4) == 8


def test_trainer_level_errors() -> None:
    with pytest.raises(ConfigError, match=r"A training batch of 6 samples does not divide into `n_microbatches=4`"):
        split_batch((torch.zeros(6, 8), torch.zeros(6, 8)), 4, train=True)
    # the last, smaller evaluation batch runs through the stages in order, as one micro-batch
    assert split_batch((torch.zeros(6, 8), torch.zeros(6, 8)), 4, train=False)[2] == 1
    model = examples.GPTLanguageModel(n_layer=2)
    model.automatic_optimization = False
    with pytest.raises(ConfigError, match=r"`automatic_optimization=False`, which PipelineStrategy does not"):
        _check_module(model)
    with pytest.raises(ConfigError, match=r"`precision=16-mixed` is not supported by `PipelineStrategy`") as err:
        check_precision("16-mixed")
    assert err.value.setting == "precision"
    check_precision("bf16-mixed")


@pytest.mark.parametrize(
    ("kwargs", "error", "message", "setting"),
    [
        ({"n_stages": 0}, ConfigError, r"`n_stages=0` must be a positive integer", "n_stages"),
        ({"n_microbatches": 0}, ConfigError, r"`n_microbatches=0` must be a positive integer", "n_microbatches"),
        ({"n_stages": "3"}, ConfigTypeError, r"`n_stages='3'` must be a positive integer", "n_stages"),
        (
            {"data_parallel": "zero"},
            ConfigError,
            r"`data_parallel='zero'` must be 'replicate' or 'fsdp'",
            "data_parallel",
        ),
        (
            {"split_points": [2]},
            ConfigTypeError,
            r"`split_points=\(2,\)` must be a list of module names",
            "split_points",
        ),
        ({"split_points": ["blocks.2"], "n_stages": 3}, ConfigError, r"`n_stages=3` disagrees", "n_stages"),
        ({"schedule": "zigzag"}, ConfigError, r"`schedule='zigzag'` is not a pipeline schedule", "schedule"),
    ],
)
def test_a_plain_script_sees_the_constructor_argument(
    kwargs: dict[str, Any], error: type, message: str, setting: str
) -> None:
    """No Hydra here: the error names `PipelineStrategy`'s own argument, never a config path."""
    with pytest.raises(error, match=message) as err:
        PipelineStrategy(**kwargs)
    assert err.value.setting == setting and "trainer.strategy" not in str(err.value)


def test_settings_hold_the_constructor_defaults_once() -> None:
    """The constructor's signature reads its defaults from `PipelineSettings`, and the config mirrors it."""
    import yaml

    from lightning_accel.strategies.pipeline.pipeline_settings import DEFAULTS

    parameters = inspect.signature(PipelineStrategy).parameters
    fields = [field.name for field in dataclasses.fields(PipelineSettings)]
    assert list(parameters) == fields
    assert all(parameters[name].default == getattr(DEFAULTS, name) for name in fields)
    conf = yaml.safe_load((Path(examples.__file__).parents[1] / "conf/strategy/pipeline.yaml").read_text())
    keys = set(conf["trainer"]["strategy"]) - {"_target_"}
    assert keys <= set(fields) and conf["trainer"]["strategy"]["schedule"] == DEFAULTS.schedule
    assert PipelineStrategy(split_points=["blocks.2"]).settings.split_points == ("blocks.2",)


def test_the_world_size_checks_run_before_launch_and_in_setup() -> None:
    """`validate(world=...)`: what `setup` checks against the world size, also run by the pre-launch check."""
    with pytest.raises(
        ConfigError,
        match=r"`schedule=1f1b` runs one stage per pipeline rank, but there are 4 stages "
        r"for 2 ranks; use `n_stages=2`",
    ) as err:
        PipelineSettings(n_stages=4).validate(world=2)
    assert err.value.setting == "schedule"
    with pytest.raises(ConfigError, match=r"`schedule=interleaved_1f1b` needs at least 2 stages per pipeline rank"):
        PipelineSettings(schedule="interleaved_1f1b", n_stages=2).validate(world=2)
    with pytest.raises(ConfigError, match=r"`data_parallel_size=3` does not divide the world size 4"):
        PipelineSettings(data_parallel_size=3).validate(world=4)
    with pytest.raises(ConfigError, match=r"`n_microbatches=1` is fewer than the 2 pipeline stages"):
        check_pipeline_settings({"_target_": "x.PipelineStrategy", "n_microbatches": 1}, world=2)
    with pytest.raises(ConfigTypeError, match=r"`n_microbatch` is not an argument of PipelineStrategy"):
        check_pipeline_settings(n_microbatch=4)
    with pytest.warns(LightningAccelWarning, match=r"has a single pipeline rank"):
        assert check_pipeline_settings({"schedule": "gpipe"}, world=1, precision="32-true").schedule == "gpipe"
    PipelineSettings(schedule="interleaved_1f1b", n_microbatches=8).validate(world=4, precision="bf16-mixed")


def test_predict_names_the_way_out() -> None:
    with pytest.raises(NotImplementedError, match=r"does not run `trainer.predict`; consolidate the checkpoint"):
        PipelineStrategy().predict_step((torch.zeros(2, 8), torch.zeros(2, 8)), 0)


def test_config_errors_before_launch(compose_train) -> None:
    """accel-train's check names the config paths the user wrote (`trainer.strategy.X`, `trainer.precision`)."""
    cfg = compose_train(["preset=pipeline", "trainer.accelerator=cpu"])
    check_config(cfg)
    assert cfg.trainer.strategy._target_.endswith("PipelineStrategy") and cfg.model.n_layer == 4
    with pytest.raises(ConfigError, match=r"`trainer.precision=16-mixed` is not supported by `PipelineStrategy`"):
        check_config(compose_train(["preset=pipeline", "trainer.accelerator=cpu", "trainer.precision=16-mixed"]))
    with pytest.raises(ConfigError, match=r"`trainer.strategy.data_parallel_size=3` does not divide the world size 2"):
        check_config(
            compose_train(["preset=pipeline", "trainer.accelerator=cpu", "trainer.strategy.data_parallel_size=3"])
        )
    with pytest.raises(ConfigError, match=r"`trainer.strategy.schedule='zigzag'` is not a pipeline schedule"):
        check_config(compose_train(["preset=pipeline", "trainer.accelerator=cpu", "trainer.strategy.schedule=zigzag"]))
    with pytest.raises(
        ConfigError,
        match=r"`trainer.strategy.schedule=1f1b` runs one stage per pipeline rank, but "
        r"there are 4 stages for 2 ranks; use `n_stages=2`",
    ):
        check_config(compose_train(["preset=pipeline", "trainer.accelerator=cpu", "trainer.strategy.n_stages=4"]))
    with pytest.raises(ConfigTypeError, match=r"`trainer.strategy.n_stages='two'` must be a positive integer"):
        check_config(compose_train(["preset=pipeline", "trainer.accelerator=cpu", "trainer.strategy.n_stages=two"]))


@pytest.mark.slow  # ~30 s; the two-stage parity with one process and the preset's checks run by default
def test_accel_train_preset_pipeline_on_two_cpu_processes(run_cli, tmp_path: Path) -> None:
    """`accel-train preset=pipeline trainer.devices=2`, tiny: fit with validation, checkpoint, test on the best one."""
    smoke = ["trainer=smoke", "trainer.accelerator=cpu", "data.max_chars=200000", "trainer.devices=2"]
    result = run_cli(["preset=pipeline", *smoke], cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = next((tmp_path / "outputs" / "runs").iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["tested_weights"] == "best"
    best = Path(summary["best_checkpoint"])
    assert best.is_dir() and (best / ".metadata").is_file()  # a distributed checkpoint: one slice per stage
    metrics = summary["metrics"]
    assert metrics["test/bpc"] < summary["baselines"]["uniform_bpc"]
    state = consolidate_checkpoint(best)
    plain = examples.GPTLanguageModel(n_layer=4)
    assert set(state) == set(plain.state_dict())


def test_consolidating_a_non_checkpoint_fails(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a distributed checkpoint directory"):
        consolidate_checkpoint(tmp_path)
    from lightning_accel.strategies.pipeline import SCHEDULES as TABLE

    assert TABLE["gpipe"][0] == "ScheduleGPipe"


class _Payload:
    """Pickles into a call of `marker.touch()`: what a planted checkpoint would run on load."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


def _checkpoint_with_payload(tmp_path: Path) -> tuple[Path, Path]:
    """A real distributed-checkpoint directory (one process) whose `meta.pt` carries a payload."""
    import torch.distributed.checkpoint as dcp
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    path, marker = tmp_path / "last.ckpt", tmp_path / "payload-ran"
    dcp.save({"state_dict": {"w": torch.ones(2)}}, checkpoint_id=path)
    torch.save({"epoch": 1, "global_step": 10, "hyper_parameters": {"x": _Payload(marker)}}, path / _METADATA_FILENAME)
    return path, marker


def test_a_planted_payload_in_the_metadata_never_runs(tmp_path: Path) -> None:
    path, marker = _checkpoint_with_payload(tmp_path)
    with pytest.raises(ConfigError, match="holds more than tensors and plain types") as err:
        consolidate_checkpoint(path, out=tmp_path / "plain.ckpt")
    assert "weights_only=False" in str(err.value) and "meta.pt" in str(err.value)
    with pytest.raises(ConfigError, match="could run code"):
        load_metadata(path / "meta.pt")  # what PipelineStrategy.load_checkpoint calls first (weights_only=None)
    assert not marker.exists() and not (tmp_path / "plain.ckpt").exists()
    load_metadata(path / "meta.pt", weights_only=False)  # the caller's explicit trust: it runs
    assert marker.exists()


def test_a_planted_payload_in_the_checkpoint_index_never_runs(tmp_path: Path) -> None:
    """torch reads a distributed checkpoint's `.metadata` with plain pickle: it is checked against an allowlist."""
    import pickle

    path, marker = _checkpoint_with_payload(tmp_path)
    torch.save({"epoch": 1}, path / "meta.pt")  # a clean metadata file: the index is what carries the payload here
    check_dcp_metadata(path)  # a real index passes
    index = pickle.loads((path / ".metadata").read_bytes())
    index.planted = _Payload(marker)
    (path / ".metadata").write_bytes(pickle.dumps(index))
    with pytest.raises(ConfigError, match="pathlib.Path.touch|could run code"):
        consolidate_checkpoint(path)
    assert not marker.exists()


def test_a_save_that_dies_leaves_the_previous_checkpoint_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory is written under a temporary name and renamed over the old one only when complete."""
    import torch.distributed.checkpoint as dcp

    strategy = PipelineStrategy()
    monkeypatch.setattr(type(strategy), "global_rank", property(lambda self: 0))
    monkeypatch.setattr(strategy, "broadcast", lambda obj, src=0: obj)
    monkeypatch.setattr(strategy, "barrier", lambda *a, **k: None)
    last = tmp_path / "last.ckpt"
    strategy.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 1}, last)
    assert (last / ".metadata").is_file() and torch.load(last / "meta.pt", weights_only=True) == {"epoch": 1}

    def dies(state: Any, checkpoint_id: Path) -> None:  # SIGKILL / a full disk half-way through the shards
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp, "save", dies)
    with pytest.raises(OSError, match="No space"):
        strategy.save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "epoch": 2}, last)
    assert torch.load(last / "meta.pt", weights_only=True) == {"epoch": 1}  # the previous one, whole
    assert (last / ".metadata").is_file()
    # the swap itself: the new directory replaces the old, which is gone afterwards
    new = tmp_path / "new"
    new.mkdir()
    (new / "marker").write_text("new")
    replace_directory(new, last)
    assert (last / "marker").read_text() == "new" and not new.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".last.ckpt.old")]
