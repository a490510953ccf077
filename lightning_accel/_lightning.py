"""The fence around Lightning's internals: the only module of this package that names a private Lightning attribute.

Each touchpoint is one small function. It checks that the attribute exists and, where it does not (a Lightning
version this package was not tested with), raises `LightningInternalsError` naming the attribute, the feature that
needs it, the installed Lightning version and the supported range. `tests/test_lightning_fence.py` keeps every other
module free of Lightning's private names, and `.ci/contract` runs the callback and strategy contract tests against the
oldest and the newest supported Lightning minor.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, cast

from lightning_accel.patching import patch_attribute

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch

__all__ = [
    "hyperparameter_attribute_prefix",
    "HYDRA_LAUNCHER_MODULES",
    "SUPPORTED_LIGHTNING",
    "LightningInternalsError",
    "accumulating",
    "backward_skipped",
    "call_callback_hooks",
    "call_module_hook",
    "combined_loader_iterators",
    "closure_step_fns",
    "cluster_environment",
    "collect_rng_states",
    "ddp_comm_hook",
    "distributed_checkpoint_metadata_name",
    "epoch_loop_batch_idx",
    "epoch_loop_makes_iterator",
    "forget_lightning_sigterm_handler",
    "load_distributed_checkpoint",
    "logged_results",
    "loop_combined_loader",
    "loop_data_fetcher",
    "loop_loaders",
    "model_parallel_sizes",
    "optimizer_steps_logged",
    "patch_accumulation_boundary",
    "patch_closure_factory",
    "patch_estimated_stepping_batches",
    "patch_hydra_subprocess_cmd",
    "patch_signal_registration",
    "patch_zero_grad_factory",
    "quiet_child_process_observer",
    "requeue_on_slurm",
    "restore_pending_loader_states",
    "save_last_checkpoint",
    "set_data_parallel_size",
    "set_module_device_mesh",
    "set_rng_states",
    "set_loop_loaders",
    "setup_distributed",
    "signal_connector",
    "train_fetcher_done",
    "train_fetcher_prefetches",
    "trainer_callbacks",
    "trainer_fast_dev_run",
    "trainer_log_every_n_steps",
    "training_step_output_refused",
    "zero_grad_now",
]

SUPPORTED_LIGHTNING = ">=2.5,<2.7"
"""The Lightning versions whose internals this module was tested against: pyproject's bound, which `.ci/contract`
checks at both ends. Lightning 2.4 is left out: a fit resumed from a mid-epoch checkpoint replays the batch that saved
it, so a resumed accumulation schedule or micro-batch split drifts from the uninterrupted fit (fixed in 2.5.0)."""

HYDRA_LAUNCHER_MODULES = (
    "lightning.pytorch.strategies.launchers.subprocess_script",
    "lightning.fabric.strategies.launchers.subprocess_script",
)
"""The launcher modules that look `_hydra_subprocess_cmd` up at call time."""


class LightningInternalsError(RuntimeError):
    """A Lightning internal this package relies on is missing: another Lightning version than the ones supported."""


def _version() -> str:
    import lightning

    return str(lightning.__version__)


def _missing(owner: Any, name: str, feature: str) -> LightningInternalsError:
    where = owner.__name__ if isinstance(owner, type) else type(owner).__name__
    return LightningInternalsError(
        f"`{where}.{name}` does not exist in Lightning {_version()}; {feature} needs it. lightning_accel supports "
        f"Lightning {SUPPORTED_LIGHTNING}: install one (`pip install 'lightning{SUPPORTED_LIGHTNING}'`), or leave "
        "the feature out."
    )


def _get(obj: Any, name: str, feature: str) -> Any:
    if not hasattr(obj, name):
        raise _missing(obj, name, feature)
    return getattr(obj, name)


def training_step_output_refused(err: BaseException) -> tuple[bool, Any] | None:
    """Whether `err` is Lightning's refusal of what `training_step` returned under automatic optimization (a dict
    without 'loss', or neither a Tensor, a dict nor None): None when it is not; else `(True, output)` where the
    traceback still holds the output (the argument of `ClosureResult.from_training_step_output`, where Lightning
    raises), `(False, None)` where it does not."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    text = str(err)
    if not isinstance(err, MisconfigurationException) or not (
        "`training_step` must return" in text or "'loss' key needs to be present" in text
    ):
        return None
    trace = err.__traceback__
    while trace is not None:
        frame = trace.tb_frame
        if frame.f_code.co_name == "from_training_step_output" and "training_step_output" in frame.f_locals:
            return True, frame.f_locals["training_step_output"]
        trace = trace.tb_next
    return False, None


