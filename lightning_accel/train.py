"""accel-train: compose a Lightning run from Hydra presets, check it, then fit, test and summarise.

The module loads no torch and no Lightning when it is imported: Hydra's own answers (`--help`, `--cfg job`, a key
or an option the config does not have, an override it cannot parse) come before them, and each step of a run imports
what it builds when it runs (`tests/test_train_entry.py` checks it). `accel-train` enters through `train_entry.py`,
which sets the thread environment first; `python -m lightning_accel.train` sets it here.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_accel.errors import (
    ConfigError,
    LightningAccelWarning,
    NothingLearnedError,
    RunFailedError,
    WorkerKilledError,
    describe_os_error,
)
from lightning_accel.launch import check_output_root, hydra_safe_launch, register_resolvers
from lightning_accel.run_plan import RunPlan, build_run_plan, effective_trainer_settings
from lightning_accel.schema import composition_error, register_schemas
from lightning_accel.shape import run_shape
from lightning_accel.signals import exit_on_signals
from lightning_accel.summary import RunSummary, collect_summary, print_summary, write_summary

if TYPE_CHECKING:
    from lightning_accel.callbacks.run_stats import RunStats
    from lightning_accel.shape import RunShape

__all__ = [
    "CONFIG_PACKAGE",
    "build",
    "check_learned",
    "config_digest",
    "config_path",
    "main",
    "plan_run",
    "print_check",
    "run",
]

log = logging.getLogger("lightning_accel.train")
# The entry point's resolvers (conf/hydra/default.yaml uses ${accel_run_id:...}), registered when this module is
# imported: a launcher that runs the job in another process (hydra-submitit-launcher's SLURM tasks) unpickles
# `_hydra_main` by reference, which imports this module, and resolves the job's directories before calling it. Your
# own app needs none of this (the search-path plugin registers them); the helpers it uses are in `compose.py`.
register_resolvers()


def print_check(cfg: DictConfig, plan: RunPlan) -> None:
    """What `accel-train check=true` prints: the Trainer arguments that differ from Lightning's defaults."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="accel-train check: the config is valid; nothing was built or launched")
    table.add_column("Trainer argument")
    table.add_column("value")
    table.add_column("Lightning's default")
    for key, (value, default) in effective_trainer_settings(cfg).items():
        table.add_row(key, repr(value), repr(default))
    console = Console()
    console.print(table)
    console.print(f"{plan.precision.describe()}; float32_matmul_precision={plan.float32_matmul_precision}")
    callbacks = sorted(name for name, node in (cfg.get("callbacks") or {}).items() if node is not None)
    loggers = sorted(name for name, node in (cfg.get("logger") or {}).items() if node is not None)
    console.print(f"callbacks: {', '.join(callbacks) or 'none'}; loggers: {', '.join(loggers) or 'none'}")
    from lightning_accel.thread_env import describe_plan

    console.print(describe_plan(plan.threads))


def config_digest(cfg: DictConfig) -> str:
    """sha256 of the resolved config: every rank of a run logs it, so equal configs can be checked."""
    return hashlib.sha256(OmegaConf.to_yaml(cfg, resolve=True).encode()).hexdigest()


def _weights_only(method: Any) -> dict[str, bool]:
    """`weights_only=True` for Lightning's checkpoint loads where it takes the argument (Lightning >= 2.5): every
    checkpoint a run resumes or tests (`last`, `best`, SLURM's `hpc`) is loaded without running pickled code."""
    import inspect

    return {"weights_only": True} if "weights_only" in inspect.signature(method).parameters else {}


def _drop_logger_callbacks(callbacks: list[Any]) -> list[Any]:
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.utilities import rank_zero_warn

    kept = [cb for cb in callbacks if not isinstance(cb, LearningRateMonitor)]
    if len(kept) != len(callbacks):
        rank_zero_warn(
            "`logger=none` leaves LearningRateMonitor nothing to log to; it is removed "
            "(add a logger, or `~callbacks.lr_monitor` to silence this).",
            category=LightningAccelWarning,
        )
    return kept


def run(cfg: DictConfig) -> RunSummary | None:
    """See `_run`; what the job sets in `os.environ` (NCCL variables) is removed when it ends, however it ends."""
    with ExitStack() as job_env:
        return _run(cfg, job_env)


