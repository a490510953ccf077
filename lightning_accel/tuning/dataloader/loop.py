"""The one module that touches Lightning's loop internals: trial steps that leave no trace, rank lockstep, loader
swaps, the facts a decision depends on."""

from __future__ import annotations

import contextlib
import copy
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import lightning.pytorch as pl
import psutil
import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torchmetrics import Metric

from lightning_accel import _lightning
from lightning_accel.batches import samples_in
from lightning_accel.patching import patch_attribute
from lightning_accel.system import read_cpu_info, read_memory_limit
from lightning_accel.system.loader_memory import WORKER_BYTES, worker_footprint
from lightning_accel.system.threads import planned_intra_op
from lightning_accel.tuning.dataloader import policy
from lightning_accel.tuning.dataloader.loader_settings import LoaderSettings
from lightning_accel.tuning.dataloader.timing import (
    Trial,
    TrialError,
    _shutdown,
    batch_nbytes,
    frozen_rng,
    loader_settings,
    rebuild_loader,
)
from lightning_accel.tuning.dataloader.trial_runner import TrialRunner

__all__ = [
    "Searched",
    "StepMode",
    "facts",
    "is_tuned",
    "make_step",
    "memory_free",
    "rank_sync",
    "share_threads",
    "rebuilt",
    "same_host_pids",
    "search_in_lockstep",
    "stop_workers",
    "swap_loaders",
    "caveats",
    "untouched",
    "untunable",
]

StepMode = Literal["train", "forward", "data"]
_TUNED = "_lightning_accel_tuned"  # marks the DataLoaders this package built, so a reloaded one is told apart

_FEATURE = "the DataLoaderTuner (swapping the loaders a loop iterates)"


def make_step(trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[Callable[[Any, int], None], StepMode]:
    """A training step on one batch that does not step the optimizer, and what it runs.

    "train": the batch transfer hooks, `training_step` under the precision's autocast and `backward`, called on the
    LightningModule itself (under DDP: past the DDP wrapper, so no gradient all-reduce), gradients dropped after.
    "forward": other wrapped models (FSDP1, DeepSpeed): the strategy's `training_step` without gradients.
    "data": manual optimization, whose `training_step` steps optimizers itself: only the batch transfer.
    """
    strategy, precision = trainer.strategy, trainer.precision_plugin
    mode: StepMode = "data"
    if pl_module.automatic_optimization:
        bare = strategy.model is pl_module or isinstance(strategy.model, DistributedDataParallel)
        mode = "train" if bare else "forward"
    params = [p for p in pl_module.parameters() if p.requires_grad]
    cuda = strategy.root_device.type == "cuda"

    def step(batch: Any, batch_idx: int) -> None:
        batch = strategy.batch_to_device(batch)
        if mode == "train":
            with torch.enable_grad(), precision.train_step_context():
                out = pl_module.training_step(batch, batch_idx)
            loss = out.get("loss") if isinstance(out, dict) else out
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                loss.backward()
            for param in params:
                param.grad = None
        elif mode == "forward":
            with torch.no_grad():
                strategy.training_step(batch, batch_idx)
        if cuda:
            torch.cuda.synchronize(strategy.root_device)

    return step, mode


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def _length(value: object) -> int | None:
    try:
        return len(value)  # type: ignore[arg-type]
    except Exception:
        return None


def _public(module: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training"}


@contextlib.contextmanager
def untouched(pl_module: pl.LightningModule, changed: list[str] | None = None) -> Iterator[None]:
    """Put back what trial steps change in the module: buffers (BatchNorm statistics), parameters that do not train
    (a momentum encoder or EMA updated in `training_step`), gradients, torchmetrics states, train/eval mode, and its
    public attributes (`self.calls += 1` and `self.cache = ...` are undone: each name is bound to what it held
    before, and names the steps added are removed); `self.log` and `self.log_dict` do nothing meanwhile. Trained
    parameters are never stepped.

    An object the steps changed in place (a list a step appends to, found by its length) cannot be put back: the
    attribute's name goes into `changed` (the DataLoaderTuner warns, naming it)."""
    buffers = [(b, b.detach().clone()) for b in pl_module.buffers()]
    buffers += [(p, p.detach().clone()) for p in pl_module.parameters() if not p.requires_grad]
    grads = [(p, p.grad) for p in pl_module.parameters()]
    metrics = [
        (m, copy.deepcopy({k: getattr(m, k) for k in m._defaults}), m._update_count, m._computed)
        for m in pl_module.modules()
        if isinstance(m, Metric)
    ]
    modes = [(m, m.training) for m in pl_module.modules()]  # per module: a frozen part may stay in eval mode
    public = {k: (v, _length(v)) for k, v in _public(pl_module).items()}
    with contextlib.ExitStack() as undo:
        for name in ("log", "log_dict"):
            undo.callback(patch_attribute(pl_module, name, _ignore, why="the DataLoaderTuner's trial steps"))
        undo.callback(_restore, modes, buffers, grads, metrics)
        undo.callback(_restore_attributes, pl_module, public, changed)
        yield


def _restore(modes: list[Any], buffers: list[Any], grads: list[Any], metrics: list[Any]) -> None:
    """Put back what `untouched` saved."""
    for module, training in modes:
        module.training = training
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)
    for param, grad in grads:
        param.grad = grad
    for metric, states, count, computed in metrics:
        for name, value in states.items():
            setattr(metric, name, value)
        metric._update_count, metric._computed = count, computed


def _restore_attributes(module: Any, saved: dict[str, tuple[Any, int | None]], changed: list[str] | None) -> None:
    """Bind `module`'s public attributes to what they held when `saved`, drop the ones added since; name in `changed`
    those whose object changed length in place."""
    now = _public(module)
    for name in now.keys() - saved.keys():
        delattr(module, name)
    for name, (value, length) in saved.items():
        if now.get(name, _MISSING) is not value:
            setattr(module, name, value)
        elif _length(value) != length and changed is not None:
            changed.append(name)


_MISSING = object()


def rank_sync(device: torch.device) -> Callable[[Sequence[float]], list[float]]:
    """Element-wise max over all ranks of the default process group; the identity outside one."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list

    def sync(values: Sequence[float]) -> list[float]:
        tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    return sync


def same_host_pids() -> list[int]:
    """The process ids of the other ranks on this host (their DataLoader workers count as ours, not as interference
    from another job); exchanged once through the default process group, empty outside one."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return []
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (socket.gethostname(), os.getpid()))
    return [pid for host, pid in everyone if host == socket.gethostname() and pid != os.getpid()]