def _patch(obj: Any, name: str, value: Any, feature: str) -> Callable[[], None]:
    if not hasattr(obj, name):
        raise _missing(obj, name, feature)
    return patch_attribute(obj, name, value, why=feature)


# -- the Trainer's attributes its connectors set ----------------------------------------------------------------


class _ConnectedTrainer(Protocol):
    """Public Trainer attributes that Lightning's connectors set in `Trainer.__init__` without declaring them on
    `Trainer`, so a type checker does not see them."""

    callbacks: list[pl.Callback]
    log_every_n_steps: int
    fast_dev_run: int | bool


def trainer_callbacks(trainer: pl.Trainer) -> list[pl.Callback]:
    """`trainer.callbacks` (set by Lightning's callback connector)."""
    return cast("_ConnectedTrainer", trainer).callbacks


def trainer_log_every_n_steps(trainer: pl.Trainer) -> int:
    """`trainer.log_every_n_steps` (set by Lightning's logger connector)."""
    return cast("_ConnectedTrainer", trainer).log_every_n_steps


def trainer_fast_dev_run(trainer: pl.Trainer) -> int | bool:
    """`trainer.fast_dev_run` (set by Lightning's `_init_debugging_flags`)."""
    return cast("_ConnectedTrainer", trainer).fast_dev_run


# -- the fit loop ------------------------------------------------------------------------------------------------


def loop_combined_loader(loop: Any, feature: str) -> Any | None:
    """The CombinedLoader a fit or evaluation loop iterates (`_combined_loader`), None before it is set up."""
    return _get(loop, "_combined_loader", feature)


def loop_loaders(loop: Any, feature: str) -> list[Any]:
    """The DataLoaders a fit or evaluation loop iterates; empty before they are set up."""
    combined = loop_combined_loader(loop, feature)
    return [] if combined is None else list(combined.flattened)


def set_loop_loaders(loop: Any, loaders: list[Any], feature: str) -> None:
    """Replace the DataLoaders a fit or evaluation loop iterates (the DataLoaderTuner's rebuilt ones)."""
    combined = loop_combined_loader(loop, feature)
    if combined is None:
        raise _missing(loop, "_combined_loader", feature)
    combined.flattened = loaders


def loop_data_fetcher(loop: Any, feature: str) -> Any | None:
    """A fit or evaluation loop's data fetcher (`_data_fetcher`)."""
    return _get(loop, "_data_fetcher", feature)


def epoch_loop_makes_iterator(trainer: pl.Trainer) -> bool:
    """Whether the training epoch loop makes its data iterator itself at this epoch's start, as
    `_TrainingEpochLoop.on_run_start` decides: past the first epoch and not restarting, and from Lightning 2.5.3 also
    not resuming (`_FitLoop.is_resuming`, which 2.5.0-2.5.2 lack)."""
    fit_loop = trainer.fit_loop
    resuming = bool(getattr(fit_loop, "is_resuming", False))
    return trainer.current_epoch > 0 and not resuming and not fit_loop.epoch_loop.restarting


def combined_loader_iterators(combined: Any) -> list[Any]:
    """The per-DataLoader iterators a CombinedLoader holds now (its `_iterator`'s), empty when it holds none."""
    iterator = getattr(combined, "_iterator", None)
    return list(getattr(iterator, "iterators", None) or [])


def restore_pending_loader_states(fit_loop: Any) -> bool:
    """Load the loader states a checkpoint restored after `on_fit_start` (`_combined_loader_states_to_load`), at
    once; whether there were any."""
    if not getattr(fit_loop, "_combined_loader_states_to_load", None):
        return False
    _get(fit_loop, "_load_combined_loader_states", "restoring the DataLoaders' states from a checkpoint")()
    return True


