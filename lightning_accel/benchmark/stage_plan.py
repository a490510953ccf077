"""Plan a ladder: compose and check every stage before any runs, and give each its budget and command.

A `StagePlan` is frozen and built in one place (`plan_stages`): what a stage will run, or why it cannot.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypedDict

from omegaconf import DictConfig, OmegaConf

from lightning_accel.benchmark.stage_config import (
    available_presets,
    compose_config,
    compose_user_config,
    hydra_value,
    stage_overrides,
)
from lightning_accel.checks import check_run
from lightning_accel.errors import ConfigError
from lightning_accel.run_plan import build_run_plan
from lightning_accel.shape import RunShape, run_shape

__all__ = [
    "DEFAULT_SEED",
    "PROFILES",
    "BenchSettings",
    "Profile",
    "PlanStatus",
    "StagePlan",
    "budget_overrides",
    "describe_changes",
    "monitor_overrides",
    "override_key",
    "plan_stage",
    "plan_stages",
    "profile_overrides",
]

PlanStatus = Literal["ok", "skipped"]
DEFAULT_SEED = 1234
"""The seed of the first round when neither `--seed` nor the config sets one (the config's default is 1234 too)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    """How accel-bench and accel-tune size their runs for a kind of machine (`--profile`)."""

    name: str
    steps: int
    """Optimizer steps of the first stage (the baseline)."""
    repeats: int
    """Rounds per stage: 2, the fewest that give an interval."""
    val_checks: int
    match: Literal["samples", "steps"]
    stage_timeout_s: float
    model: str | None = None
    """The model config a stage runs when the user selects none (`model=gpt2_small`)."""
    gpt_overrides: tuple[str, ...] = ()
    """Overrides for the GPT example (`lightning_accel.examples.GPTLanguageModel`), when the user's model is it."""
    tuning_s: float = 10.0
    """Bound on a DataLoaderTuner's search (at the start of the fit, outside the measured training time)."""
    monitor: tuple[tuple[str, str], ...] = ()
    """BenchMonitor settings (`warmup_batches`, `split_every_n_batches`)."""
    ladder: tuple[str, ...] = ()
    """The default ladder under this profile; empty: accel-bench's own."""
    needs_cuda: bool = False


PROFILES: dict[str, Profile] = {
    # a few minutes on 2 CPU cores: a smaller corpus and GPT, short validation
    "quick": Profile(
        name="quick",
        steps=40,
        repeats=2,
        val_checks=2,
        match="steps",
        stage_timeout_s=300.0,
        gpt_overrides=("data.max_chars=300000", "model.n_embd=64", "trainer.limit_val_batches=4"),
    ),
    # one GPU in a few minutes: GPT-2 small at a 1,024-byte context; 10 warm-up batches keep a compiled stage's
    # compilation out of its rates, and one batch in ten is synchronised for the split, so the host's overhead hides
    # behind the GPU's work as it does in training; 64 baseline steps of 16 x 1,024 bytes (1M tokens, 2 validations
    # of 131,072 bytes) take the fp32 loss from 5.5 to about 2.5 nats, where a precision's damage would show
    "gpu": Profile(
        name="gpu",
        steps=64,
        repeats=2,
        val_checks=2,
        match="samples",
        stage_timeout_s=420.0,
        model="gpt2_small",
        monitor=(("warmup_batches", "10"), ("split_every_n_batches", "10")),
        ladder=("baseline", "amp", "amp_compile", "ddp", "model_parallel"),
        needs_cuda=True,
    ),
}


@dataclass(kw_only=True)
class BenchSettings:
    """How every stage is budgeted, repeated and judged (the command line of `accel-bench`)."""

    steps: int = 300
    """Optimizer steps of the first stage (a cap with `until_target`)."""
    match: Literal["samples", "steps"] = "samples"
    """`samples`: every stage trains the samples of the first stage's `steps`; `steps`: every stage runs `steps`."""
    time_budget_s: float | None = None
    """Train each stage this long instead (Lightning's `max_time`)."""
    metric: str = "val/loss"
    mode: Literal["min", "max"] = "min"
    target: float | None = None
    until_target: bool = False
    tolerance: float = 0.02
    val_checks: int = 4
    """Validation passes per stage (for the final metric and the time to target)."""
    seed: int | None = None
    """Seed of the first round; round k uses `seed + k`. None: the config's seed."""
    profile: str | None = None
    """A key of `PROFILES` (`quick`, `gpu`): its model, GPT sizing, warm-up and DataLoaderTuner bound apply."""
    stage_timeout_s: float | None = None
    repeats: int = 3
    """Rounds: every stage runs once per round, round by round (A B C, A B C, ...)."""
    max_reruns: int = 2
    """Runs measured under interference that are run again, per stage, at most."""
    interference_threshold: float = 0.10
    """A run is flagged when other processes took more than this share of the CPUs it may use."""


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """A stage after composing and checking its config: what it will run, or why it cannot."""

    name: str
    overrides: tuple[str, ...]
    """The stage's own overrides (`preset=amp`), then the profile's, then the user's."""
    status: PlanStatus = "ok"
    reason: str = ""
    world_size: int = 1
    extra: tuple[str, ...] = ()
    """Overrides the bench adds from the plan (CPU process count)."""
    on_cuda: bool = False
    precision: str = ""
    num_workers: int | None = None
    global_batch: int | None = None
    accumulate: int = 1
    family: str = ""
    """The strategy's family: auto, single_device, ddp, fsdp, model_parallel, pipeline, deepspeed."""
    settings: Mapping[str, str] = field(default_factory=dict)
    """What the stage sets, in words, for the "what it changes" column."""
    callbacks: tuple[str, ...] = ()
    steps: int | None = None
    """Optimizer steps of each run (None under a time budget)."""
    budget: tuple[str, ...] = ()
    """The bench's overrides that are the same for every run of the stage: budget, validation, measuring callbacks."""

    def command(self, run_dir: Path, seed: int | None) -> list[str]:
        """The `accel-train` command of one run: writes into `run_dir`, trains from `seed`."""
        where = hydra_value(run_dir)
        per_run = [f"++callbacks.bench_monitor.output_path={hydra_value(run_dir / 'stage.json')}"]
        if self.on_cuda:
            per_run.append(f"++callbacks.gpu_monitor.report_dir={where}")
        if seed is not None:
            per_run.append(f"seed={seed}")
        return [
            sys.executable,
            "-m",
            "lightning_accel.train",
            *self.overrides,
            *self.extra,
            *self.budget,
            *per_run,
            f"hydra.run.dir={where}",
        ]


def _accumulation(cfg: DictConfig, shape: RunShape, micro_global: int) -> int:
    """Micro-batches per optimizer step: `trainer.accumulate_grad_batches`, or the accumulation callback's global
    batch size over the micro-batches of all ranks (a schedule counts at its first window)."""
    if shape.accumulation_callback is not None:
        node = cfg.callbacks[shape.accumulation_callback]
        global_batch = node.get("global_batch_size")
        if isinstance(global_batch, int) and micro_global > 0:
            return max(1, global_batch // micro_global)
        schedule = node.get("scheduling")
        if OmegaConf.is_list(schedule) and schedule:  # [[key, micro_batches], ...]
            return int(min(schedule, key=lambda pair: int(pair[0]))[1])
        if isinstance(schedule, DictConfig) and schedule:
            keys: list[Any] = list(schedule.keys())  # integers, or strings of them
            return int(schedule[sorted(keys, key=int)[0]])
    accumulate = cfg.trainer.get("accumulate_grad_batches", 1)
    return accumulate if isinstance(accumulate, int) and accumulate > 0 else 1


class _StageBasics(TypedDict):
    """What every plan of a stage holds, skipped or not."""

    name: str
    overrides: tuple[str, ...]
    world_size: int
    extra: tuple[str, ...]
    on_cuda: bool
    family: str


def plan_stage(name: str, overrides: Sequence[str], run_dir: str, visible_cuda: int | None = None) -> StagePlan:
    """Compose one stage and decide whether it can run here; a stage that cannot is `skipped` with the reason.

    Decided here: fp16 on a CPU is skipped (accel-train would run bf16 instead, so it would measure another stage);
    a DDP/FSDP/model-parallel stage needs 2+ processes: on CUDA the visible GPUs, on a CPU `trainer.devices=auto`
    means 2 CPU processes when the machine has 2+ CPUs (Lightning's own `auto` gives 1); one device is skipped.
    """
    from lightning_accel.precision import FP16_PRECISIONS

    overrides = tuple(overrides)
    try:
        cfg = compose_config(overrides, run_dir)
    except Exception as err:
        return StagePlan(name=name, overrides=overrides, status="skipped", reason=f"the config does not compose: {err}")
    shape = run_shape(cfg, visible_cuda=visible_cuda)  # the process count first; the plan decides the rest
    visible, on_cuda, family = shape.visible_cuda, shape.on_cuda, shape.family
    extra: tuple[str, ...] = ()
    if shape.devices_per_node is not None:
        per_node = shape.devices_per_node
    elif on_cuda:
        per_node = visible  # auto and -1: every visible GPU
    elif shape.distributed:  # Lightning's `auto` is 1 CPU process; a distributed stage gets 2 where 2 CPUs serve
        per_node = 2 if shape.cpus >= 2 else 1
        extra = (f"trainer.devices={per_node}",)  # on the run's command line, not written into the config
        shape = replace(shape, devices=per_node, devices_per_node=per_node)  # the shape of the run that gets it
    else:
        per_node = 1
    world_size = per_node * shape.num_nodes
    stage: _StageBasics = {
        "name": name,
        "overrides": overrides,
        "world_size": world_size,
        "extra": extra,
        "on_cuda": on_cuda,
        "family": family,
    }
    requested = shape.precision
    if not on_cuda and requested in FP16_PRECISIONS:
        reason = f"fp16 (`{requested}`) needs a CUDA GPU; this stage would run bf16 here"
        return StagePlan(**stage, status="skipped", reason=reason)
    if shape.distributed and world_size < 2:
        where = f"{visible} visible CUDA device(s)" if on_cuda else f"{shape.cpus} CPU(s)"
        reason = f"`{family}` with one device (`trainer.devices={shape.devices}`, {where}); it needs 2 or more"
        return StagePlan(**stage, status="skipped", reason=reason)
    try:
        plan = build_run_plan(cfg, check_run(cfg, shape))  # compose -> shape -> checks -> plan, each once
    except (ConfigError, ValueError) as err:
        return StagePlan(**stage, status="skipped", reason=str(err))
    shape, resolved = plan.shape, plan.precision
    workers = OmegaConf.select(cfg, "data.num_workers", default=None)
    num_workers = workers if isinstance(workers, int) else None
    batch = OmegaConf.select(cfg, "data.batch_size", default=None)
    replicas = shape.data_parallel_size(world_size) or world_size  # pipeline/TP ranks share batches
    micro_global = batch * replicas if isinstance(batch, int) else 0
    accumulate = _accumulation(cfg, shape, micro_global)
    scheduler = str(OmegaConf.select(cfg, "scheduler._target_", default="") or "none").rsplit(".", 1)[-1]
    callbacks = tuple(sorted(name for name, node in (cfg.get("callbacks") or {}).items() if node is not None))
    workers_text = f"num_workers={num_workers}" if num_workers is not None else ""
    if "dataloader_tuner" in callbacks:  # the fit starts from `data.num_workers`; the tuner may change it
        workers_text = f"DataLoaderTuner (from {workers_text})" if workers_text else "DataLoaderTuner"
    accelerator = "cuda" if on_cuda else "cpu"
    settings = {
        "precision": resolved.value,
        "workers": workers_text,
        "processes": f"{world_size} {accelerator} process{'es' if world_size > 1 else ''}"
        + (f" ({family})" if family not in ("auto", "single_device") else ""),
        "accumulation": f"accumulate {accumulate}",
        "scheduler": scheduler.replace("_schedule", ""),
        "compile": _compile_text(cfg),
        "micro_batch": "micro_batch=auto" if "micro_batch" in callbacks else "",
    }
    return StagePlan(
        **stage,
        precision=resolved.value,
        num_workers=num_workers,
        accumulate=accumulate,
        global_batch=micro_global * accumulate if micro_global else None,
        settings=settings,
        callbacks=callbacks,
    )


def _compile_text(cfg: DictConfig) -> str:
    """`compile=<mode>` when the stage compiles the model (the Compile callback), else empty."""
    from lightning_accel.callbacks.compile import Compile
    from lightning_accel.targets import target_class

    for node in (cfg.get("callbacks") or {}).values():
        cls = target_class(node.get("_target_")) if node is not None else None
        if cls is not None and issubclass(cls, Compile):
            return f"compile={node.get('mode') or 'default'}"
    return ""


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
            diff = [v or f"no {k.replace('_', '-')}" for k, v in plan.settings.items() if v != first.settings.get(k)]
            described[plan.name] = ", ".join(diff) or "same settings as " + first.name
    return described


def budget_overrides(
    plan: StagePlan, settings: BenchSettings, reference_batch: int | None
) -> tuple[int | None, list[str]]:
    """(optimizer steps, overrides): steps (or time), validation cadence and the tuner's bound for one stage."""
    extra = ["test=false", "++trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false"]
    profile = PROFILES.get(settings.profile or "")
    if profile and "dataloader_tuner" in plan.callbacks:  # its search (up to 60 s) would dwarf a profile's stage
        extra.append(f"++callbacks.dataloader_tuner.max_tuning_time_s={profile.tuning_s:g}")  # set or add
    if settings.time_budget_s is not None:
        seconds = int(math.ceil(settings.time_budget_s))
        days, rest = divmod(seconds, 86400)
        extra += [
            "trainer.max_steps=-1",
            f"++trainer.max_time='{days:02d}:{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}'",
        ]
        return None, extra
    steps = settings.steps
    if settings.match == "samples" and reference_batch and plan.global_batch:
        steps = max(1, round(settings.steps * reference_batch / plan.global_batch))
    batches = steps * plan.accumulate
    interval = max(1, batches // max(1, settings.val_checks))
    extra += [
        f"trainer.max_steps={steps}",
        "trainer.max_epochs=-1",
        f"trainer.val_check_interval={interval}",
        "++trainer.check_val_every_n_epoch=null",
    ]
    return steps, extra


def monitor_overrides(plan: StagePlan, settings: BenchSettings) -> list[str]:
    """The BenchMonitor (and, on CUDA, GPUMonitor) callbacks; checkpoints off, they are not what is measured. Where
    each run writes is added by `StagePlan.command`."""
    key = "++callbacks.bench_monitor"
    extra = [
        f"{key}._target_=lightning_accel.callbacks.BenchMonitor",
        f"{key}.metric={settings.metric}",
        f"{key}.mode={settings.mode}",
    ]
    profile = PROFILES.get(settings.profile or "")
    extra += [f"{key}.{name}={value}" for name, value in (profile.monitor if profile else ())]
    if settings.target is not None:
        extra += [f"{key}.target={settings.target}", f"{key}.stop_at_target={str(settings.until_target).lower()}"]
    if plan.on_cuda:
        gpu = "++callbacks.gpu_monitor"
        extra += [
            f"{gpu}._target_=lightning_accel.callbacks.GPUMonitor",
            f"{gpu}.print_report=false",
            f"{gpu}.warmup_steps=0",
        ]
    if "model_checkpoint" in plan.callbacks:
        extra += ["~callbacks.model_checkpoint", "++trainer.enable_checkpointing=false"]
    return extra


def _selection(name: str, presets: Sequence[str], user_overrides: Sequence[str], out_dir: Path) -> list[str]:
    """A stage's overrides: a packaged preset or built-in stage, else a preset of the user's own config tree
    (`hydra.searchpath`) when `preset=<name>` composes with the user's overrides."""
    try:
        return stage_overrides(name, presets)
    except ConfigError as err:
        try:
            compose_config([f"preset={name}", *user_overrides], str(out_dir / "check"))
        except Exception:
            raise err from None
        return [f"preset={name}"]


def profile_overrides(profile: str | None, user_overrides: Sequence[str]) -> list[str]:
    """The profile's model selection (`model=gpt2_small` under `--profile gpu`) when the user selects no model."""
    chosen = PROFILES.get(profile or "")
    if chosen is None or chosen.model is None or any(override_key(o) == "model" for o in user_overrides):
        return []
    return [f"model={chosen.model}"]


def override_key(override: str) -> str:
    """The key an override sets: `++trainer.devices=2` -> `trainer.devices`, `precision=amp` -> `precision`."""
    return override.split("=", 1)[0].lstrip("+~")


def plan_stages(
    ladder: Sequence[str],
    user_overrides: Sequence[str],
    settings: BenchSettings,
    out_dir: Path,
    visible_cuda: int | None = None,
    stage_extra: Mapping[str, Sequence[str]] | None = None,
) -> tuple[list[StagePlan], int | None]:
    """Compose and check every stage, then give each its budget and callbacks; nothing runs yet.

    `stage_extra` gives a stage overrides of its own that come after the user's (accel-tune's candidates); a user
    override of the same key is left out of that stage.

    Returns the plans and the seed of the first round (`settings.seed`, else the config's `seed`, else
    `DEFAULT_SEED`; None when the config sets `seed: null` and `--seed` is not given).

    Raises:
        ConfigError: for an unknown stage name, or user overrides that do not compose or fail `check_config`.
    """
    presets = available_presets()
    selections = [(name, _selection(name, presets, user_overrides, out_dir)) for name in ladder]
    sizing = profile_overrides(settings.profile, user_overrides)
    user_cfg = compose_user_config([*sizing, *user_overrides], str(out_dir / "check"))
    profile = PROFILES.get(settings.profile or "")
    if profile and str(user_cfg.model.get("_target_", "")).endswith("GPTLanguageModel"):
        user_keys = {override_key(u) for u in user_overrides}
        sizing += [o for o in profile.gpt_overrides if override_key(o) not in user_keys]
    extra = stage_extra or {}

    def stage_overrides_of(name: str, selection: list[str]) -> list[str]:
        own = list(extra.get(name, ()))
        keys = {override_key(o) for o in own}
        return [*selection, *sizing, *(o for o in user_overrides if override_key(o) not in keys), *own]

    plans = [
        plan_stage(name, stage_overrides_of(name, selection), str(out_dir / "stages" / f"{index}-{name}"), visible_cuda)
        for index, (name, selection) in enumerate(selections)
    ]
    reference_batch = next((p.global_batch for p in plans if p.global_batch), None)
    for index, plan in enumerate(plans):
        if plan.status == "ok":
            steps, budget = budget_overrides(plan, settings, reference_batch)
            plans[index] = replace(plan, steps=steps, budget=(*budget, *monitor_overrides(plan, settings)))
    seed = settings.seed
    if seed is None:
        configured = user_cfg.get("seed", DEFAULT_SEED)
        seed = configured if isinstance(configured, int) else None
    return plans, seed
