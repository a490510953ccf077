"""Find the train DataLoader's num_workers, prefetch_factor, persistent_workers and pin_memory by timing real steps."""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel import _lightning
from lightning_accel.batches import loader_batch_size
from lightning_accel.errors import ConfigError, LightningAccelWarning
from lightning_accel.system import read_cpu_budget, read_shm
from lightning_accel.system.threads import planned_intra_op
from lightning_accel.tuning.dataloader import cache, policy, tuner_report, verification
from lightning_accel.tuning.dataloader import loop as loop_internals
from lightning_accel.tuning.dataloader.decision import TunerDecision
from lightning_accel.tuning.dataloader.loader_settings import LoaderSettings
from lightning_accel.tuning.dataloader.timing import Trial, TrialError, frozen_rng, loader_settings
from lightning_accel.tuning.dataloader.verification import LiveWait

__all__ = ["DataLoaderTuner"]

_FEATURE = "the DataLoaderTuner (reading and swapping the loaders a loop iterates)"

log = logging.getLogger(__name__)


class DataLoaderTuner(Callback):
    """Choose the train DataLoader's settings by timing real training steps at the start of the fit.

    At `on_fit_start` (before the sanity check) the train DataLoader is rebuilt with each candidate setting and the
    model's own `training_step` and backward run on its batches, timing the wait for each batch and the step. First
    without workers, then the loader's own settings (timed in full: every claim is set against them). When the
    first waits for data less than `tolerance` of its step, or the loader's own settings do, nothing can gain more,
    and the search ends. Otherwise worker counts within the CPUs of this rank (`lightning_accel.system.
    read_cpu_budget`: affinity, cgroup quota, divided among the node's processes); more, up to `max_workers`, while
    the fastest count still waits for data (a loader that waits on I/O) and each doubling pays, but never more
    workers busy loading than the budget holds (the share of its loading a worker keeps a CPU busy is measured
    without workers: a loader that computes gets at most the budget, one that waits on storage more); then
    `prefetch_factors` and, on CUDA, `pin_memory`. Settings whose batches in flight do not fit /dev/shm or the
    memory cgroup are skipped; a trial already slower than the best by more than `tolerance` is cut short.

    The choice: no setting can make a step faster than the loader's own settings by more than 1 / (1 - w), w their
    share of step time spent waiting for data (the high end of its interval: the range of their repeated runs, or a
    bootstrap over the steps of a single run); each reading is capped there, so two settings both read above it tie.
    Among the settings within `tolerance` of the fastest, the loader's own are kept; else the fewest workers, with
    `persistent_workers=True`; a setting other than theirs must be measurably faster than them (the paired interval
    of its runs over theirs above 1), or their settings are kept and the report line says "kept your settings: no
    setting measurably faster (...)". The speedup credited, logged and printed never exceeds the bound; a reading
    above it is named as noise or interference. The Trainer's train and validation DataLoaders are replaced by ones
    built with the choice (left as built when kept); the user's code does not change. If tuning fails (a trial, a
    reading, on any rank), the loaders stay as they were and the fit goes on; under DDP, a failure of one rank that
    the others cannot learn of in a collective stops the run with an error naming the rank, rather than leaving them
    waiting.

    Under DDP every rank runs the same trial at the same time (its workers compete for the node's CPUs as they
    will), on the module itself, past the DDP wrapper (no gradient all-reduce is timed); the slowest rank's time
    counts, rank zero decides and every rank adopts the decision. Decisions are cached in
    `<cache_dir>/dataloader_tuner.json` under a fingerprint of the dataset (type, length), batch size, model,
    precision, hardware and world size, and kept in checkpoints; a fit that finds one skips tuning. A file at that
    path that is not a decision cache (no `schema` of this package) is never written over: the tuner warns and tunes
    without a cache.

    Keeps identical: the trained weights and optimizer state (the optimizer never steps in a trial), gradients,
    buffers (BatchNorm statistics), parameters that do not train, torchmetrics states, train/eval mode, the module's
    public attributes a step rebinds (`self.calls += 1`), the global RNG streams (torch, CUDA, numpy, random: the
    shuffle and dropout draw as without the tuner), the values `self.log` records (muted in trials), and every other
    DataLoader argument (dataset, sampler, batch size, collate_fn, worker_init_fn, timeout). When no setting
    is measurably faster, all four settings and the loaders themselves, train and validation.

    Changes on purpose: the train DataLoader's `num_workers`, `prefetch_factor`, `persistent_workers` (True with
    workers) and, on CUDA, `pin_memory`; with `apply_to_val`, the validation DataLoaders' same four; torch's intra-op
    threads when the thread plan is in force (workers and threads share one budget); up to `max_tuning_time_s` more
    at the start of the fit, spent running `training_step` on real batches that `global_step` does not count. A
    dataset that draws random numbers itself (augmentation in `__getitem__`) draws them in the workers chosen, from
    their seeds, as any DataLoader with workers does.

    Cannot serve: an `IterableDataset`, a DataLoader subclass, several train DataLoaders, `fast_dev_run` (the
    loaders are left alone); manual optimization (the trials time the loading and the batch transfer only); a model
    wrapped by FSDP1 or DeepSpeed (forward passes only); a loader with its own `generator` (its first epoch is
    shuffled differently than without the tuner, the same way in every tuned fit); a sampler of the user's own
    (state it keeps across iterations advances); a `training_step` that changes an object in place (a list it
    appends to: what the trials added stays). Each is named in a warning before the first optimizer step.

    Args:
        max_tuning_time_s: wall-clock bound of tuning; the running trial stops at its next quarter.
        steps_per_trial: timed steps per trial (at least twice the workers, a multiple of them).
        warmup_steps: untimed steps before timing (at least one per worker, so all have started).
        tolerance: a setting within this fraction of the fastest counts as fast as it; 0 takes the fastest as
            measured, however small the margin.
        max_workers: the most workers tried on a loader that waits for data (and keeps them mostly idle: busy
            workers never exceed this rank's CPUs); None: 4 x this rank's CPUs.
        prefetch_factors: batches loaded ahead per worker to try; the first is used while counting workers.
        tune_pin_memory: also try `pin_memory=True` (CUDA only).
        apply_to_val: give the validation DataLoaders the same settings.
        force: tune even when the cache or a checkpoint holds a decision.
        cache_dir: folder of the decision cache; None: `$XDG_CACHE_HOME/lightning_accel` or
            `~/.cache/lightning_accel`.
        use_cache: reuse a decision from the cache, a checkpoint or an earlier fit of this callback, and write the
            cache.
        print_table: print the table of trials with rich on rank zero (it is logged at INFO either way).
        verify_steps: after a decision is reused (cache or checkpoint), the live loop's data-wait share (the time
            from one `on_train_batch_end` to the next `on_train_batch_start` over the step) is measured on this many
            steps after `max(warmup_steps, num_workers)` warm-up steps. When it exceeds both `tolerance` and the
            recorded share + `tuning.dataloader.verification.VERIFY_MARGIN` on any rank, the loader is tuned again
            at the next epoch start (every rank together) and the cache entry is replaced; when the fit ends before
            that, the entry is dropped so the next fit tunes again. 0: no check.

    Interference: every trial runs under a `system.interference.InterferenceProbe` (other ranks on the host are
    ours); a flagged trial shows "yes" in the table's interference column, comparisons near the noise or under load
    are repeated interleaved and decided on medians, and a decision made under interference is applied to the fit
    but neither cached nor reused from a checkpoint (the report line says "not cached").

    Raises:
        ValueError: for a non-positive time, step count or worker count, a tolerance outside [0, 1), or an empty
            or non-positive `prefetch_factors`.

    Logs (once, at the start of training, on the Trainer's loggers):
        `dataloader_tuner/num_workers`, `.../prefetch_factor` (0 without workers), `.../pin_memory`,
        `.../persistent_workers` (0 or 1): the settings chosen.
        `dataloader_tuner/samples_per_s`: training samples per second per rank with them, as measured.
        `dataloader_tuner/data_wait_share`: share of step time waiting for data with them (0..1).
        `dataloader_tuner/speedup`: their throughput over that of the loader's own settings, median over median,
        never above `dataloader_tuner/speedup_bound` (x).
        `dataloader_tuner/speedup_bound`: the most any setting could gain over the loader's own settings, 1 / (1 -
        w) at the high end of w's interval, w their share of step time waiting for data (x).
        `dataloader_tuner/kept`: 1 when the loader's own settings were kept (nothing measurably faster).
        `dataloader_tuner/tuning_time_s`: seconds spent tuning (s); `dataloader_tuner/trials`: settings timed.
        `dataloader_tuner/cache_hit`: 1 when the decision came from the cache or a checkpoint.

    Example::

        trainer = Trainer(callbacks=[DataLoaderTuner(max_tuning_time_s=30)])
    """

    def __init__(
        self,
        max_tuning_time_s: float = 60.0,
        steps_per_trial: int = 16,
        warmup_steps: int = 2,
        tolerance: float = 0.05,
        max_workers: int | None = None,
        prefetch_factors: Sequence[int] = (2, 4),
        tune_pin_memory: bool = True,
        apply_to_val: bool = True,
        force: bool = False,
        cache_dir: str | os.PathLike[str] | None = None,
        use_cache: bool = True,
        print_table: bool = True,
        verify_steps: int = 20,
    ) -> None:
        if not max_tuning_time_s > 0:
            raise ConfigError(f"`max_tuning_time_s={max_tuning_time_s!r}` must be > 0 seconds.")
        for name, value, low in (
            ("steps_per_trial", steps_per_trial, 1),
            ("warmup_steps", warmup_steps, 0),
            ("max_workers", 1 if max_workers is None else max_workers, 1),
            ("verify_steps", verify_steps, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"`{name}={value!r}` must be an integer >= {low}.")
        if not 0.0 <= tolerance < 1.0:
            raise ConfigError(f"`tolerance={tolerance!r}` must be within [0, 1), e.g. 0.05 for 5%.")
        factors = list(prefetch_factors)
        if not factors or any(isinstance(f, bool) or not isinstance(f, int) or f < 1 for f in factors):
            raise ConfigError(f"`prefetch_factors={prefetch_factors!r}` must be a non-empty list of integers >= 1.")
        self.max_tuning_time_s = float(max_tuning_time_s)
        self.steps_per_trial, self.warmup_steps, self.tolerance = steps_per_trial, warmup_steps, float(tolerance)
        self.max_workers, self.prefetch_factors, self.tune_pin_memory = max_workers, factors, tune_pin_memory
        self.apply_to_val, self.force, self.use_cache, self.print_table = apply_to_val, force, use_cache, print_table
        self.cache_dir = None if cache_dir is None else str(cache_dir)
        self.verify_steps = verify_steps
        self.live_wait_share: float | None = None
        """The live loop's data-wait share measured to verify a reused decision; None when not measured."""
        self.retuned = False
        """True when a reused decision failed its verification and the loader was tuned again."""
        self._live: LiveWait | None = None
        self._threads_before: int | None = None
        self.trials: list[Trial] = []
        """The trials of the last tuning, in the order run (empty after a cache hit)."""
        self.decision: LoaderSettings | None = None
        """The settings applied in the last fit; None when the loaders were left alone."""
        self.tuning_time_s, self.cache_hit = 0.0, False
        self.step_mode = ""
        """What a trial step ran: "train", "forward" or "data" (see `tuning.dataloader.loop.make_step`)."""
        self.result: TunerDecision | None = None
        """The last fit's decision (settings, measured throughput and data wait, whether it was cached)."""
        self._state: dict[str, Any] = {}
        """The decision as plain types: loaded from a checkpoint, or the last fit's; validated before it is used."""

    def _search_settings(self) -> dict[str, Any]:
        """The options that change what the search can find: part of the cache's fingerprint."""
        return {
            "max_workers": self.max_workers,
            "prefetch_factors": list(self.prefetch_factors),
            "tune_pin_memory": self.tune_pin_memory,
            "tolerance": self.tolerance,
        }

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir or cache.default_cache_dir()) / "dataloader_tuner.json"

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.trials, self.decision, self.result, self.tuning_time_s, self.cache_hit = [], None, None, 0.0, False
        self._live, self.live_wait_share, self.retuned = None, None, False
        loop, start = trainer.fit_loop, time.perf_counter()
        # set up by another callback: its RNG draws are done
        early = _lightning.loop_combined_loader(loop, _FEATURE) is not None
        with frozen_rng():  # the fit loop's own call finds the loaders set up; their iterator is recreated below
            loop.setup_data()
        train = _lightning.loop_loaders(loop, _FEATURE)
        reason, final = loop_internals.untunable(trainer, train), train
        if loop_internals.rank_sync(trainer.strategy.root_device)([float(bool(reason))])[0]:
            rank_zero_warn(
                f"DataLoaderTuner left the DataLoaders alone: {reason or 'not tunable on another rank'}.",
                category=LightningAccelWarning,
            )
        else:
            try:
                with frozen_rng(train):
                    self.decision = self._decide(trainer, pl_module, loop, train[0], start)
            except TrialError as err:  # raised on every rank at the same point: they go on together
                self.decision = None
                rank_zero_warn(
                    f"DataLoaderTuner failed ({err}); training goes on with the DataLoaders as they were.",
                    category=LightningAccelWarning,
                )
            except Exception as err:
                if trainer.world_size > 1:  # this rank left the tuner's collectives, the others may wait in one
                    raise RuntimeError(
                        f"DataLoaderTuner failed on rank {trainer.global_rank} ({type(err).__name__}: "
                        f"{err}); the ranks cannot agree on DataLoader settings any more. Remove the "
                        "DataLoaderTuner callback to train without it."
                    ) from err
                self.decision = None
                rank_zero_warn(
                    f"DataLoaderTuner failed ({type(err).__name__}: {err}); training goes on with the "
                    "DataLoaders as they were.",
                    category=LightningAccelWarning,
                )
            try:  # after the last collective: a failure here keeps this rank's loaders, the others go on
                if self.decision is not None and not self._kept:
                    final = [loop_internals.rebuilt(dl, self.decision) for dl in train]
            except Exception as err:
                self.decision = None
                warnings.warn(
                    f"DataLoaderTuner could not rebuild the DataLoaders ({type(err).__name__}: {err}); "
                    "this rank trains with them as they were.",
                    LightningAccelWarning,
                    stacklevel=2,
                )
        self.tuning_time_s = time.perf_counter() - start
        if not train:
            return
        try:  # an iterator over the chosen loaders, drawing from the RNGs where the fit loop would have
            loop_internals.swap_loaders(loop, final, reiterate=True, frozen=early)
        except Exception as err:
            if final is train:
                raise
            self.decision = None
            rank_zero_warn(
                f"DataLoaderTuner could not start the chosen DataLoader ({type(err).__name__}: {err}); "
                "training goes on with the DataLoaders as they were.",
                category=LightningAccelWarning,
            )
            loop_internals.swap_loaders(loop, train, reiterate=True, frozen=early)
        if self.decision is not None:
            threads = planned_intra_op(self.decision.num_workers, trainer.num_devices)
            if threads is not None and threads != torch.get_num_threads():  # the thread plan's share with the workers
                rank_zero_info(
                    f"DataLoaderTuner: {self.decision.num_workers} worker(s) share the CPU budget with "
                    f"{threads} intra-op thread(s) per rank (was {torch.get_num_threads()})"
                )
                if self._threads_before is None:  # put back at teardown, as the Trainer found it
                    self._threads_before = torch.get_num_threads()
                torch.set_num_threads(threads)
            self._report(trainer, loader_settings(train[0]))
            if self.cache_hit and self.verify_steps:  # reused: checked on the live loop's first steps
                self._live = LiveWait(skip=max(self.warmup_steps, self.decision.num_workers), steps=self.verify_steps)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loop = trainer.fit_loop
        # A resumed fit with `reload_dataloaders_every_n_epochs` requested the user's loader again after the
        # checkpoint set the epoch (the fit loop's own `setup_data`, after `on_fit_start`): tune it too.
        self._reapply(loop, reiterate=True)
        _lightning.restore_pending_loader_states(loop)  # restored after `on_fit_start` from a checkpoint
        self.on_validation_start(trainer, pl_module)  # the validation loaders exist now, after the sanity check

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loop = trainer.fit_loop  # `reload_dataloaders_every_n_epochs` brought new loaders; the epoch loop makes
        # their iterator itself only past the first epoch and when not resuming
        makes_iterator = _lightning.epoch_loop_makes_iterator(trainer)
        if self._live is not None and self._verification_failed(trainer, final=False):
            self._retune(trainer, pl_module, reiterate=not makes_iterator)
        self._reapply(loop, reiterate=not makes_iterator)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._live is not None:
            self._live.batch_start(time.perf_counter())

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._live is not None:
            self._live.batch_end(time.perf_counter())

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._live is not None:
            self._live.pause()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._live is not None and self._verification_failed(trainer, final=True):  # no epoch start came
            self._forget(trainer, "it failed its verification and the fit ended before the next epoch")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._threads_before is not None:  # the thread plan's share ends with the fit, as the workers do
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def _verification_failed(self, trainer: pl.Trainer, final: bool) -> bool:
        """Whether the reused decision failed its check on any rank (`verification.verdict`); every rank calls this at
        the same hook. Ends the verification once every rank has its window, or it failed."""
        live, result = self._live, self.result
        assert live is not None and result is not None
        enough, failed = verification.verdict(live, result.wait_share, self.tolerance, final)
        any_failed, incomplete = loop_internals.rank_sync(trainer.strategy.root_device)(
            [float(failed), float(not live.complete)]
        )
        if any_failed or not incomplete or final:
            self.live_wait_share, self._live = live.share if enough else None, None
            if enough and trainer.is_global_zero:  # rank zero reports, as it reports the decision
                log.info(verification.verdict_line(live, result.wait_share, bool(any_failed)))
        return bool(any_failed)

    def _forget(self, trainer: pl.Trainer, why: str) -> None:
        """Drop this fit's decision from the cache and from the checkpoint state: the next fit tunes again."""
        key = self.result.fingerprint if self.result is not None else None
        self._state = {}
        if key is None or not self.use_cache or not trainer.is_global_zero:
            return
        try:
            cache.DecisionCache(self.cache_path).remove(key)
            log.warning("DataLoaderTuner: the cached decision was dropped: %s.", why)
        except Exception as err:
            rank_zero_warn(
                f"DataLoaderTuner could not drop its cached decision from {self.cache_path} ({err}).",
                category=LightningAccelWarning,
            )

    def _retune(self, trainer: pl.Trainer, pl_module: pl.LightningModule, reiterate: bool) -> None:
        """Tune again at an epoch start, on every rank in lockstep, and give the fit loop the new decision; the cache
        entry is replaced (or dropped, when the new decision may not be cached)."""
        fit_loop, start, old = trainer.fit_loop, time.perf_counter(), self.result
        loaders = _lightning.loop_loaders(fit_loop, _FEATURE)
        self.trials, self.cache_hit, self.retuned = [], False, True
        try:
            with frozen_rng(loaders):
                decision = self._decide(trainer, pl_module, fit_loop, loaders[0], start, force=True, replaces=old)
        except Exception as err:
            if trainer.world_size > 1 and not isinstance(err, TrialError):
                raise RuntimeError(
                    f"DataLoaderTuner failed on rank {trainer.global_rank} while tuning again "
                    f"({type(err).__name__}: {err})."
                ) from err
            decision = None
            rank_zero_warn(
                f"DataLoaderTuner could not tune again ({type(err).__name__}: {err}); training goes on "
                "with the reused decision.",
                category=LightningAccelWarning,
            )
        self.tuning_time_s += time.perf_counter() - start
        if decision is None or self.result is None or not self.result.confident:
            self._forget(trainer, "it failed its verification, and no decision that may be cached replaced it")
        if decision is not None:
            self.decision = decision
            new = [loop_internals.rebuilt(dl, decision) for dl in loaders]
        else:
            new = loaders
        loop_internals.swap_loaders(fit_loop, new, reiterate=reiterate)
        if decision is not None and old is not None:
            self._report(trainer, old.settings)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._live is not None:  # validation comes between two training batches: not a wait for data
            self._live.pause()
        if self.apply_to_val and not trainer.sanity_checking:  # first time, or reloaded
            self._reapply(trainer.fit_loop.epoch_loop.val_loop, reiterate=trainer.validating)

    @property
    def _kept(self) -> bool:
        """Whether the decision keeps the loader's own settings: its loaders, train and validation, stay as built."""
        return self.result is not None and self.result.kept

    def _reapply(self, loop: Any, reiterate: bool) -> None:
        loaders = _lightning.loop_loaders(loop, _FEATURE)
        if self.decision is not None and not self._kept and not all(loop_internals.is_tuned(dl) for dl in loaders):
            rebuilt = [loop_internals.rebuilt(dl, self.decision) for dl in loaders]
            loop_internals.swap_loaders(loop, rebuilt, reiterate=reiterate)

    def _decide(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        loop: Any,
        loader: Any,
        start: float,
        force: bool = False,
        replaces: TunerDecision | None = None,
    ) -> LoaderSettings | None:
        """Rank zero's decision, from the checkpoint, the cache or trials, on every rank, in `result` and `_state`.

        `replaces`: the reused decision this one is tuned to replace; the new one keeps its fingerprint (its facts
        were read from the user's loader, the live one now runs that decision's settings), so its cache entry is the
        one replaced."""
        strategy = trainer.strategy
        sync = loop_internals.rank_sync(strategy.root_device)
        batch_size = loader_batch_size(loader)
        local_error: Exception | None = None
        try:  # what each rank does by itself; a failure on one rank must stop all of them before a collective
            loop_internals.stop_workers(loop)  # the original loader's workers stop during the trials
            budget = max(1, read_cpu_budget().effective // max(1, trainer.num_devices))
            facts = {**loop_internals.facts(trainer, loader, batch_size, budget), "tuner": self._search_settings()}
            key = cache.fingerprint(facts)
            if replaces is not None:
                key, facts = replaces.fingerprint, {**replaces.facts}
            shm, memory = read_shm(), loop_internals.memory_free(trainer.num_devices)
            step, self.step_mode = loop_internals.make_step(trainer, pl_module)
        except Exception as err:
            local_error = err
        if sync([float(local_error is not None)])[0]:
            raise TrialError(
                f"reading this rank's facts failed: {local_error!r}"
                if local_error
                else "reading its facts failed on another rank"
            ) from local_error
        user = loader_settings(loader)
        # the most workers a search tries, or the loader's own (a kept decision)
        known, bound = None, max(budget, self.max_workers or 4 * budget, user.num_workers)
        if not (self.force or force) and self.use_cache:  # from a checkpoint, or the previous fit of this callback
            known = TunerDecision.from_dict(self._state, fingerprint=key, max_workers=bound)
            known = known if known is not None and known.confident else None  # never reuse one made under load
            if known is None and trainer.is_global_zero:
                known = self._cached(key, bound)
        known = strategy.broadcast(known, src=0)
        for caveat in loop_internals.caveats(loader, self.step_mode, trainer.strategy, trials=known is None):
            rank_zero_warn(f"DataLoaderTuner: {caveat}.", category=LightningAccelWarning)
        if known is not None:
            self.cache_hit, self.result, self._state = True, known, known.as_dict()
            return known.settings
        shm_free = None if shm is None else shm.free_bytes // trainer.num_devices
        searched = loop_internals.search_in_lockstep(
            trainer,
            pl_module,
            loader,
            step,
            batch_size=batch_size,
            budget=budget,
            shm_free=shm_free,
            memory_free=memory,
            warmup_steps=self.warmup_steps,
            steps_per_trial=self.steps_per_trial,
            deadline=start + self.max_tuning_time_s,
            max_workers=self.max_workers,
            tolerance=self.tolerance,
            prefetch_factors=self.prefetch_factors,
            tune_pin_memory=self.tune_pin_memory,
        )
        self.trials = searched.trials
        if searched.changed:
            names = ", ".join(f"`self.{name}`" for name in searched.changed)
            rank_zero_warn(
                f"DataLoaderTuner: the trial steps changed {names} in place (it holds more or fewer items than "
                "before them), which cannot be put back: the fit starts with those changes. Keep such state out of "
                "`training_step`, or remove the DataLoaderTuner.",
                category=LightningAccelWarning,
            )
        decision = strategy.broadcast(
            policy.decide(
                self.trials,
                self.tolerance,
                fingerprint=key,
                facts=facts,
                original=searched.original,
                budget=searched.budget,
                user=user,
            ),
            src=0,
        )
        if decision is None:
            rank_zero_warn(
                f"DataLoaderTuner timed no setting to the end within `max_tuning_time_s="
                f"{self.max_tuning_time_s}`; raise it. The DataLoaders are left alone.",
                category=LightningAccelWarning,
            )
            return None
        if not decision.confident:
            if trainer.is_global_zero:  # warnings on rank zero only: every rank holds the same decision
                log.warning(
                    "DataLoaderTuner: %s, so the decision is applied to this fit but not cached.", decision.note
                )
        elif self.use_cache and trainer.is_global_zero:
            try:
                cache.DecisionCache(self.cache_path).put(decision)
            except Exception as err:  # rank zero alone writes: nothing it raises may part it from the other ranks
                rank_zero_warn(
                    f"DataLoaderTuner could not write its cache {self.cache_path} ({err}); set "
                    "`cache_dir` to a writable folder.",
                    category=LightningAccelWarning,
                )
        self.result, self._state = decision, decision.as_dict()
        return decision.settings

    def _cached(self, key: str, max_workers: int) -> TunerDecision | None:
        """Rank zero's cache lookup; a cache it cannot read is a miss (other ranks wait for it in a broadcast)."""
        try:
            return cache.DecisionCache(self.cache_path).get(key, max_workers)
        except Exception as err:
            rank_zero_warn(
                f"DataLoaderTuner could not read its cache {self.cache_path} ({err}); tuning again.",
                category=LightningAccelWarning,
            )
            return None

    def _report(self, trainer: pl.Trainer, original: LoaderSettings) -> None:
        if trainer.is_global_zero:
            assert self.result is not None
            tuner_report.publish(
                self.result,
                original,
                self.trials,
                tuning_time_s=self.tuning_time_s,
                cache_hit=self.cache_hit,
                step_mode=self.step_mode,
                print_table=self.print_table,
                loggers=trainer.loggers,
                step=trainer.global_step,
                log=log,
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return dict(self._state)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state = dict(state_dict)