def plan_run(cfg: DictConfig) -> RunPlan:
    """Everything accel-train decides and checks before it builds anything: the `RunPlan` (config checks, the
    precision for this machine, compression, NCCL), the checkpoint it would load, its directory, the port, the
    callbacks' own argument checks and the data settings. Reads `cfg`, never writes it.

    Raises:
        ConfigError: for a setting that cannot work, before any Trainer exists or any process is spawned.
    """
    from lightning_accel.checks import (
        check_checkpoint_dir,
        check_ckpt_path,
        check_hpc_checkpoint,
        check_loader_memory,
        check_master_port,
        check_output_dirs,
        check_run,
    )
    from lightning_accel.compose import split_data_config

    plan = build_run_plan(cfg, check_run(cfg, run_shape(cfg)))  # compose -> shape -> checks -> plan
    shape = plan.shape
    ckpt = check_ckpt_path(cfg)
    if (
        ckpt is not None
        and Path(ckpt).is_dir()
        and shape.family not in ("pipeline", "model_parallel", "fsdp", "deepspeed")
    ):
        raise ConfigError(
            f"`ckpt_path={ckpt}` is a distributed checkpoint directory (saved by a pipeline or model-"
            f"parallel run), which `strategy={shape.family}` cannot load; resume it with the strategy "
            "that saved it (e.g. `preset=pipeline trainer.devices=2`), or join it into one file with "
            "`lightning_accel.strategies.consolidate_checkpoint(path, out)` and pass `out`."
        )
    check_checkpoint_dir(cfg)
    check_output_dirs(cfg)
    check_hpc_checkpoint(cfg)
    if (shape.distributed or (shape.world_size or 1) > 1) and shape.num_nodes == 1:
        check_master_port()
    data = cast("dict[str, Any]", OmegaConf.to_container(cfg.data, resolve=True))  # the data group: a mapping
    split_data_config(data)  # a data setting its target does not take
    check_loader_memory(cfg, plan.threads.ranks if plan.threads is not None else (shape.devices_per_node or 1))
    return plan


def build(cfg: DictConfig, plan: RunPlan) -> tuple[Any, Any, Any, RunStats]:
    """The run's datamodule, model and Trainer (with a `RunStats`), built from `cfg` and the plan's decisions, which
    reach the Trainer as keyword arguments: `cfg` is read, never written."""
    import lightning.pytorch as pl

    from lightning_accel import compose
    from lightning_accel.callbacks.run_stats import RunStats
    from lightning_accel.checks import check_checkpoint_fits, check_ckpt_path
    from lightning_accel.compose import config_paths, instantiate_datamodule

    callbacks = compose.instantiate_callbacks(cfg)  # their own argument checks, before anything else is built
    datamodule = instantiate_datamodule(cfg.data)  # loader settings it does not take go to its DataLoaders
    model = instantiate(cfg.model)
    check_checkpoint_fits(model, check_ckpt_path(cfg))
    loggers = compose.instantiate_named(cfg.get("logger"))
    if not loggers:
        callbacks = _drop_logger_callbacks(callbacks)
    needed = compose.precision_callbacks(plan.precision)
    callbacks += [cb for cb in needed if not any(type(have) is type(cb) for have in callbacks)]
    stats = RunStats()
    with config_paths(cfg):  # a strategy's argument error names `trainer.strategy.<argument>`
        trainer: pl.Trainer = instantiate(
            cfg.trainer, callbacks=[*callbacks, stats], logger=loggers or False, **plan.trainer_kwargs(cfg)
        )
    return datamodule, model, trainer, stats


