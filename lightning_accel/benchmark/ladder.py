"""The ladder: compose and check every stage before any runs, then run each in a fresh `accel-train` process."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from lightning_accel.benchmark.results import StageResult
from lightning_accel.errors import ConfigError

__all__ = [
    "BUILTIN_STAGES",
    "BenchSettings",
    "StagePlan",
    "available_presets",
    "default_ladder",
    "plan_stages",
    "run_stage",
]

CONF_MODULE = "lightning_accel.conf"
# Stages the bench knows without a preset file: the article's last rung, "model parallel + gradient accumulation +
# OneCycleLR", built from the groups that exist (a preset of the same name, when one is added, wins).
BUILTIN_STAGES: dict[str, list[str]] = {
    "model_parallel": ["preset=ddp", "strategy=model_parallel", "accumulation=fixed", "scheduler=onecycle"],
}
_MODEL_PARALLEL_PRESETS = ("model_parallel",)  # a preset of this name replaces the built-in stage
_DISTRIBUTED = ("ddp", "fsdp", "model_parallel", "deepspeed", "pipeline")
# Variables an in-process distributed run leaves behind; a child that inherits LOCAL_RANK waits for ranks forever.
_DISTRIBUTED_ENV = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED")  # fmt: skip
# --quick on the default GPT example: a smaller corpus and model, short validation.
QUICK_GPT = ["data.max_chars=300000", "model.n_embd=64", "trainer.limit_val_batches=4"]
QUICK_TUNING_S = 10.0
"""--quick bounds a DataLoaderTuner's search (at the start of the fit, outside the measured training time) to this."""


@dataclass(kw_only=True)
class BenchSettings:
    """How every stage is budgeted and judged (the command line of `accel-bench`)."""

    steps: int = 300
    """Optimizer steps of the first stage (a cap with `until_target`)."""
    match: str = "samples"
    """`samples`: every stage trains the samples of the first stage's `steps`; `steps`: every stage runs `steps`."""
    time_budget_s: float | None = None
    """Train each stage this long instead (Lightning's `max_time`)."""
    metric: str = "val/loss"
    mode: str = "min"
    target: float | None = None
    until_target: bool = False
    tolerance: float = 0.02
    val_checks: int = 4
    """Validation passes per stage (for the final metric and the time to target)."""
    seed: int | None = None
    quick: bool = False
    stage_timeout_s: float | None = None


@dataclass(kw_only=True)
class StagePlan:
    """A stage after composing and checking its config: what it will run, or why it cannot."""

    name: str
    overrides: list[str]
    """The stage's own overrides (`preset=amp`), then --quick's, then the user's."""
    status: str = "ok"
    reason: str = ""
    world_size: int = 1
    extra: list[str] = field(default_factory=list)
    """Overrides the bench adds from the plan (CPU process count)."""
    on_cuda: bool = False
    precision: str = ""
    num_workers: int | None = None
    global_batch: int | None = None
    accumulate: int = 1
    family: str = ""
    """The strategy's family: auto, single_device, ddp, fsdp, model_parallel, pipeline, deepspeed."""
    settings: dict[str, str] = field(default_factory=dict)
    """What the stage sets, in words, for the "what it changes" column."""
    callbacks: list[str] = field(default_factory=list)
    steps: int | None = None
    command: list[str] = field(default_factory=list)


def available_presets() -> list[str]:
    """The presets of the packaged config tree (`conf/preset/*.yaml`)."""
    folder = resources.files(CONF_MODULE).joinpath("preset")
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def default_ladder(presets: Sequence[str] | None = None) -> list[str]:
    """baseline -> amp -> ddp -> the article's last rung: model parallel + accumulation + OneCycleLR (a `model_parallel`
    preset when the config tree has one, else the built-in stage). `pipeline` is a rung to ask for by name
    (`--ladder baseline,amp,ddp,pipeline`): it pays for deep models on slow interconnects, not in general."""
    presets = available_presets() if presets is None else presets
    last = next((p for p in _MODEL_PARALLEL_PRESETS if p in presets), "model_parallel")
    return ["baseline", "amp", "ddp", last]


