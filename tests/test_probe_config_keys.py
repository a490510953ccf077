"""The probe of bad inputs, extended to every key of this package's config groups: each key tried with a
value of the wrong type, NaN, a negative value and a huge one ends in a named `ConfigError` (the key in its message),
or is accepted for the reason written beside it in `ACCEPTED`, never in a traceback.

In process, in seconds: each group option is composed once with Hydra's compose API, and each case applies its
override the way that composition does (`ConfigLoaderImpl._apply_overrides_to_config`, the function Hydra's compose
applies every command-line override with), then runs what accel-train runs before launch (`plan_run`, then the
callbacks' constructors). tests/test_schema.py composes the named cases for real, and runs two on the command line.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import typing
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, open_dict

from lightning_accel import schema
from lightning_accel.compose import instantiate_callbacks
from lightning_accel.errors import ConfigError
from lightning_accel.launch import register_resolvers
from lightning_accel.schema import composition_error
from lightning_accel.train import plan_run

CPU = ["trainer.accelerator=cpu"]

# Where each schema's node is in a composed config, and the options that put it there. Options that go together share
# one composed config (each composition takes most of a second).
TOGETHER = [
    "micro_batch=auto",
    "compile=default",
    "lr_scaling=linear",
    "callbacks=[default,dataloader_tuner,preflight]",
]
NODES: dict[str, tuple[type, list[str]]] = {
    "threads": (schema.ThreadsConfig, TOGETHER),
    "nccl": (schema.NcclConfig, TOGETHER),
    "callbacks.micro_batch": (schema.MicroBatchFinderConfig, TOGETHER),
    "callbacks.compile": (schema.CompileConfig, TOGETHER),
    "callbacks.lr_scaling": (schema.LRScalingConfig, TOGETHER),
    "callbacks.accumulation": (schema.AccumulationSchedulerConfig, ["accumulation=schedule"]),
    "callbacks.accumulation#global_batch": (schema.AccumulationSchedulerConfig, ["accumulation=global_batch"]),
    "callbacks.matmul_precision": (schema.MatmulPrecisionConfig, TOGETHER),
    "callbacks.gpu_monitor": (schema.GPUMonitorConfig, TOGETHER),
    "callbacks.dataloader_tuner": (schema.DataLoaderTunerConfig, TOGETHER),
    "callbacks.nonfinite": (schema.NonFiniteGuardConfig, TOGETHER),
    "callbacks.stop_on_signal": (schema.StopOnSignalConfig, TOGETHER),
    "callbacks.preflight": (schema.PreflightConfig, TOGETHER),
    "callbacks.parallelize": (schema.ParallelizeConfig, ["strategy=model_parallel"]),
    "scheduler": (schema.CosineScheduleConfig, TOGETHER),
    "scheduler#linear_warmup": (schema.LinearWarmupScheduleConfig, ["scheduler=linear_warmup"]),
    "scheduler#onecycle": (schema.OneCycleScheduleConfig, ["scheduler=onecycle"]),
    "scheduler#plateau": (schema.PlateauScheduleConfig, ["scheduler=plateau"]),
}
# Keys the groups write outside a typed node (Lightning's Trainer settings and a top-level key), with their types, and
# the Trainer settings the issue names.
PLAIN: dict[str, tuple[typing.Any, list[str]]] = {
    "trainer.accumulate_grad_batches": (int, TOGETHER),
    "trainer.precision": (str, TOGETHER),
    "float32_matmul_precision": (str | None, TOGETHER),
    "trainer.gradient_clip_val": (float | None, TOGETHER),
    "trainer.val_check_interval": (float | None, TOGETHER),
    "+trainer.max_time": (str | None, TOGETHER),
}

HUGE_INT = "99999999999999999999"
VALUES = {  # wrong type, NaN, negative, huge
    bool: ["maybe", "nan", "-1", "1e300"],
    int: ["abc", "nan", "-1", HUGE_INT],
    float: ["abc", "nan", "-1", "1e300"],
    str: ["[1]", "nan", "-1", "1e300"],
    list: ["abc", "[nan]", "[-1]", f"[{HUGE_INT}]"],
    dict: ["abc", "{x: nan}", "{x: -1}", "{x: 1e300}"],
}

# What is accepted, and why: a value of its type within what the setting means. Keys: (key, value) or (key, "*").
_TEXT = "a string setting: any text is a name, a path or an address"
_BOOL_INT = "OmegaConf reads an integer as a bool (0: false, else true), as it reads yes/no and on/off"
ACCEPTED: dict[tuple[str, str], str] = {
    ("nccl.socket_ifname", "*"): _TEXT + " (NCCL_SOCKET_IFNAME; used on CUDA runs only)",
    ("callbacks.compile.backend", "*"): "a torch.compile backend name; torch names an unknown one at the first step",
    ("callbacks.gpu_monitor.report_dir", "*"): _TEXT,
    ("callbacks.gpu_monitor.report_name", "*"): _TEXT,
    ("callbacks.gpu_monitor.prometheus_addr", "*"): "an address to bind, read only with prometheus_port",
    ("callbacks.gpu_monitor.runs_dir", "*"): _TEXT,
    ("callbacks.gpu_monitor.run_name", "*"): _TEXT,
    ("callbacks.gpu_monitor.prometheus_textfile_dir", "*"): _TEXT,
    ("callbacks.gpu_monitor.interval_s", "1e300"): "a reading interval as long as asked: no readings in the fit",
    ("callbacks.gpu_monitor.publish_interval_s", "1e300"): "a heartbeat interval as long as asked",
    ("callbacks.gpu_monitor.warmup_steps", HUGE_INT): "no alerts before that step: none in the fit",
    ("callbacks.gpu_monitor.low_utilization_pct", "1e300"): "an alert threshold above 100%: always alerts",
    ("callbacks.gpu_monitor.min_memory_headroom_pct", "1e300"): "an alert threshold above 100%: always alerts",
    ("callbacks.gpu_monitor.max_throttle_pct", "1e300"): "an alert threshold above 100%: never alerts",
    ("callbacks.gpu_monitor.max_rank_skew_pct", "1e300"): "a skew threshold as large as asked: never alerts",
    ("callbacks.gpu_monitor.hung_after_steps", "1e300"): "a hung-job threshold as long as asked: never alerts",
    ("callbacks.gpu_monitor.device_indices", f"[{HUGE_INT}]"): "a CUDA ordinal; on a CPU run no card is watched",
    ("callbacks.dataloader_tuner.cache_dir", "*"): _TEXT,
    ("callbacks.dataloader_tuner.max_tuning_time_s", "1e300"): "a tuning bound as long as asked",
    ("callbacks.nonfinite.dirpath", "*"): _TEXT,
    ("callbacks.nonfinite.filename", "*"): _TEXT,
    ("callbacks.matmul_precision.requested", "*"): "the precision option's name, for the log line only",
    ("callbacks.micro_batch.grow_after", HUGE_INT): "batches before trying a larger size: as many as asked",
    ("callbacks.lr_scaling.reference_global_batch", HUGE_INT): "the batch the LR was tuned for: the LR scales down",
    ("callbacks.dataloader_tuner.steps_per_trial", HUGE_INT): "trials are cut at max_tuning_time_s",
    ("callbacks.dataloader_tuner.warmup_steps", HUGE_INT): "trials are cut at max_tuning_time_s",
    ("callbacks.dataloader_tuner.max_workers", HUGE_INT): "workers tried stay within the rank's CPU budget",
    ("callbacks.dataloader_tuner.prefetch_factors", f"[{HUGE_INT}]"): "tried within max_tuning_time_s",
    ("callbacks.dataloader_tuner.verify_steps", HUGE_INT): "the cached decision is checked on every step",
    ("callbacks.stop_on_signal.grace_s", "1e300"): "a grace period as long as asked",
    ("callbacks.preflight.interference_s", "1e300"): "a watch as long as asked",
    ("callbacks.parallelize.block_classes", "*"): "class names, read when the strategy wraps the model",
    ("scheduler.warmup_steps", HUGE_INT): "a warm-up longer than the fit is named when the fit's length is known",
    ("scheduler#onecycle.max_lr", "1e300"): "a peak learning rate as high as asked",
    ("scheduler#onecycle.div_factor", "1e300"): "an initial learning rate as low as asked",
    ("scheduler#onecycle.final_div_factor", "1e300"): "a final learning rate as low as asked",
    ("scheduler#plateau.patience", HUGE_INT): "epochs to wait: the learning rate never drops",
    ("callbacks.preflight.num_workers", HUGE_INT): "the workers it judges /dev/shm and memory for: a FAIL at setup",
    ("trainer.gradient_clip_val", "1e300"): "a norm no gradient reaches: no clipping",
    ("trainer.accumulate_grad_batches", HUGE_INT): "Lightning accumulates that many batches: one step per epoch end",
}


def _kind(hint: typing.Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin in (list, dict):
        return origin
    if origin is not None:  # a union: the first of its types (int | str: int; int | float: int; str | int: str)
        return _kind(args[0]) if args[0] is not int or float not in args else float
    return hint


def _cases() -> Iterator[tuple[str, str, str, list[str]]]:
    """(the key's name here, its path, the value, the options) for every key of every schema and plain key."""
    for where, (cls, options) in NODES.items():
        path = where.split("#")[0]
        for field in dataclasses.fields(cls):
            if field.name.startswith("_"):
                continue
            hint = typing.get_type_hints(cls)[field.name]
            for value in VALUES[_kind(hint)]:
                yield f"{where}.{field.name}", f"{path}.{field.name}", value, options
    for key, (hint, options) in PLAIN.items():
        for value in VALUES[_kind(hint)]:
            yield key.lstrip("+"), key, value, options


CASES = list(_cases())


def _accepted(name: str, value: str, wrong_type: bool) -> str | None:
    """Why `name=value` is taken, or None; `(name, "*")` covers NaN, negative and huge, not the wrong type."""
    if value == "-1" and name.rsplit(".", 1)[-1] in _BOOL_KEYS:
        return _BOOL_INT
    return ACCEPTED.get((name, value)) or (None if wrong_type else ACCEPTED.get((name, "*")))


_BOOL_KEYS = {
    f.name
    for cls, _ in NODES.values()
    for f in dataclasses.fields(cls)
    if typing.get_type_hints(cls)[f.name] in (bool, bool | None)
}


@pytest.fixture(scope="module")
def composed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, ...], DictConfig]]:
    """The train config composed once for each set of options the cases need, keyed by the options."""
    output = tmp_path_factory.mktemp("run")
    GlobalHydra.instance().clear()
    register_resolvers()
    configs = {}
    with initialize_config_module(config_module="lightning_accel.conf", version_base="1.3"):
        for options in {tuple(o) for _, _, _, o in CASES}:
            cfg = compose("train", overrides=[*options, *CPU], return_hydra_config=True)
            with open_dict(cfg):
                cfg.hydra.runtime.output_dir = str(output)
                cfg.hydra.job.num = 0
            HydraConfig.instance().set_config(cfg)  # `${hydra:runtime.output_dir}` reads it: the same for every config
            with open_dict(cfg):
                del cfg["hydra"]  # half of what a copy would copy
            configs[options] = cfg
        yield configs
    GlobalHydra.instance().clear()