def _run(cfg: DictConfig, job_env: ExitStack) -> RunSummary | None:
    """Plan and check the run, build data, model, callbacks, loggers and Trainer, fit, test and summarise.

    Returns the summary on global rank zero, None on the other ranks.

    Raises:
        ConfigError: for a setting that cannot work, before any Trainer exists or any process is spawned.
    """
    from lightning_accel import compose
    from lightning_accel.checks import oom_kills, trainer_setting_error, training_step_error, worker_killed_error
    from lightning_accel.precision import apply_float32_matmul_precision
    from lightning_accel.thread_env import apply_thread_plan

    started = time.perf_counter()
    plan = plan_run(cfg)
    compose.instantiate_callbacks(cfg)  # their argument checks, also under `check=true`
    if cfg.get("check", False):
        print_check(cfg, plan)
        return None
    for note in plan.notes:
        log.info(note)
    apply_float32_matmul_precision(plan.float32_matmul_precision)
    log.info("float32_matmul_precision=%s", plan.float32_matmul_precision)
    if plan.nccl is not None:  # the launched ranks inherit them; removed again when the job ends
        job_env.callback(plan.nccl.apply())
    if plan.threads is not None:  # before Lightning launches ranks or workers: they inherit the variables
        job_env.callback(apply_thread_plan(plan.threads))
    import lightning.pytorch as pl

    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule, model, trainer, stats = build(cfg, plan)
    run_dir = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else str(trainer.default_root_dir)
    log.info("resolved config sha256=%s run_dir=%s", config_digest(cfg), run_dir)
    oom_before = oom_kills()  # a worker killed during the run is told from the cgroup's older OOM kills

    try:
        with compose.config_paths(cfg):
            summary = _fit_and_test(cfg, trainer, model, datamodule, stats, plan.shape, started, run_dir)
    except (ConfigError, NothingLearnedError, RunFailedError):
        raise
    except Exception as err:  # name the rank: under DDP the other ranks only see a closed connection
        killed = worker_killed_error(err, trainer, oom_kills_before=oom_before)
        if killed is not None:
            log.error(str(killed))
            raise killed from None
        named = trainer_setting_error(err, cfg, trainer)
        if named is not None:
            raise named from None
        refused = training_step_error(err, cfg, trainer)
        if refused is not None:
            log.error(str(refused))
            raise refused from None
        if isinstance(err, OSError) and err.errno == errno.ENOENT and not Path(run_dir).exists():
            raise NothingLearnedError(
                f"the run directory {run_dir} was removed while the run was going (at global "
                f"step {trainer.global_step}: {err}); its checkpoints and logs went with it. "
                "Start the run again in a directory that stays."
            ) from None
        where = f"rank {trainer.global_rank} failed at global step {trainer.global_step}"
        if isinstance(err, OSError):  # a full disk, a read-only directory: named, no traceback
            log.error("%s: %s", where, describe_os_error(err))
            raise RunFailedError(f"{where}: {describe_os_error(err)}") from err
        message = f"{where}: {type(err).__name__}: {err}"
        log.error(message)
        print(f"accel-train: error: {message}", file=sys.stderr, flush=True)
        raise
    if summary is None:
        return None
    write_summary(summary, Path(run_dir) / "summary.json")
    print_summary(summary)
    return summary


def check_learned(trainer: Any, stats: RunStats) -> None:
    """A fit that finished without learning is an error, not a result: every `training_step` returned None, every
    loss was NaN/inf (so NonFiniteGuard dropped every update), or the loss it ended on is NaN/inf.

    Raises:
        NothingLearnedError: saying which, with the numbers and the usual causes.
    """
    import math

    from lightning_accel.callbacks import NonFiniteGuard

    if stats.batches and stats.batches_without_loss == stats.batches:
        raise NothingLearnedError(
            f"every one of the {stats.batches} training batches ran a `training_step` that "
            "returned None, so nothing was trained (Lightning skips the backward of a step "
            "without a loss); return the loss from `training_step`."
        )
    guard = next((cb for cb in trainer.callbacks if isinstance(cb, NonFiniteGuard)), None)
    if guard is not None and stats.batches and guard.nonfinite_losses >= stats.batches:
        raise NothingLearnedError(
            f"all {stats.batches} training batches had a non-finite loss and NonFiniteGuard "
            "dropped every update: the weights are the initial ones. Lower "
            "`model.optimizer.lr`, check the data for NaN/inf, or try `precision=fp32`."
        )
    losses = {key: float(value) for key, value in trainer.callback_metrics.items() if "loss" in key}
    bad = {key: value for key, value in losses.items() if not math.isfinite(value)}
    if bad:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(bad.items()))
        raise NothingLearnedError(
            f"the fit ended with a non-finite loss ({shown}): the weights are NaN/inf or the "
            "data is. Lower `model.optimizer.lr` or use `gradient_clip_val`, check the data for "
            "NaN/inf, or try `precision=fp32`."
        )