def stage_overrides(name: str, presets: Sequence[str]) -> list[str]:
    """The overrides that select a stage; ConfigError naming the available ones for an unknown name."""
    if name in presets:
        return [f"preset={name}"]
    if name in BUILTIN_STAGES:
        return list(BUILTIN_STAGES[name])
    known = ", ".join(sorted({*presets, *BUILTIN_STAGES}))
    raise ConfigError(f"`--ladder` stage `{name}` is not a preset or a built-in stage; use any of: {known}.")


def _compose(overrides: Sequence[str], run_dir: str) -> DictConfig:
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from lightning_accel.launch import register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONF_MODULE, version_base="1.3"):
            cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
            with open_dict(cfg):
                cfg.hydra.runtime.output_dir = run_dir
                cfg.hydra.job.num = 0
            HydraConfig.instance().set_config(cfg)
            return cfg
    finally:
        GlobalHydra.instance().clear()


def compose_user_config(overrides: Sequence[str], run_dir: str) -> DictConfig:
    """Compose and check the user's overrides alone (no preset): a bad one is the user's error, before any stage.

    Raises:
        ConfigError: for an override Hydra rejects or a setting `check_config` rejects.
    """
    from lightning_accel.presets import check_config

    try:
        cfg = _compose(overrides, run_dir)
    except Exception as err:  # Hydra's own errors name the override and list the options
        raise ConfigError(f"the Hydra overrides {list(overrides)} do not compose: {err}") from None
    check_config(cfg)
    return cfg


def _effective_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _count_devices(devices: Any, visible: int) -> int:
    if isinstance(devices, (list, ListConfig)):
        return len(devices)
    text = str(devices).strip()
    if text in ("auto", "-1"):
        return visible
    if "," in text:
        return len([d for d in text.split(",") if d.strip()])
    return int(text) if text.isdigit() else 1


def _strategy_family(strategy: Any) -> str:
    from lightning_accel.presets import _strategy_name

    name = _strategy_name(strategy)
    return "pipeline" if "pipeline" in name.lower() else name