def is_tuned(loader: object) -> bool:
    return bool(getattr(loader, _TUNED, False))


def rebuilt(loader: object, settings: LoaderSettings) -> object:
    """`loader` rebuilt with `settings` and marked as tuned; as it is when it cannot be rebuilt."""
    if not isinstance(loader, DataLoader):
        return loader
    try:
        new = rebuild_loader(loader, settings)
    except TypeError:
        return loader
    setattr(new, _TUNED, True)
    return new


def stop_workers(loop: Any) -> None:
    """Shut down the worker processes behind a loop's CombinedLoader (its iterators' and persistent ones); its
    iterator object stays, so its length can still be read, but must be recreated before it is iterated again."""
    combined = _lightning.loop_combined_loader(loop, _FEATURE)
    assert combined is not None, "stop_workers() before the loop set up its CombinedLoader"
    for it in _lightning.combined_loader_iterators(combined):
        _shutdown(it)
    for loader in combined.flattened:
        if isinstance(loader, DataLoader) and loader._iterator is not None:
            _shutdown(loader._iterator)
            loader._iterator = None


def swap_loaders(loop: Any, loaders: list[Any], reiterate: bool, frozen: bool = True) -> None:
    """Give a fit or evaluation loop other DataLoaders: stop the old ones' workers, then set them in its
    CombinedLoader. With `reiterate`, recreate the iterator of the loop's data fetcher, its RNG draws undone if
    `frozen`; without, the loop must recreate it before iterating (the evaluation loop does at every run)."""
    stop_workers(loop)
    _lightning.set_loop_loaders(loop, loaders, _FEATURE)
    fetcher = _lightning.loop_data_fetcher(loop, _FEATURE)
    if reiterate and fetcher is not None:
        with frozen_rng(loaders) if frozen else contextlib.nullcontext():
            iter(fetcher)


