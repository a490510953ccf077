"""The config groups' types (`lightning_accel.schema`) and the one validation step before launch: each case the probe
of bad inputs named, composed for real; the schemas against the constructors they describe; a user's own app."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import subprocess
import sys
import textwrap
import types
import typing
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException, OverrideParseException
from hydra.utils import get_method

from lightning_accel import schema
from lightning_accel.checks import check_config, check_run
from lightning_accel.errors import ConfigError, ConfigTypeError
from lightning_accel.run_plan import build_run_plan
from lightning_accel.schema import composition_error

CPU = ["trainer.accelerator=cpu"]


# --- types: refused while the config composes, the key named --------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (
            ["threads.pin=maybe"],
            "`threads.pin=maybe`: Value 'maybe' is not a valid bool (type str); `threads.pin` takes",
        ),
        (["threads.worker_cpu=abc"], "`threads.worker_cpu=abc`"),
        (["threads.intra_op=1.5"], "`threads.intra_op` takes an integer, or null"),
        (["micro_batch=auto", "callbacks.micro_batch.memory_fraction=high"], "`callbacks.micro_batch.memory_fraction"),
        (["scheduler=onecycle", "scheduler.pct_start=[1]"], "`scheduler.pct_start=[1]`"),
        (
            ["callbacks.gpu_monitor.device_indices=[a]"],
            "`callbacks.gpu_monitor.device_indices` takes a list of integers",
        ),
    ],
)
def test_a_wrong_type_is_refused_while_composing_naming_the_key(compose_train, overrides, named) -> None:
    with pytest.raises(ConfigCompositionException) as raised:
        compose_train([*overrides, *CPU])
    err = composition_error(raised.value)
    assert isinstance(err, ConfigTypeError) and named in str(err)


def test_threads_pin_no_reads_as_false_and_pins_nothing(compose_train) -> None:
    """It read as the string "no", which is true: the ranks were pinned. OmegaConf's bool reads yes/no, on/off."""
    cfg = compose_train(["threads.pin=no", *CPU])
    assert cfg.threads.pin is False
    plan = build_run_plan(cfg, check_run(cfg))
    assert plan.threads is not None and plan.threads.cpu_sets == ()


def test_an_unknown_key_names_the_keys_there_are(compose_train) -> None:
    with pytest.raises(ConfigCompositionException) as raised:
        compose_train(["threads.pinned=true", *CPU])
    assert "`threads` takes mode, intra_op, wait_policy, worker_cpu, pin" in str(composition_error(raised.value))


def test_an_override_hydra_cannot_parse_is_one_named_line(compose_train) -> None:
    with pytest.raises(OverrideParseException) as raised:
        compose_train(["trainer.max_steps=[", *CPU])
    message = str(composition_error(raised.value))
    assert message.startswith("the override `trainer.max_steps=[` cannot be read") and "\n" not in message


# --- what the types cannot say: the validation step before launch ---------------------------------------------------

REFUSED = [
    (["trainer.gradient_clip_val=nan"], "`trainer.gradient_clip_val=nan` must be a finite number >= 0"),
    (["trainer.gradient_clip_val=-1"], "`trainer.gradient_clip_val=-1` must be a finite number >= 0"),
    (["+trainer.gradient_clip_algorithm=clip"], "`trainer.gradient_clip_algorithm='clip'` must be"),
    (["+trainer.max_time=bogus"], "`trainer.max_time='bogus'` is not a duration Lightning reads; write it as"),
    (["+trainer.max_time=1h"], "`trainer.max_time='1h'` is not a duration Lightning reads"),
    (["+trainer.max_time=5"], "`trainer.max_time=5` is not a duration"),
    (["+trainer.max_time={hrs: 1}"], "`trainer.max_time={'hrs': 1}` is not a duration: a mapping takes only"),
    (["+trainer.max_time={hours: -1}"], "a mapping needs numbers >= 0"),
    (["+trainer.max_time=00:00:00:00"], "is no time at all"),
    (["trainer.val_check_interval=nan"], "`trainer.val_check_interval=nan` validates never or always"),
    (["threads.worker_cpu=nan"], "`threads.worker_cpu=nan` must be a number of CPUs within [0, "),
    (["threads.worker_cpu=-1"], "`threads.worker_cpu=-1.0` must be a number of CPUs within [0, "),
    (["threads.intra_op=0"], "`threads.intra_op=0` must be within [1, "),
    (["threads.mode=fast"], "`threads.mode=fast` is not supported"),
    (
        ["micro_batch=auto", "callbacks.micro_batch.micro_batch_size=48"],
        "`callbacks.micro_batch.micro_batch_size=48` is larger than the batch it splits (`data.batch_size=32`",
    ),
    (
        ["micro_batch=auto", "callbacks.micro_batch.micro_batch_size=12"],
        "`callbacks.micro_batch.micro_batch_size=12` does not divide the batch it splits",
    ),
    (["scheduler.warmup_steps=-1"], "`scheduler.warmup_steps=-1` must be >= 0"),
    (
        ["scheduler=onecycle", "scheduler.pct_start=nan"],
        "`scheduler.pct_start=nan` must be a finite number within (0, 1)",
    ),
    (["scheduler=plateau", "scheduler.factor=2"], "`scheduler.factor=2.0` must be a finite number within (0, 1)"),
]


