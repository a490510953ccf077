"""`TrialRunner`: the `measure` the search calls, one trial of a setting on the train loader under an interference
probe, flagged on every rank when any rank saw interference; no Trainer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch.utils.data import DataLoader

from lightning_accel.system.interference import InterferenceProbe
from lightning_accel.tuning.dataloader.loader_settings import LoaderSettings
from lightning_accel.tuning.dataloader.timing import Sync, Trial, rebuild_loader, run_trial, trial_window

__all__ = ["TRIAL_STALL_S", "TrialRunner"]

TRIAL_STALL_S = 120.0
"""The longest a trial waits for one batch from its workers (when the loader sets no `timeout`): a stalled worker
fails the trial on its rank, and the others learn it at their next collective, instead of waiting forever."""


@dataclass(kw_only=True, slots=True)
class TrialRunner:
    """Times one setting (`runner(settings, cut_s_per_step)`, the `measure` of `policy.search`): the loader rebuilt
    with it (never persistent: each trial starts its own workers), `warmup_steps` untimed and `steps_per_trial` timed
    steps as `timing.trial_window` sizes them, the trial cut when slower than `cut_s_per_step` and stopped at
    `deadline`. Every rank calls it with the same arguments (`sync` keeps them in lockstep)."""

    loader: DataLoader
    step: Callable[[Any, int], None]
    """One training step on a batch (`loop.make_step`)."""
    samples_per_batch: int
    batches: int
    """The fewest batches a rank's loader holds: every rank's trial fits it."""
    warmup_steps: int
    steps_per_trial: int
    deadline: float
    """A `time.perf_counter()` value: the trial stops at its next check after it."""
    sync: Sync = list
    pids: Sequence[int] = ()
    """The other ranks on this host: their processes (and DataLoader workers) are ours, not interference."""

    def __call__(self, settings: LoaderSettings, cut_s_per_step: float | None) -> Trial:
        warmup, steps = trial_window(settings.num_workers, self.warmup_steps, self.steps_per_trial, self.batches)
        probe = InterferenceProbe(pids=lambda: self.pids)
        with probe:
            trial = run_trial(
                lambda s: rebuild_loader(
                    self.loader, replace(s, persistent_workers=False), stall_timeout_s=TRIAL_STALL_S
                ),
                self.step,
                settings,
                warmup=warmup,
                steps=steps,
                samples_per_batch=self.samples_per_batch,
                cut_s_per_step=cut_s_per_step,
                deadline=self.deadline,
                sync=self.sync,
            )
        seen = probe.result
        if self.sync([float(seen is not None and seen.flagged)])[0]:  # any rank's flag, on every rank
            trial.flag = seen.describe() if seen is not None and seen.flagged else "interference on another rank"
        return trial
