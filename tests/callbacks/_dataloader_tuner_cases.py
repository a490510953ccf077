"""Synthetic datasets with a known best DataLoader setting, a tiny model, and an exhaustive sweep to compare with.

Run under torchrun (`python -m torch.distributed.run --nproc-per-node 2 _dataloader_tuner_cases.py OUT_DIR`) each
rank fits twice with a DataLoaderTuner sharing one cache and writes OUT_DIR/rank<k>.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from lightning_accel.callbacks.dataloader_tuner import DataLoaderTuner
from lightning_accel.errors import LightningAccelWarning
from lightning_accel.measure import Interval, interleaved, ratio, summarize
from lightning_accel.system.interference import Interference, InterferenceProbe
from lightning_accel.tuning.dataloader.loader_settings import LoaderSettings
from lightning_accel.tuning.dataloader.loop import make_step, untouched
from lightning_accel.tuning.dataloader.timing import frozen_rng, rebuild_loader, run_trial, trial_window

FEATURES = 8


class SleepyDataset(Dataset):
    """Waits `delay_s` per item, like a read from disk or network: workers overlap the waits, CPUs do not limit."""

    def __init__(self, length: int = 4000, delay_s: float = 0.003) -> None:
        self.length, self.delay_s = length, delay_s
        self.accesses = 0  # in the main process only: counts what the tuner's probe and 0-worker trials read

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.accesses += 1
        time.sleep(self.delay_s)
        return torch.full((FEATURES,), float(index % 7)), torch.tensor([float(index % 3)])


class TensorItems(Dataset):
    """Items made at once, with nothing to wait for (the loader's cost is then its `collate_fn`'s)."""

    def __init__(self, length: int = 400) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((FEATURES,), float(index % 7)), torch.tensor([float(index % 3)])


def spin(loops: int) -> int:
    """Pure-Python CPU work (~1 ms per 20,000 loops), holding the GIL."""
    acc = 0
    for i in range(loops):
        acc += i * i % 7
    return acc


class BusyDataset(SleepyDataset):
    """Spins the CPU in pure Python per item: more workers than CPUs cannot make it faster."""

    def __init__(self, length: int = 4000, loops: int = 20_000) -> None:
        super().__init__(length, 0.0)
        self.loops = loops

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.accesses += 1
        acc = spin(self.loops)
        return torch.full((FEATURES,), float((index + acc) % 7)), torch.tensor([float(index % 3)])


class SlowCollate:
    """Collates a batch after `delay_s` of waiting: a loader whose every batch costs the same, wherever it runs (a
    step that sleeps `step_sleep_s` beside it sets the loader's data-wait share exactly)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __call__(self, items: list[Any]) -> Any:
        time.sleep(self.delay_s)
        return default_collate(items)


class QuietProbe(InterferenceProbe):
    """Reports every window as quiet: tests about the search itself must not depend on what else the shared
    machine runs (the tests of interference use the real probe or a scripted one)."""

    def stop(self) -> Interference:
        self.result = Interference(
            wall_s=1.0, cpus=2, other_cpu_s=0.0, own_cpu_s=1.0, steal_s=0.0, load_start=None, load_end=None
        )
        return self.result


class Regression(pl.LightningModule):
    """A linear model behind BatchNorm; `step_loops` of pure-Python work per step stand for a heavy step on the CPU
    the workers share (a CPU-only machine)."""

    def __init__(self, step_loops: int = 0, step_sleep_s: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.step_loops, self.step_sleep_s = step_loops, step_sleep_s
        self.layer = nn.Linear(FEATURES, 1)
        self.norm = nn.BatchNorm1d(FEATURES)  # trial steps update its running statistics: they must be put back
        self.steps_seen = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        spin(self.step_loops)
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)  # a step of known length that needs no CPU (a GPU's, say)
        loss = nn.functional.mse_loss(self.layer(self.norm(x)), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", nn.functional.mse_loss(self.layer(self.norm(x)), y))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.steps_seen += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Referee(pl.Callback):
    """After the tuner (at `on_train_start`), time every setting of `space` and the tuner's choice on the tuner's
    step: the exhaustive sweep, the ground truth the choice is judged against.

    Each timing is longer than a trial: its warm-up covers every batch in flight (`num_workers x prefetch_factor`),
    and it times `steps` steps, at least four times those: the batches that workers which started early loaded ahead
    while the last ones started (a backlog of up to all batches in flight, large beside a trial's 16 steps when
    workers start slowly on a loaded machine) then hardly count in the rate.

    The sweep runs `rounds` interleaved rounds (every setting once per round, in the same order: A B C, A B C, ...),
    so a burst of another job's load falls on every setting alike rather than on all timings of one; each setting's
    rate is the median of its rounds, with their range as its spread (`lightning_accel.measure.summarize`). The best
    is the highest median, and the choice's share of it is the ratio of the two medians: never above 1, as the choice
    is one of the settings compared. Its interval is that of the ratio of the rounds' paired timings (`ratio`).
    Fills `rates` (every round's samples/s per setting), `sweep` (each setting's median and spread) and `best`.
    """

    def __init__(
        self, tuner: DataLoaderTuner, space: Sequence[LoaderSettings], rounds: int = 3, steps: int = 64
    ) -> None:
        self.tuner, self.space, self.rounds, self.steps = tuner, list(space), rounds, steps
        self.rates: dict[LoaderSettings, list[float]] = {}
        self.sweep: dict[LoaderSettings, Interval] = {}
        self.best: LoaderSettings | None = None
        self.chosen: LoaderSettings | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = trainer.train_dataloader
        step, _ = make_step(trainer, pl_module)
        assert self.tuner.decision is not None
        self.chosen = dataclasses.replace(self.tuner.decision, persistent_workers=False)  # as the space's settings are

        def rate(settings: LoaderSettings) -> float:
            in_flight = settings.num_workers * (settings.prefetch_factor or 0)
            warmup, window = trial_window(
                settings.num_workers, max(2, in_flight), max(self.steps, 4 * in_flight), len(loader)
            )
            return run_trial(
                lambda s: rebuild_loader(loader, s),
                step,
                settings,
                warmup=warmup,
                steps=window,
                samples_per_batch=loader.batch_size,
            ).samples_per_s

        settings = list(dict.fromkeys([*self.space, self.chosen]))
        self.rates = {s: [] for s in settings}
        with frozen_rng([loader]), untouched(pl_module):
            for _, each in interleaved(settings, self.rounds):
                self.rates[each].append(rate(each))
        self.sweep = {s: summarize(r) for s, r in self.rates.items()}
        self.best = max(self.sweep, key=lambda s: self.sweep[s].median)

    @property
    def share_of_best(self) -> float:
        """The choice's median throughput over the best median of the sweep (0..1); 1 when the choice is the best."""
        assert self.chosen is not None and self.best is not None, "the sweep has not run"
        return self.sweep[self.chosen].median / self.sweep[self.best].median

    @property
    def share_interval(self) -> Interval:
        """The choice's throughput over the best's, round by round (paired): the spread of `share_of_best`."""
        assert self.chosen is not None and self.best is not None, "the sweep has not run"
        return ratio(self.rates[self.chosen], self.rates[self.best])

    def summary(self) -> str:
        sweep = ", ".join(
            f"{s.num_workers}w{'' if s.prefetch_factor in (None, 2) else f'/p{s.prefetch_factor}'} {v.format('.0f')}"
            for s, v in self.sweep.items()
        )
        share = self.share_interval
        return (
            f"chose {self.tuner.decision} in {self.tuner.tuning_time_s:.1f} s: {100 * self.share_of_best:.0f}% of "
            f"the best ({self.best and self.best.num_workers}w; paired rounds {100 * share.low:.0f}-"
            f"{100 * share.high:.0f}%); sweep, samples/s median [min, max] of {self.rounds} interleaved rounds: "
            f"{sweep}"
        )


def trainer(callbacks: list[pl.Callback], root: str, max_steps: int = 20, **kwargs: Any) -> pl.Trainer:
    settings = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        **kwargs,
    }
    return pl.Trainer(accelerator="cpu", max_steps=max_steps, callbacks=callbacks, default_root_dir=root, **settings)


def fit(
    dataset: Dataset,
    callbacks: list[pl.Callback],
    root: str,
    batch_size: int = 8,
    val: Dataset | None = None,
    step_loops: int = 0,
    model: Regression | None = None,
    ckpt_path: str | None = None,
    loader: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[pl.Trainer, Regression]:
    """Fit `model` (a new `Regression`) on shuffled batches of `dataset` (and validate on `val`); warnings other than
    ours muted. `loader`: more arguments of the train DataLoader (`num_workers`, `collate_fn`, `generator`)."""
    model = Regression(step_loops) if model is None else model
    fitter = trainer(callbacks, root, **kwargs)
    val_loader = None if val is None else DataLoader(val, batch_size=batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", LightningAccelWarning)
        shuffle = not isinstance(dataset, IterableDataset)
        train = DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, **(loader or {}))
        fitter.fit(model, train, val_loader, ckpt_path=ckpt_path)
    return fitter, model


def _ddp_main(out: Path) -> None:
    import lightning_accel.tuning.dataloader.trial_runner as runner_module

    runner_module.InterferenceProbe = QuietProbe  # type: ignore[misc]  # the second fit must find the decision cached
    rank = int(os.environ["RANK"])
    results = []
    for _ in range(2):  # the second fit finds rank zero's cached decision
        tuner = DataLoaderTuner(max_tuning_time_s=20, steps_per_trial=8, cache_dir=str(out / "cache"))
        fitter = trainer([tuner], str(out / "run"), max_steps=5, strategy="ddp", devices=2)
        model = Regression()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fitter.fit(model, DataLoader(SleepyDataset(400), batch_size=8))
        results.append(
            {
                "decision": None if tuner.decision is None else tuner.decision.as_dict(),
                "trials": [t.as_dict() for t in tuner.trials],
                "cache_hit": tuner.cache_hit,
                "loader_workers": fitter.train_dataloader.num_workers,
                "world_size": fitter.world_size,
                "weight": model.layer.weight.detach().flatten().tolist(),
                "global_step": fitter.global_step,
            }
        )
    (out / f"rank{rank}.json").write_text(json.dumps(results))


def _ddp_retune(out: Path) -> None:
    """A decision planted in the cache (2 workers) fails its check on both ranks (the verdict forced, as a loaded
    machine can make it fail): the ranks tune again together at the next epoch start and train on in lockstep."""
    import lightning_accel.callbacks.dataloader_tuner as tuner_module
    import lightning_accel.tuning.dataloader.trial_runner as runner_module

    runner_module.InterferenceProbe = QuietProbe  # type: ignore[misc]  # the first decision must be cached
    rank, data, results = int(os.environ["RANK"]), SleepyDataset(400, delay_s=0.0), []
    for fit_index in range(2):
        if fit_index == 1:
            if rank == 0:  # rank zero looks the decision up: plant 2 workers, recorded as hardly waiting
                path = out / "cache" / "dataloader_tuner.json"
                stored = json.loads(path.read_text())
                for entry in stored["entries"].values():
                    entry["settings"] = {
                        "num_workers": 2,
                        "prefetch_factor": 2,
                        "pin_memory": False,
                        "persistent_workers": True,
                    }
                    entry["wait_share"] = 0.0
                path.write_text(json.dumps(stored))
            verdict = tuner_module.verification.verdict
            # the seam: every rank's window fails once it is complete
            tuner_module.verification.verdict = lambda live, *a, **k: (live.complete, live.complete)
        tuner = DataLoaderTuner(max_tuning_time_s=20, steps_per_trial=4, verify_steps=5, cache_dir=str(out / "cache"))
        fitter = trainer([tuner], str(out / "run"), max_steps=60 if fit_index else 2, strategy="ddp", devices=2)
        model = Regression()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fitter.fit(model, DataLoader(data, batch_size=8, shuffle=True))
        if fit_index == 1:
            tuner_module.verification.verdict = verdict
        results.append(
            {
                "decision": None if tuner.decision is None else tuner.decision.as_dict(),
                "cache_hit": tuner.cache_hit,
                "retuned": tuner.retuned,
                "loader_workers": fitter.train_dataloader.num_workers,
                "global_step": fitter.global_step,
                "weight": model.layer.weight.detach().flatten().tolist(),
            }
        )
    (out / f"rank{rank}.json").write_text(json.dumps(results))


def _ddp_diverge(out: Path) -> None:
    """Rank 1 alone fails where no collective reports it (its choice raises): it must stop the run, not hang it."""
    import lightning_accel.tuning.dataloader.policy as policy

    rank, choose = int(os.environ["RANK"]), policy.choose

    def choose_or_fail(*args: Any, **kwargs: Any) -> Any:
        if rank == 1:
            raise KeyError("injected on rank 1")
        return choose(*args, **kwargs)

    policy.choose = choose_or_fail
    tuner = DataLoaderTuner(max_tuning_time_s=20, steps_per_trial=4, use_cache=False)
    fitter = trainer([tuner], str(out / "run"), max_steps=2, strategy="ddp", devices=2)
    fitter.fit(Regression(), DataLoader(SleepyDataset(200), batch_size=8))


if __name__ == "__main__":
    if sys.argv[2:] == ["diverge"]:
        _ddp_diverge(Path(sys.argv[1]))
    elif sys.argv[2:] == ["retune"]:
        _ddp_retune(Path(sys.argv[1]))
    else:
        _ddp_main(Path(sys.argv[1]))
    if torch.distributed.is_initialized():  # an orderly end: a group torn down at interpreter exit can abort a rank
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