def _accumulation(cfg: DictConfig, micro_global: int) -> int:
    """Micro-batches per optimizer step: `trainer.accumulate_grad_batches`, or an accumulation callback's global
    batch size over the micro-batches of all ranks (a schedule counts at its first window)."""
    for node in (cfg.get("callbacks") or {}).values():
        if isinstance(node, DictConfig) and str(node.get("_target_", "")).endswith("AccumulationScheduler"):
            global_batch = node.get("global_batch_size")
            if isinstance(global_batch, int) and micro_global > 0:
                return max(1, global_batch // micro_global)
            schedule = node.get("scheduling")
            if isinstance(schedule, DictConfig) and schedule:
                return int(schedule[sorted(schedule.keys(), key=int)[0]])
    accumulate = cfg.trainer.get("accumulate_grad_batches", 1)
    return accumulate if isinstance(accumulate, int) and accumulate > 0 else 1


def plan_stage(name: str, overrides: list[str], run_dir: str, visible_cuda: int | None = None) -> StagePlan:
    """Compose one stage and decide whether it can run here; a stage that cannot is `skipped` with the reason.

    Decided here: fp16 on a CPU is skipped (accel-train would run bf16 instead, so it would measure another stage);
    a DDP/FSDP/model-parallel stage needs 2+ processes: on CUDA the visible GPUs, on a CPU `trainer.devices=auto`
    means 2 CPU processes when the machine has 2+ CPUs (Lightning's own `auto` gives 1); one device is skipped.
    """
    from lightning_accel.precision import resolve_precision
    from lightning_accel.presets import _visible_cuda_devices, check_combinations, check_config, runs_on_cuda

    plan = StagePlan(name=name, overrides=overrides)
    try:
        cfg = _compose(overrides, run_dir)
    except Exception as err:
        plan.status, plan.reason = "skipped", f"the config does not compose: {err}"
        return plan
    visible = _visible_cuda_devices() if visible_cuda is None else visible_cuda
    trainer = cfg.trainer
    plan.on_cuda = runs_on_cuda(cfg, visible_cuda=visible)
    family = plan.family = _strategy_family(trainer.get("strategy", "auto"))
    devices = trainer.get("devices", "auto")
    distributed = family in _DISTRIBUTED
    if plan.on_cuda:
        per_node = _count_devices(devices, visible)
    elif str(devices).strip() in ("auto", "-1") and distributed:
        per_node = 2 if _effective_cpus() >= 2 else 1
        plan.extra.append(f"trainer.devices={per_node}")
    else:
        per_node = _count_devices(devices, 1)
    nodes = trainer.get("num_nodes", 1)
    plan.world_size = per_node * (nodes if isinstance(nodes, int) else 1)
    accelerator = "cuda" if plan.on_cuda else "cpu"
    requested = str(trainer.get("precision", "32-true"))
    if not plan.on_cuda and requested in ("16-mixed", "16", "16-true", "transformer-engine-float16"):
        plan.status, plan.reason = "skipped", f"fp16 (`{requested}`) needs a CUDA GPU; this stage would run bf16 here"
        return plan
    if distributed and plan.world_size < 2:
        where = f"{visible} visible CUDA device(s)" if plan.on_cuda else f"{_effective_cpus()} CPU(s)"
        plan.status, plan.reason = (
            "skipped",
            (f"`{family}` with one device (`trainer.devices={devices}`, {where}); it needs 2 or more"),
        )
        return plan
    try:
        with open_dict(cfg):
            if plan.extra:
                trainer.devices = per_node
        check_config(cfg)
        resolved = resolve_precision(requested, str(trainer.get("accelerator", "auto")))
        with open_dict(cfg):
            trainer.precision = resolved.value
        check_combinations(cfg, visible_cuda=visible)
    except (ConfigError, ValueError) as err:
        plan.status, plan.reason = "skipped", str(err)
        return plan
    plan.precision = resolved.value
    workers = OmegaConf.select(cfg, "data.num_workers", default=None)
    plan.num_workers = workers if isinstance(workers, int) else None
    batch = OmegaConf.select(cfg, "data.batch_size", default=None)
    replicas = _data_parallel_size(trainer.get("strategy"), plan.world_size)  # pipeline/TP ranks share batches
    micro_global = batch * replicas if isinstance(batch, int) else 0
    plan.accumulate = _accumulation(cfg, micro_global)
    plan.global_batch = micro_global * plan.accumulate if micro_global else None
    scheduler = str(OmegaConf.select(cfg, "scheduler._target_", default="") or "none").rsplit(".", 1)[-1]
    plan.callbacks = sorted(name for name, node in (cfg.get("callbacks") or {}).items() if node is not None)
    workers = f"num_workers={plan.num_workers}" if plan.num_workers is not None else ""
    if "dataloader_tuner" in plan.callbacks:  # the fit starts from `data.num_workers`; the tuner may change it
        workers = f"DataLoaderTuner (from {workers})" if workers else "DataLoaderTuner"
    plan.settings = {
        "precision": resolved.value,
        "workers": workers,
        "processes": f"{plan.world_size} {accelerator} process{'es' if plan.world_size > 1 else ''}"
        + (f" ({family})" if family not in ("auto", "single_device") else ""),
        "accumulation": f"accumulate {plan.accumulate}",
        "scheduler": scheduler.replace("_schedule", ""),
    }
    return plan


def _data_parallel_size(strategy: Any, world_size: int) -> int:
    """Ranks that load batches of their own: `data_parallel_size` of a pipeline or model-parallel strategy config
    (`auto`: the world over `tensor_parallel_size`), else the world size."""
    if not isinstance(strategy, Mapping) and not OmegaConf.is_dict(strategy):
        return world_size
    dp = strategy.get("data_parallel_size")
    if isinstance(dp, int) and dp > 0:
        return dp
    if dp is None and "tensor_parallel_size" not in strategy:
        return world_size
    tp = strategy.get("tensor_parallel_size", 1)
    return max(1, world_size // tp) if isinstance(tp, int) and tp > 0 else world_size


def describe_changes(plans: Sequence[StagePlan]) -> dict[str, str]:
    """The "what it changes" column: the first stage's settings, then each stage's differences from it."""
    first = next((p for p in plans if p.settings), None)
    described = {}
    for plan in plans:
        if not plan.settings or first is None:
            described[plan.name] = " ".join(plan.overrides[:1])
        elif plan is first:
            described[plan.name] = ", ".join(v for v in plan.settings.values() if v)
        else:
            diff = [v for k, v in plan.settings.items() if v and v != first.settings.get(k)]
            described[plan.name] = ", ".join(diff) or "same settings as " + first.name
    return described


def hydra_value(path: Path) -> str:
    """A path as a Hydra override value: quoted when it holds characters the override grammar reads (space, =, ...)."""
    text = str(path)
    if re.fullmatch(r"[\w/.\-]+", text):
        return text
    # Hydra's quoted strings read a backslash as an escape only before a quote or at the end of the string
    escaped = re.sub(r"(\\+)(?='|$)", r"\1\1", text).replace("'", "\\'")
    return "'" + escaped + "'"


def budget_overrides(plan: StagePlan, settings: BenchSettings, reference_batch: int | None) -> list[str]:
    """Steps (or time), validation cadence, seed and the measuring callback for one stage."""
    extra = ["test=false", "++trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false"]
    if settings.seed is not None:
        extra.append(f"seed={settings.seed}")
    if settings.quick and "dataloader_tuner" in plan.callbacks:  # its search (up to 60 s) would dwarf a quick stage
        extra.append(f"callbacks.dataloader_tuner.max_tuning_time_s={QUICK_TUNING_S:g}")
    if settings.time_budget_s is not None:
        seconds = int(math.ceil(settings.time_budget_s))
        days, rest = divmod(seconds, 86400)
        extra += ["trainer.max_steps=-1", f"++trainer.max_time='{days:02d}:{rest // 3600:02d}:"
                  f"{rest % 3600 // 60:02d}:{rest % 60:02d}'"]  # fmt: skip
        return extra
    steps = settings.steps
    if settings.match == "samples" and reference_batch and plan.global_batch:
        steps = max(1, round(settings.steps * reference_batch / plan.global_batch))
    plan.steps = steps
    batches = steps * plan.accumulate
    interval = max(1, batches // max(1, settings.val_checks))
    extra += [f"trainer.max_steps={steps}", "trainer.max_epochs=-1", f"trainer.val_check_interval={interval}",
              "++trainer.check_val_every_n_epoch=null"]  # fmt: skip
    return extra


def monitor_overrides(plan: StagePlan, settings: BenchSettings, stage_dir: Path) -> list[str]:
    """The BenchMonitor (and, on CUDA, GPUMonitor) callbacks; checkpoints off, they are not what is measured."""
    key = "++callbacks.bench_monitor"
    extra = [
        f"{key}._target_=lightning_accel.callbacks.BenchMonitor",
        f"{key}.output_path={hydra_value(stage_dir / 'stage.json')}",
        f"{key}.metric={settings.metric}",
        f"{key}.mode={settings.mode}",
    ]
    if settings.target is not None:
        extra += [f"{key}.target={settings.target}", f"{key}.stop_at_target={str(settings.until_target).lower()}"]
    if plan.on_cuda:
        gpu = "++callbacks.gpu_monitor"
        extra += [f"{gpu}._target_=lightning_accel.callbacks.GPUMonitor", f"{gpu}.print_report=false",
                  f"{gpu}.report_dir={hydra_value(stage_dir)}", f"{gpu}.warmup_steps=0"]  # fmt: skip
    if "model_checkpoint" in plan.callbacks:
        extra += ["~callbacks.model_checkpoint", "++trainer.enable_checkpointing=false"]
    return extra


Launcher = Callable[[list[str], Path, "float | None"], "subprocess.CompletedProcess[str]"]


def launch(command: list[str], stage_dir: Path, timeout: float | None) -> subprocess.CompletedProcess[str]:
    """Run a stage's command in a fresh process (a session of its own, so a timeout or Ctrl-C ends its DDP ranks and
    DataLoader workers too); its output goes to stage_dir/stdout.log and stderr.log."""
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    stage_dir.mkdir(parents=True, exist_ok=True)
    with (stage_dir / "stdout.log").open("w") as out, (stage_dir / "stderr.log").open("w") as err:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout)
            note = ""
            _kill_group(process.pid)  # what the stage left behind (a rank or a worker) must not load the next one
        except subprocess.TimeoutExpired:
            _end_session(process)
            returncode, note = 124, f"the stage ran past --stage-timeout={timeout:g} s and was stopped"
        except BaseException:  # Ctrl-C: the stage's session does not get the terminal's SIGINT, so end it here
            _end_session(process)
            raise
    stderr = (stage_dir / "stderr.log").read_text() + (f"\n{note}" if note else "")
    return subprocess.CompletedProcess(command, returncode, (stage_dir / "stdout.log").read_text(), stderr)


def _kill_group(pgid: int) -> None:
    """SIGKILL every process left in a stage's process group (none, normally)."""
    import signal

    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _end_session(process: subprocess.Popen[str]) -> None:
    """SIGTERM the stage's whole process group, give the leader 10 s, then SIGKILL the whole group."""
    import signal

    try:
        os.killpg(process.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    try:
        process.wait(timeout=10.0)
    except subprocess.TimeoutExpired:
        pass
    _kill_group(process.pid)  # the leader may be gone while ranks or workers of its group live on
    try:
        process.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass


def _failure_reason(stderr: str, returncode: int) -> str:
    noise = ("HYDRA_FULL_ERROR", "full_key:", "object_type=", "reference_type=")
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and not line.strip().startswith(noise)]
    lines = [line for line in lines if "HYDRA_FULL_ERROR" not in line]
    if lines and "--stage-timeout" in lines[-1]:
        return lines[-1]
    for marker in ("accel-train: error:", "Error:", "Error", "error"):
        found = [line for line in lines if marker in line]
        if found:
            reason = found[-1].replace("accel-train: error: ", "")
            return f"exit {returncode}: {reason[:300]}"
    return f"exit {returncode}: {lines[-1][:300] if lines else 'no output'}"


def run_stage(
    plan: StagePlan, stage_dir: Path, changes: str, timeout: float | None, launcher: Launcher = launch
) -> StageResult:
    """Run one planned stage and read its measurement; a stage that fails becomes a `failed` row with the reason."""
    result = StageResult(
        name=plan.name,
        changes=changes,
        status=plan.status,
        reason=plan.reason,
        overrides=[*plan.overrides, *plan.extra],
        world_size=plan.world_size,
        steps=plan.steps,
    )
    if plan.status != "ok":
        return result
    started = time.perf_counter()
    try:
        completed = launcher(plan.command, stage_dir, timeout)
    except Exception as err:  # the launcher itself broke: the ladder goes on
        result.status, result.reason = "failed", f"{type(err).__name__}: {err}"
        return result
    result.process_s = time.perf_counter() - started
    measurement = stage_dir / "stage.json"
    if completed.returncode != 0:
        result.status, result.reason = "failed", _failure_reason(completed.stderr or "", completed.returncode)
    elif not measurement.is_file():
        result.status, result.reason = "failed", "the stage finished but wrote no measurement (stage.json)"
    else:
        result.measurement = json.loads(measurement.read_text())
    return result


def plan_stages(
    ladder: Sequence[str],
    user_overrides: Sequence[str],
    settings: BenchSettings,
    out_dir: Path,
    visible_cuda: int | None = None,
) -> list[StagePlan]:
    """Compose and check every stage, then give each its budget, callbacks and command; nothing runs yet.

    Raises:
        ConfigError: for an unknown stage name, or user overrides that do not compose or fail `check_config`.
    """
    presets = available_presets()
    selections = [(name, stage_overrides(name, presets)) for name in ladder]
    user_cfg = compose_user_config(list(user_overrides), str(out_dir / "check"))
    quick = []
    if settings.quick and str(user_cfg.model.get("_target_", "")).endswith("GPTLanguageModel"):
        quick = [o for o in QUICK_GPT if not any(u.split("=")[0] == o.split("=")[0] for u in user_overrides)]
    plans = []
    for index, (name, selection) in enumerate(selections):
        stage_dir = out_dir / "stages" / f"{index}-{name}"
        plans.append(plan_stage(name, [*selection, *quick, *user_overrides], str(stage_dir), visible_cuda))
    reference_batch = next((p.global_batch for p in plans if p.global_batch), None)
    for index, plan in enumerate(plans):
        if plan.status != "ok":
            continue
        stage_dir = out_dir / "stages" / f"{index}-{plan.name}"
        bench = budget_overrides(plan, settings, reference_batch) + monitor_overrides(plan, settings, stage_dir)
        plan.command = [sys.executable, "-m", "lightning_accel.train", *plan.overrides, *plan.extra, *bench,
                        f"hydra.run.dir={hydra_value(stage_dir)}"]  # fmt: skip
    return plans