def _before_launch(cfg: DictConfig, override: str) -> None:
    """The override applied as Hydra's compose applies it, then what accel-train checks before launch: `plan_run`,
    and the callbacks' constructors for a callback's key (no other key of the groups reaches a constructor). The
    section the override changes is put back afterwards, so the composed config serves the next case."""
    top = override.lstrip("+~").split("=", 1)[0].split(".", 1)[0]
    saved = copy.deepcopy(cfg[top])  # one section: copying the whole config would take most of the time
    try:
        try:
            ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides([override]), cfg)
        except Exception as err:
            named = composition_error(err)
            if named is None:
                raise
            raise named from None
        plan_run(cfg)
        if top == "callbacks":
            instantiate_callbacks(cfg)
    finally:
        with open_dict(cfg):
            cfg[top] = saved


@pytest.mark.parametrize(("name", "key", "value", "options"), CASES, ids=[f"{n}={v}" for n, _, v, _ in CASES])
def test_every_key_refuses_a_bad_value_by_name_or_takes_it_as_documented(
    composed, name: str, key: str, value: str, options: list[str]
) -> None:
    reason = _accepted(name, value, wrong_type=value in {values[0] for values in VALUES.values()})
    setting = key.lstrip("+")
    try:
        _before_launch(composed[tuple(options)], f"{key}={value}")
    except ConfigError as err:
        assert reason is None, f"`{setting}={value}` is in ACCEPTED ({reason}) but refused: {err}"
        assert f"`{setting}" in str(err), f"the error does not name `{setting}`: {err}"
        return
    assert reason is not None, f"`{setting}={value}` was accepted without a word, and ACCEPTED gives no reason"


def test_the_probe_covers_every_schema_the_config_tree_names() -> None:
    """Each `- /accel_schema/NAME` of an option's defaults list is a schema whose keys the probe tries."""
    conf = resources.files("lightning_accel.conf")
    named = {
        match.group(1)
        for path in Path(str(conf)).rglob("*.yaml")
        for match in re.finditer(r"- /accel_schema/(\w+)@", path.read_text())
    }
    probed = {name for name, cls in schema.SCHEMAS.items() if cls in {c for c, _ in NODES.values()}}
    assert named == set(schema.SCHEMAS) == probed