@pytest.mark.parametrize(("overrides", "message"), REFUSED, ids=[" ".join(o) for o, _ in REFUSED])
def test_a_value_the_type_cannot_refuse_is_named_before_launch(compose_train, overrides, message) -> None:
    with pytest.raises(ConfigError) as raised:
        check_config(compose_train([*overrides, *CPU]))
    assert message in str(raised.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["+trainer.max_time=00:12:00:00"],
        ["+trainer.max_time={hours: 12}"],
        ["trainer.gradient_clip_val=0"],
        ["trainer.gradient_clip_val=null"],
        ["micro_batch=auto", "callbacks.micro_batch.micro_batch_size=8"],
        ["threads.worker_cpu=0.25", "threads.intra_op=2"],
    ],
)
def test_good_values_pass(compose_train, overrides) -> None:
    check_config(compose_train([*overrides, *CPU]))


def test_a_time_between_validations_passes_where_lightning_takes_one(compose_train) -> None:
    from lightning_accel.checks.trainer_settings import _time_based_validation

    cfg = compose_train(["trainer.val_check_interval=00:00:10:00", *CPU])
    if _time_based_validation():  # Lightning 2.6
        check_config(cfg)
    else:
        with pytest.raises(ConfigError, match=r"`trainer.val_check_interval='00:00:10:00'` must be a fraction"):
            check_config(cfg)


def test_accel_train_names_what_does_not_compose_in_one_line_exit_2(monkeypatch, capsys) -> None:
    """The command's own path, in process: Hydra composes before anything runs; a type error is exit 2."""
    from lightning_accel import train

    monkeypatch.setattr(sys, "argv", ["accel-train", "threads.pin=maybe", "check=true", *CPU])
    with pytest.raises(SystemExit) as exited:
        train.main()
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    assert err.strip() == (
        "accel-train: error: `threads.pin=maybe`: Value 'maybe' is not a valid bool (type str); `threads.pin` takes "
        "true or false."
    )


def test_the_command_line_names_an_override_it_cannot_parse(run_cli, tmp_path: Path) -> None:
    """It printed Hydra's "no viable alternative at input '['", naming no override, and exited 1."""
    done = run_cli(["trainer.max_steps=[", "check=true"], cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("accel-train: error: the override `trainer.max_steps=[` cannot be")


def test_bench_refuses_a_stage_named_twice(capsys) -> None:
    """`--ladder baseline,baseline` ran the baseline twice and reported two rows of the same name."""
    from lightning_accel import bench

    with pytest.raises(SystemExit) as exited:
        bench.main(["--ladder", "baseline,amp,baseline", "--dry-run"])
    assert exited.value.code == 2
    assert "argument --ladder: 'baseline,amp,baseline' names baseline more than once" in capsys.readouterr().err


# --- the schemas against what they describe --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(schema.SCHEMAS))
def test_a_schema_types_its_targets_arguments_with_their_defaults(name: str) -> None:
    cls = schema.SCHEMAS[name]
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    target = next((f.default for f in dataclasses.fields(cls) if f.name == "_target_"), None)
    if target is None:  # threads, nccl: groups of their own, read by accel-train
        return
    parameters = inspect.signature(get_method(str(target))).parameters
    for key, field in fields.items():
        assert key in parameters, f"{cls.__name__}.{key} is not an argument of {target}"
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        theirs = parameters[key].default
        if theirs is not inspect.Parameter.empty:
            assert default == (list(theirs) if isinstance(theirs, tuple) else theirs), f"{cls.__name__}.{key}"


_FOREIGN_APP = """
import sys
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from lightning_accel.schema import composition_error

assert "accel_schema" not in ConfigStore.instance().repo  # nothing registered before Hydra opens the app
results = {}
for case, overrides in (("plugin", ["threads.pin=maybe"]), ("typed", ["micro_batch=auto"])):
    with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
        try:
            cfg = compose("config", overrides=overrides)
            results[case] = OmegaConf.get_type(cfg.callbacks.micro_batch).__name__
        except Exception as err:
            results[case] = str(composition_error(err))
print(__import__("json").dumps(results))
"""


def test_a_users_own_app_gets_the_types_through_the_search_path_plugin(tmp_path: Path) -> None:
    """In a fresh interpreter (no schema registered), an app of its own selects `threads` and `micro_batch` through
    the plugin, and OmegaConf refuses a wrong type there as in accel-train."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "config.yaml").write_text(
        textwrap.dedent(
            """\
            defaults:
              - threads: auto
              - micro_batch: none
              - _self_
            callbacks: {}
            data: {batch_size: 32}
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-c", _FOREIGN_APP, str(conf)], capture_output=True, text=True, timeout=120, check=True
    )
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results["plugin"].startswith("`threads.pin=maybe`: Value 'maybe' is not a valid bool")
    assert results["typed"] == "MicroBatchFinderConfig"


def _type_name(hint: typing.Any) -> str:
    """A schema's type as the reference page writes it: `int \\| null`, `list[int]`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        named = " \\| ".join(_type_name(a) for a in args if a is not type(None))
        return named + (" \\| null" if type(None) in args else "")
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return hint.__name__


@pytest.mark.parametrize("name", sorted(schema.SCHEMAS))
def test_the_reference_page_lists_every_typed_option_with_its_type(name: str) -> None:
    page = (Path(__file__).parents[1] / "examples" / "configs.md").read_text()
    cls = schema.SCHEMAS[name]
    for field in dataclasses.fields(cls):
        if not field.name.startswith("_"):
            row = rf"\| `[\w.]+\.{field.name}` \| {re.escape(_type_name(typing.get_type_hints(cls)[field.name]))} \|"
            assert re.search(row, page), f"examples/configs.md has no row for {cls.__name__}.{field.name}"