def optimizer_steps_logged(trainer: pl.Trainer) -> int:
    """The step loggers are given (`_TrainingEpochLoop._batches_that_stepped`)."""
    return int(_get(trainer.fit_loop.epoch_loop, "_batches_that_stepped", "logging at the loggers' step"))


def accumulating(trainer: pl.Trainer) -> bool | None:
    """Whether the batch in hand accumulates (no optimizer step after it); None where this Lightning does not say."""
    should_accumulate = getattr(trainer.fit_loop.epoch_loop, "_should_accumulate", None)
    return bool(should_accumulate()) if callable(should_accumulate) else None


def patch_accumulation_boundary(trainer: pl.Trainer, reached: Callable[[], bool], feature: str) -> Callable[[], None]:
    """Decide where an accumulation window ends (`_TrainingEpochLoop._accumulated_batches_reached`); the undo."""
    return _patch(trainer.fit_loop.epoch_loop, "_accumulated_batches_reached", reached, feature)


def patch_zero_grad_factory(automatic: Any, factory: Callable[..., Any], feature: str) -> Callable[[], None]:
    """Decide when automatic optimization zeroes the gradients (`_AutomaticOptimization._make_zero_grad_fn`)."""
    return _patch(automatic, "_make_zero_grad_fn", factory, feature)