def _fit_and_test(
    cfg: DictConfig,
    trainer: Any,
    model: Any,
    datamodule: Any,
    stats: RunStats,
    shape: RunShape,
    started: float,
    run_dir: str,
) -> RunSummary | None:
    """Fit, then test the best checkpoint; the summary on global rank zero, None elsewhere."""
    from lightning_accel.checks import check_ckpt_path

    metrics: dict[str, float] = {}
    tested = "final"
    with hydra_safe_launch(trainer):
        if cfg.get("fit", True):
            trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"), **_weights_only(trainer.fit))
            metrics.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")})
            check_learned(trainer, stats)
        if cfg.get("test", True):
            best = getattr(trainer.checkpoint_callback, "best_model_path", "")
            tested, ckpt = ("best", "best") if best else ("final", None)
            if not cfg.get("fit", True) and cfg.get("ckpt_path") is not None:  # test the weights asked for
                ckpt = check_ckpt_path(cfg)  # checked before launch: here `last` is resolved to its file again
                tested = f"checkpoint {ckpt}"
            results = trainer.test(
                model, datamodule=datamodule, ckpt_path=ckpt, verbose=False, **_weights_only(trainer.test)
            )
            metrics.update({k: float(v) for k, v in (results[0] if results else {}).items()})
        log.info("rank %d finished: %s", trainer.global_rank, metrics)
        if not trainer.is_global_zero:
            return None
        return collect_summary(
            trainer, datamodule, stats, shape.family, metrics, time.perf_counter() - started, run_dir, tested
        )


_task_started = False
"""Whether Hydra has composed a config and called the task: an error before that is the config's (see `main`)."""


CONFIG_PACKAGE = "pkg://lightning_accel.conf"
"""accel-train's config tree, as a package: what Hydra reads when the tree is not a directory on disk (a zipped
install)."""


def config_path() -> str:
    """The directory of accel-train's config tree (`lightning_accel.conf`), or `CONFIG_PACKAGE` where it is not one.

    Hydra reads a directory through its file source: `accel-train --help` answers about a quarter of a second sooner
    than through `pkg://` (importlib.resources lists each group anew; tests/benchmarks/bench_startup.py). The package
    is located, not imported: the schemas its `__init__` registers come with this module (`register_schemas` in
    `main`) and with the search-path plugin.
    """
    spec = importlib.util.find_spec("lightning_accel.conf")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        if os.path.isfile(os.path.join(location, "train.yaml")):
            return os.path.abspath(location)
    return CONFIG_PACKAGE


