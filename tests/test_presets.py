"""check_config: bad settings fail before anything is built or spawned, naming the setting, value and fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_accel.errors import ConfigError
from lightning_accel.presets import check_config


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
        ("seed=abc", "`seed='abc'`", "integer or null"),
    ],
)
def test_bad_setting_names_setting_value_and_fix(compose_train, override: str, setting: str, fix: str) -> None:
    cfg = compose_train([override])
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert setting in str(err.value)
    assert fix in str(err.value)


def test_strategy_dict_needs_a_target(compose_train) -> None:
    cfg = compose_train(["~trainer.strategy", "+trainer.strategy={backend: gloo}"])
    with pytest.raises(ConfigError, match="needs a `_target_`"):
        check_config(cfg)


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
    assert result.returncode == 1
    assert "Could not find 'preset/nope'" in result.stderr
    for option in ("amp", "baseline", "ddp"):
        assert f"\t{option}\n" in result.stderr


_LIGHTNING_ACC = "lightning.pytorch.callbacks.GradientAccumulationScheduler"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["accumulation=schedule", "trainer.accumulate_grad_batches=4"],
         "`trainer.accumulate_grad_batches=4` conflicts with `callbacks.accumulation`"),
        (["accumulation=global_batch", "callbacks.accumulation.global_batch_size=100"],
         "`global_batch_size=100` is not a multiple of micro-batch size 32 x world size 1 = 32; use 96 or 128"),
        (["accumulation=global_batch", "trainer.devices=3", "strategy=ddp", "trainer.accelerator=cpu"],
         "`global_batch_size=128` is not a multiple of micro-batch size 32 x world size 3 = 96"),
        (["accumulation=schedule", f"+callbacks.lightning_acc._target_={_LIGHTNING_ACC}"],
         "are all accumulation callbacks"),
    ],
)  # fmt: skip
def test_accumulation_conflicts_fail_before_launch(compose_train, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_config(compose_train(overrides))
    assert message in str(err.value)


@pytest.mark.parametrize("devices", ["1", "2", "4", "auto"])
def test_global_batch_that_divides_passes(compose_train, devices: str) -> None:
    check_config(compose_train(["accumulation=global_batch", f"trainer.devices={devices}"]))