def zero_grad_now(automatic: Any, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
    """Zero the gradients as automatic optimization does: the hook, then `optimizer_zero_grad`."""
    feature = "zeroing the gradients at an accumulation window's start"
    _get(automatic, "_on_before_zero_grad", feature)(optimizer)
    _get(automatic, "_optimizer_zero_grad", feature)(batch_idx, optimizer)


def backward_skipped(automatic: Any) -> bool:
    """Whether automatic optimization skips the backward (`_AutomaticOptimization._skip_backward`)."""
    return bool(_get(automatic, "_skip_backward", "accumulation windows"))


def patch_closure_factory(automatic: Any, factory: Callable[..., Any], feature: str) -> Callable[[], None]:
    """Build the closure each optimizer step runs (`_AutomaticOptimization._make_closure`); the undo."""
    return _patch(automatic, "_make_closure", factory, feature)


def closure_step_fns(automatic: Any, batch_idx: int, optimizer: Any, feature: str) -> tuple[Any, Any]:
    """The backward and the zero-grad functions Lightning's closure would get for this step (either may be None)."""
    backward = _get(automatic, "_make_backward_fn", feature)(optimizer)
    zero_grad = _get(automatic, "_make_zero_grad_fn", feature)(batch_idx, optimizer)
    return backward, zero_grad


def logged_results(trainer: pl.Trainer) -> Any | None:
    """The results collection `self.log` writes into (`Trainer._results`); None outside a loop."""
    return getattr(trainer, "_results", None)


def call_callback_hooks(trainer: pl.Trainer, hook: str, *args: Any) -> None:
    """Run a hook on every callback as Lightning does (with its profiler section)."""
    from lightning.pytorch.trainer import call

    _get(call, "_call_callback_hooks", f"running `{hook}` on the callbacks")(trainer, hook, *args)


def call_module_hook(trainer: pl.Trainer, hook: str, *args: Any) -> Any:
    """Run a LightningModule hook as Lightning does (with its profiler section); its return value."""
    from lightning.pytorch.trainer import call

    return _get(call, "_call_lightning_module_hook", f"running `{hook}` on the LightningModule")(trainer, hook, *args)


# -- strategies ----------------------------------------------------------------------------------------------------


def ddp_comm_hook(strategy: Any) -> Any | None:
    """The DDP communication hook a DDPStrategy was given (`DDPStrategy._ddp_comm_hook`); None for none or another
    strategy."""
    return getattr(strategy, "_ddp_comm_hook", None)


def setup_distributed(strategy: Any) -> None:
    """Set up the process group as Lightning's ParallelStrategy subclasses do (`_setup_distributed`)."""
    _get(strategy, "_setup_distributed", "the pipeline strategy's process group")()


def set_module_device_mesh(module: pl.LightningModule, mesh: Any) -> None:
    """Give the LightningModule its `device_mesh` (Lightning's property reads `_device_mesh`)."""
    if "device_mesh" not in dir(type(module)):
        raise _missing(module, "device_mesh", "the pipeline strategy's device mesh")
    module._device_mesh = mesh


def model_parallel_sizes(strategy: Any) -> tuple[Any, Any]:
    """`(data_parallel_size, tensor_parallel_size)` a ModelParallelStrategy was given ("auto" or a number)."""
    feature = "resolving `data_parallel_size='auto'`"
    return _get(strategy, "_data_parallel_size", feature), _get(strategy, "_tensor_parallel_size", feature)


def set_data_parallel_size(strategy: Any, size: Any) -> None:
    """Set the data-parallel size a ModelParallelStrategy builds its mesh with."""
    _get(strategy, "_data_parallel_size", "resolving `data_parallel_size='auto'`")
    strategy._data_parallel_size = size


def distributed_checkpoint_metadata_name() -> str:
    """The file of a distributed checkpoint that holds loops, callbacks and hyper-parameters (`meta.pt`)."""
    from lightning.fabric.utilities import load

    return str(_get(load, "_METADATA_FILENAME", "reading a distributed checkpoint's metadata"))


def load_distributed_checkpoint(path: Any) -> dict[str, Any]:
    """A distributed checkpoint directory consolidated into one state dict, as Lightning's `consolidate` does."""
    from lightning.fabric.utilities import load

    return _get(load, "_load_distributed_checkpoint", "consolidating a distributed checkpoint")(path)


def hyperparameter_attribute_prefix() -> str:
    """The prefix of the attributes `save_hyperparameters` sets on a LightningModule (`_hparams`, `_hparams_initial`,
    `_hparams_name`): the module's configuration, not state a step changes."""
    return "_hparams"


# -- RNG ------------------------------------------------------------------------------------------------------------


def collect_rng_states(include_cuda: bool) -> dict[str, Any]:
    """Every RNG state Lightning saves in a checkpoint (Python, numpy, torch, CUDA)."""
    from lightning.fabric.utilities import seed

    return _get(seed, "_collect_rng_states", "keeping the RNG streams as they were")(include_cuda=include_cuda)


def set_rng_states(states: dict[str, Any]) -> None:
    """Put back what `collect_rng_states` took."""
    from lightning.fabric.utilities import seed

    _get(seed, "_set_rng_states", "keeping the RNG streams as they were")(states)


# -- signals and SLURM -------------------------------------------------------------------------------------------


def signal_connector(trainer: pl.Trainer) -> Any | None:
    """The Trainer's signal connector (`Trainer._signal_connector`), None where this Lightning has none."""
    return getattr(trainer, "_signal_connector", None)


def patch_signal_registration(connector: Any, register: Callable[[], None], feature: str) -> Callable[[], None]:
    """Replace how Lightning registers its signal handlers after `on_fit_start`; the undo."""
    return _patch(connector, "register_signal_handlers", register, feature)


def forget_lightning_sigterm_handler(connector: Any) -> None:
    """Drop what Lightning remembered as the SIGTERM handler to put back at teardown (ours stays ours)."""
    handlers = getattr(connector, "_original_handlers", None)
    if isinstance(handlers, dict):
        handlers.pop(signal.SIGTERM, None)


def cluster_environment(trainer: pl.Trainer) -> Any | None:
    """The cluster environment the Trainer chose (SLURM, torchelastic, ...)."""
    connector = _get(trainer, "_accelerator_connector", "reading the cluster environment")
    return getattr(connector, "cluster_environment", None)


def requeue_on_slurm(trainer: pl.Trainer, signum: int) -> None:
    """Save the HPC checkpoint and requeue the SLURM job, as Lightning's own SIGUSR1 handler does."""
    connector = _get(trainer, "_signal_connector", "requeueing on SLURM")
    _get(connector, "_slurm_sigusr_handler_fn", "requeueing on SLURM")(signum, None)


def save_last_checkpoint(checkpoint: Any, trainer: pl.Trainer) -> bool:
    """Save `last.ckpt` through a ModelCheckpoint as it would at the end (its own naming, linking and top-k
    bookkeeping); False where this ModelCheckpoint cannot (the caller saves the file itself)."""
    save = getattr(checkpoint, "_save_last_checkpoint", None)
    candidates = getattr(checkpoint, "_monitor_candidates", None)
    if not (callable(save) and callable(candidates)):
        return False
    save(trainer, candidates(trainer))
    return True


def quiet_child_process_observer(threads: Iterable[threading.Thread] | None = None) -> int:
    """Tell Lightning's child-process observer (rank 0 of a job it launched polls the children and SIGKILLs every
    process when one exits non-zero) that it is done; how many it found."""
    found = 0
    for thread in threading.enumerate() if threads is None else threads:
        if thread.name == "child-process-observer" and callable(getattr(thread, "_run", None)):
            patch_attribute(thread, "_run", lambda: True)  # kept: the process is on its way out
            found += 1
    return found


# -- Hydra -----------------------------------------------------------------------------------------------------------


def patch_hydra_subprocess_cmd(command: Callable[..., Any], feature: str) -> Callable[[], None]:
    """Replace the command Lightning's launchers start child ranks with under Hydra; one undo for all of them."""
    from contextlib import ExitStack
    from importlib import import_module

    stack = ExitStack()
    try:
        for name in HYDRA_LAUNCHER_MODULES:
            stack.callback(_patch(import_module(name), "_hydra_subprocess_cmd", command, feature))
    except BaseException:
        stack.close()
        raise
    return stack.close


# -- the last batch of an epoch and the Trainer's estimate of its optimizer steps ------------------------------------


def train_fetcher_prefetches(trainer: pl.Trainer, feature: str) -> bool | None:
    """Whether the fit loop's data fetcher fetches a batch ahead (`_PrefetchDataFetcher`), so it knows the epoch's
    last batch when that batch is handed out; False for the `_DataLoaderIterDataFetcher` of a `training_step` that
    takes `dataloader_iter` (it learns of the end only when `next()` raises); None before the fit loop has one."""
    from lightning.pytorch.loops import fetchers

    fetcher = loop_data_fetcher(trainer.fit_loop, feature)
    if fetcher is None:
        return None
    prefetching = _get(fetchers, "_PrefetchDataFetcher", feature)
    return isinstance(fetcher, prefetching) and int(_get(fetcher, "prefetch_batches", feature)) >= 1


def train_fetcher_done(trainer: pl.Trainer, feature: str) -> bool:
    """Whether the batch the fit loop's data fetcher handed out last is the epoch's last (`_DataFetcher.done`: from
    the length where the loader has one, else from the batch it fetched ahead)."""
    fetcher = loop_data_fetcher(trainer.fit_loop, feature)
    if fetcher is None:
        raise _missing(trainer.fit_loop, "_data_fetcher", feature)
    return bool(_get(fetcher, "done", feature))


def epoch_loop_batch_idx(trainer: pl.Trainer) -> int:
    """The index within the epoch of the training batch in hand (`_TrainingEpochLoop.batch_idx`), also where the
    hooks are given a stale one (a `training_step` that takes `dataloader_iter` is handed the previous batch's)."""
    return int(_get(trainer.fit_loop.epoch_loop, "batch_idx", "counting the batches left in an epoch"))


def patch_estimated_stepping_batches(
    trainer: pl.Trainer, estimate: Callable[[Callable[[], Any]], Any], feature: str
) -> Callable[[], None]:
    """Answer `trainer.estimated_stepping_batches` for this Trainer with `estimate(lightning)`, where `lightning()`
    is Lightning's own answer; every other Trainer keeps Lightning's. The property lives on the class, so the patch
    does too, dispatching on the instance; the undo puts the class's property back.
    """
    name = "estimated_stepping_batches"
    owner = next((klass for klass in type(trainer).__mro__ if name in vars(klass)), None)
    original = None if owner is None else vars(owner)[name]
    if not isinstance(original, property) or original.fget is None:
        raise _missing(trainer, name, feature)
    lightning_fget = original.fget

    def fget(self: Any) -> Any:
        if self is trainer:
            return estimate(lambda: lightning_fget(self))
        return lightning_fget(self)

    return patch_attribute(owner, name, property(fget, doc=original.__doc__), why=feature)