@hydra.main(version_base="1.3", config_path=config_path(), config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    global _task_started
    _task_started = True
    try:
        run(cfg)
    except ConfigError as err:
        print(f"accel-train: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except (NothingLearnedError, WorkerKilledError, RunFailedError) as err:
        print(f"accel-train: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    except OSError as err:  # outside the fit: building the run, writing its summary
        print(f"accel-train: error: {describe_os_error(err)}", file=sys.stderr)
        raise SystemExit(1) from None


def _not_composed(err: Exception) -> ConfigError | None:
    """The named error for a config Hydra could not compose (an override it cannot parse, a value of the wrong
    type for a typed key, an unknown option), raised before the task ran or while a sweep composes its next job."""
    from hydra.errors import ConfigCompositionException, OverrideParseException

    if not _task_started or isinstance(err, (ConfigCompositionException, OverrideParseException)):
        return composition_error(err) or ConfigError(f"the config does not compose: {type(err).__name__}: {err}")
    return None


_HELP_FLAGS = ("-h", "--help", "--hydra-help")


class _LiveConfigStore:
    """What `copy.deepcopy` of Hydra's ConfigStore returns while `_config_store_shared` holds: the live store."""

    def __call__(self, memo: dict[int, Any]) -> Any:
        from hydra.core.config_store import ConfigStore

        return ConfigStore.instance()


@contextmanager
def _config_store_shared() -> Iterator[None]:
    """While Hydra writes `--help`: its config repository's copies share the one ConfigStore.

    Hydra 1.3 deep-copies its repository, and with it every structured config in the ConfigStore (Hydra's own and
    this package's schemas), for each config group it lists: about 135 copies for accel-train's help, most of its
    time. Sharing changes nothing the help shows: `ConfigStore.load` hands out a copy of the node it loads, and Hydra's
    later releases read the live store the same way (facebookresearch/hydra#2928). The store is left as it was.

    And each group's options are listed once: the help asks for them three times per group (listing Hydra's groups,
    the app's, then each group's options), and nothing changes the tree while it writes.
    """
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.config_store import ConfigStore
    from hydra.core.object_type import ObjectType

    from lightning_accel.patching import patch_attribute

    store = ConfigStore.instance()
    if "__deepcopy__" in vars(store):
        yield
        return
    listed: dict[str, list[str]] = {}
    original = ConfigLoaderImpl.get_group_options

    def get_group_options(
        self: ConfigLoaderImpl,
        group_name: str,
        results_filter: ObjectType | None = ObjectType.CONFIG,
        config_name: str | None = None,
        overrides: list[str] | None = None,
    ) -> list[str]:
        key = repr((id(self), group_name, results_filter, config_name, overrides))
        if key not in listed:
            listed[key] = original(self, group_name, results_filter, config_name, overrides)
        return list(listed[key])

    undo = patch_attribute(ConfigLoaderImpl, "get_group_options", get_group_options, why="listing the help's groups")
    setattr(store, "__deepcopy__", _LiveConfigStore())  # noqa: B010  (an instance attribute; `copy` looks it up)
    try:
        yield
    finally:
        vars(store).pop("__deepcopy__", None)
        undo()


@contextmanager
def _composition_errors_at_once() -> Iterator[None]:
    """While accel-train runs Hydra: a config that does not compose is reported from Hydra's first composition.

    Hydra 1.3 composes a run's config twice: once to read `hydra.mode` (`Hydra.get_mode`, which swallows any error
    and returns None), then again for the run, which raises the same error. A composition error (an unknown key or
    option, a wrong type, an override it cannot parse) from the first is raised at once, halving the time to tell it;
    any other outcome of the first is Hydra's own. The run's composition is stricter (it also refuses a sweep
    outside `--multirun`), so nothing the first raises would have composed."""
    from hydra._internal.hydra import Hydra
    from hydra.errors import ConfigCompositionException, OverrideParseException

    from lightning_accel.patching import patch_attribute

    original = Hydra.get_mode

    def get_mode(self: Hydra, *args: Any, **kwargs: Any) -> Any:
        failed: list[Exception] = []
        compose = self.compose_config

        def compose_config(*c_args: Any, **c_kwargs: Any) -> Any:
            try:
                return compose(*c_args, **c_kwargs)
            except (ConfigCompositionException, OverrideParseException) as err:
                failed.append(err)
                raise

        undo = patch_attribute(self, "compose_config", compose_config, why="reading hydra.mode")
        try:
            mode = original(self, *args, **kwargs)
        finally:
            undo()
        if failed:
            raise failed[0]
        return mode

    undo = patch_attribute(Hydra, "get_mode", get_mode, why="telling a config that does not compose at once")
    try:
        yield
    finally:
        undo()


def main() -> None:
    """Console entry point of `accel-train` (also `python -m lightning_accel.train`).

    Exit codes: 0 trained (and tested); 1 the run failed, named (an OS failure on a file, a run that learned nothing,
    a killed DataLoader worker, a `training_step` whose output cannot be trained on); 2 a setting refused before
    launch; 128 + N after signal N (130 SIGINT, 143 SIGTERM): a second signal during the stop still exits so once the
    checkpoint is written, a third at once.
    """
    exit_on_signals()  # kept to the process's end (a stop unwinding): a signal no callback holds exits 128 + N
    register_schemas()  # what the config tree's `__init__` does, which Hydra's file source never imports
    try:
        check_output_root(sys.argv[1:])  # Hydra creates the run directory before `run` can check anything
    except ConfigError as err:
        print(f"accel-train: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    users = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises what it cannot compose, to be named here (exit 2)
    helping = any(arg in _HELP_FLAGS for arg in sys.argv[1:])
    try:
        with _config_store_shared() if helping else nullcontext(), _composition_errors_at_once():
            _hydra_main()
    except Exception as err:
        named = None if users == "1" else _not_composed(err)
        if named is None:
            raise
        print(f"accel-train: error: {named}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        if users is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = users


if __name__ == "__main__":
    from lightning_accel.thread_env import set_early_environment

    set_early_environment(sys.argv[1:])  # before the run loads torch (`train_entry.accel_train` does the same)
    main()
