"""The DataLoaderTuner's parts, one concern per module.

- `policy`: which settings to try, in what order, and which to keep (pure functions over `Trial`s).
- `loader_settings`: the settings (`LoaderSettings`) and the one list of their names (`LOADER_KEYS`).
- `timing`: one timed trial (`run_trial`), rebuilding a DataLoader, frozen RNGs.
- `trial_runner`: `TrialRunner`, the search's `measure`: one trial under an interference probe, flagged on all ranks.
- `verification`: checking a reused decision on the live loop (`LiveWait`, `verdict`).
- `decision`: `TunerDecision`, the one typed decision: cache entry, checkpoint state and result, validated when read.
- `cache`: the decision cache file and the fingerprint it is keyed by.
- `tuner_report`: the table of trials and the logged metrics.
- `loop`: the only module that touches Lightning's loop internals (trial steps, loader swaps, the search in rank
  lockstep).

`lightning_accel.callbacks.DataLoaderTuner` is the hook that runs them in a Trainer.
"""

__all__: list[str] = []  # import from the module that owns each part