def untunable(trainer: pl.Trainer, loaders: list[Any]) -> str:
    """Why the fit's train loader is not tuned, or ""."""
    if _lightning.trainer_fast_dev_run(trainer):
        return "`fast_dev_run` is set"
    if len(loaders) != 1:
        return f"the fit has {len(loaders)} train DataLoaders; one is tuned"
    try:
        rebuild_loader(loaders[0], LoaderSettings())
        len(loaders[0])
    except TypeError as err:
        return str(err)
    return ""


_KNOWN_SAMPLERS = ("torch.", "lightning.", "lightning_fabric.", "pytorch_lightning.")


def caveats(loader: DataLoader, step_mode: str, strategy: object, trials: bool = True) -> list[str]:
    """What the tuner cannot keep identical for this loader and module, one sentence each (it warns with them):
    a loader with its own `generator` (its first epoch's order, whenever the tuner swaps the loader); with
    `trials`, also a sampler of the user's own (its state) and a step mode other than "train" (what they time)."""
    found = []
    owners = (loader, loader.sampler, loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None))
    if any(isinstance(getattr(owner, "generator", None), torch.Generator) for owner in owners):
        found.append(
            "your train DataLoader (or its sampler) has its own `generator`: its first epoch is shuffled differently "
            "than without the tuner (the same order in every tuned or cached fit); seed the global RNG "
            "(`L.seed_everything`) instead to keep an untuned fit's order"
        )
    if not trials:
        return found
    own = [
        type(s).__qualname__
        for s in (loader.sampler, loader.batch_sampler)
        if s is not None and not type(s).__module__.startswith(_KNOWN_SAMPLERS)
    ]
    if own:
        found.append(
            f"your sampler `{own[0]}` is iterated by the trials: any state it keeps across iterations (other than "
            "a torch.Generator, which is put back) has advanced when the fit's first epoch starts"
        )
    if step_mode == "data":
        found.append(
            "the LightningModule uses manual optimization, so the trials time the loading and the batch transfer "
            "only, not `training_step`: the choice favours loading, and its speedup is one of loading alone"
        )
    elif step_mode == "forward":
        found.append(
            f"the model is wrapped by {type(strategy).__name__}, so the trials time forward passes without backward: "
            "steps read shorter than in training, and the choice may take more workers than training needs"
        )
    return found


def facts(trainer: pl.Trainer, loader: Any, batch_size: int | None, cpus: int) -> dict[str, Any]:
    """What a decision depends on (the fingerprint's contents): data, batch, model, precision, hardware, world."""

    def name(obj: object) -> str:
        return f"{type(obj).__module__}.{type(obj).__qualname__}"

    cuda = isinstance(trainer.accelerator, CUDAAccelerator)
    device = torch.cuda.get_device_name(trainer.strategy.root_device) if cuda else read_cpu_info().model_name
    module = trainer.lightning_module
    sampler = loader.batch_sampler if loader.batch_size is None else loader.sampler
    return {
        "dataset": name(loader.dataset),
        "length": len(loader.dataset),
        "batch_size": batch_size,
        "batches": len(loader),
        "drop_last": bool(loader.drop_last),
        "sampler": name(sampler),
        "collate_fn": getattr(loader.collate_fn, "__qualname__", name(loader.collate_fn)),
        "loader": loader_settings(loader).as_dict(),
        "model": name(module),
        "parameters": sum(p.numel() for p in module.parameters()),
        "precision": str(trainer.precision),
        "accelerator": name(trainer.accelerator),
        "device": device,
        "cpus_per_rank": cpus,
        "world_size": trainer.world_size,
        "processes_per_node": trainer.num_devices,
    }


def memory_free(processes: int) -> int:
    """Memory one of `processes` ranks may still use: the host's available memory, or what is left under the memory
    cgroup's limit once every rank holds as much as this one, shared among the ranks."""
    free = psutil.virtual_memory().available
    limit = read_memory_limit().limit_bytes
    if limit is not None:
        free = min(free, limit - psutil.Process().memory_info().rss * processes)
    return max(0, free) // max(1, processes)


def share_threads(
    measure: Callable[[LoaderSettings, float | None], Trial], ranks: int
) -> Callable[[LoaderSettings, float | None], Trial]:
    """`measure`, each trial run with the intra-op threads the thread plan gives a rank feeding that many workers
    (`system.threads.planned_intra_op`): workers and threads share one budget, so a setting with more workers is
    timed with fewer threads, as it will run. Without the plan in force, `measure` itself."""
    if planned_intra_op(0, ranks) is None:
        return measure

    def timed(settings: LoaderSettings, cut_s_per_step: float | None) -> Trial:
        before = torch.get_num_threads()
        torch.set_num_threads(planned_intra_op(settings.num_workers, ranks) or before)
        try:
            return measure(settings, cut_s_per_step)
        finally:
            torch.set_num_threads(before)

    return timed


@dataclass(frozen=True, kw_only=True, slots=True)
class Searched:
    """What `search_in_lockstep` found, the same on every rank but `changed`."""

    trials: list[Trial]
    original: LoaderSettings
    """The loader's own settings, as a trial runs them (persistent with workers: persistence only matters between
    epochs)."""
    budget: int
    """Rank zero's CPU budget per rank, the one every rank searched with."""
    changed: tuple[str, ...] = ()
    """Public attributes of the module the trial steps changed and that could not be put back (`untouched`)."""


def search_in_lockstep(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    loader: DataLoader,
    step: Callable[[Any, int], None],
    *,
    batch_size: int | None,
    budget: int,
    shm_free: int | None,
    memory_free: int,
    warmup_steps: int,
    steps_per_trial: int,
    deadline: float,
    max_workers: int | None,
    tolerance: float,
    prefetch_factors: Sequence[int],
    tune_pin_memory: bool,
) -> Searched:
    """Run `policy.search` on every rank at once.

    Rank zero's budget, settings and free memory are broadcast, so every rank runs the same search; the batch size in
    bytes is the largest rank's, the loader's length the shortest's; trials leave the module as it was (`untouched`).

    Raises:
        TrialError: on every rank, when the first batch failed on any rank.
    """
    strategy, sync = trainer.strategy, rank_sync(trainer.strategy.root_device)
    probe, error = None, None
    try:  # one batch, for its size in bytes; a failure on any rank stops every rank here
        probe = next(iter(rebuild_loader(loader, LoaderSettings())))
    except Exception as err:
        error = err
    if sync([float(error is not None)])[0]:
        raise TrialError(
            f"the first batch failed: {error!r}" if error else "the first batch failed on another rank"
        ) from error
    # samples_in's default 1: a batch with no tensor counts as one sample, so throughput counts batches
    batch_size, batch_bytes = batch_size or samples_in(probe, default=1), batch_nbytes(probe)
    original = loader_settings(loader)  # as a trial runs it: persistence only matters between epochs
    original = replace(original, persistent_workers=original.num_workers > 0)
    worker_bytes = worker_footprint()[0] if trainer.is_global_zero else WORKER_BYTES  # measured once, on rank zero
    shared = (budget, original, shm_free, memory_free, worker_bytes)
    budget, original, shm_free, memory_free, worker_bytes = strategy.broadcast(shared, src=0)  # one search everywhere
    most_bytes, fewest_batches = sync([float(batch_bytes), -float(len(loader))])
    batch_bytes, length = int(most_bytes), int(-fewest_batches)
    measure = TrialRunner(
        loader=loader,
        step=step,
        samples_per_batch=batch_size,
        batches=length,
        warmup_steps=warmup_steps,
        steps_per_trial=steps_per_trial,
        deadline=deadline,
        sync=sync,
        pids=same_host_pids(),
    )
    changed: list[str] = []
    with untouched(pl_module, changed):
        trials = policy.search(
            share_threads(measure, ranks=trainer.num_devices),
            budget=budget,
            max_workers=max_workers or 4 * budget,
            prefetch_factors=prefetch_factors,
            original=original,
            tolerance=tolerance,
            pin_memory=tune_pin_memory and isinstance(trainer.accelerator, CUDAAccelerator),
            guard=lambda s: policy.memory_note(s, batch_bytes, shm_free, memory_free, worker_bytes),
        )
    return Searched(trials=trials, original=original, budget=budget, changed=tuple(changed))
