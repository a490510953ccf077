"""DataLoaderTuner: the choice against an exhaustive sweep, bounded tuning time, the cache, failures, DDP agreement."""

from __future__ import annotations

import json
import logging
import pickle
import random
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _dataloader_tuner_cases as cases
import pytest
import torch
from _torchrun import torchrun
from lightning.pytorch.loggers import Logger
from torch.utils.data import IterableDataset

import lightning_accel.callbacks.dataloader_tuner as tuner_module
import lightning_accel.tuning.dataloader.loop as loop_module
import lightning_accel.tuning.dataloader.trial_runner as runner_module
from lightning_accel.callbacks.dataloader_tuner import DataLoaderTuner
from lightning_accel.errors import LightningAccelWarning
from lightning_accel.system import ShmInfo
from lightning_accel.system.interference import Interference
from lightning_accel.tuning.dataloader.cache import SCHEMA as CACHE_SCHEMA
from lightning_accel.tuning.dataloader.cache import DecisionCache
from lightning_accel.tuning.dataloader.loader_settings import LoaderSettings
from lightning_accel.tuning.dataloader.policy import BUDGET_NOTE, memory_note
from lightning_accel.tuning.dataloader.timing import Trial, TrialError, rebuild_loader, run_trial

CPUS = 2  # every test sees a 2-CPU budget (PYTHON_CPU_COUNT), whatever the machine


@pytest.fixture(autouse=True)
def _two_cpus_one_thread(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """A 2-CPU budget; one intra-op thread (on a loaded machine a second one waits for a busy core and a tiny step
    takes 40 ms instead of 0.5); a private default cache."""
    monkeypatch.setenv("PYTHON_CPU_COUNT", str(CPUS))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _quiet_machine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests about the search itself see a quiet machine, whatever else runs on it; a test that asks for the
    `real_probe` fixture measures the real interference."""
    if "real_probe" not in request.fixturenames:
        monkeypatch.setattr(runner_module, "InterferenceProbe", cases.QuietProbe)


@pytest.fixture
def real_probe() -> None:
    """Requested by tests that measure the machine's real interference (see `_quiet_machine`)."""


def _tuner(**kwargs: Any) -> DataLoaderTuner:
    return DataLoaderTuner(**{"max_tuning_time_s": 20.0, "print_table": False, **kwargs})


def _tune(dataset: Any, tmp_path: Path, **kwargs: Any) -> DataLoaderTuner:
    """Fit with the tuner, and check that both loaders train with its decision. (The choice against an exhaustive
    sweep's best, `cases.Referee`, is tests/benchmarks/bench_dataloader_tuner.py's: a figure, on a quiet machine.)"""
    tuner = _tuner(use_cache=False)
    fitter, _ = cases.fit(dataset, [tuner], str(tmp_path), val=cases.SleepyDataset(16, 0.0), max_steps=5, **kwargs)
    assert tuner.decision is not None and fitter.global_step == 5
    assert fitter.train_dataloader.num_workers == fitter.val_dataloaders.num_workers == tuner.decision.num_workers
    persistent = fitter.val_dataloaders.persistent_workers
    assert tuner.decision.persistent_workers == (tuner.decision.num_workers > 0) == persistent
    return tuner


@pytest.mark.slow
def test_io_bound_dataset_gets_more_workers_than_cpus(tmp_path: Path) -> None:
    tuner = _tune(cases.SleepyDataset(delay_s=0.006), tmp_path)  # 48 ms a batch per worker
    assert tuner.decision is not None and tuner.decision.num_workers > CPUS, tuner.trials
    assert max(t.settings.num_workers for t in tuner.trials) <= 4 * CPUS  # max_workers: 4 x the CPUs by default


@pytest.mark.slow  # ~15 s; the I/O-bound cases cover the default suite
def test_cpu_bound_dataset_gets_what_the_cpus_give(tmp_path: Path) -> None:
    # ~20 ms of Python per batch and ~8 ms per step, all on the same 2 CPUs (training on the CPU): 0, 2 and 8 workers
    # lie within ~20% of each other, so the choice's share of the best is a figure, the benchmark's
    # (`bench_dataloader_tuner.py --cases io-busy --dataset cpu --busy 0`); here: none assumed, both timed
    tuner = _tune(cases.BusyDataset(), tmp_path, batch_size=16, step_loops=150_000)
    assert {t.settings.num_workers for t in tuner.trials} >= {0, CPUS}, tuner.trials
    assert tuner.decision is not None and tuner.decision.num_workers <= 4 * CPUS


def _out_of_time(tmp_path: Path) -> DataLoaderTuner:
    """A search that cannot finish in its 0.5 s (10 ms per sample): it warns, and the fit trains on without it."""
    tuner = _tuner(max_tuning_time_s=0.5, use_cache=False)
    with pytest.warns(LightningAccelWarning, match="max_tuning_time_s=0.5"):
        fitter, _ = cases.fit(cases.SleepyDataset(delay_s=0.01), [tuner], str(tmp_path), max_steps=2)
    assert tuner.trials[-1].status == "time" and tuner.decision is None
    assert fitter.global_step == 2 and fitter.train_dataloader.num_workers == 0
    return tuner


def test_a_search_out_of_time_stops_and_the_fit_trains_on_without_a_decision(tmp_path: Path) -> None:
    _out_of_time(tmp_path)


@pytest.mark.slow  # a wall-clock bound: a loaded machine may stretch the last trial's shutdown
def test_tuning_time_is_bounded(tmp_path: Path) -> None:
    tuner = _out_of_time(tmp_path)
    assert tuner.tuning_time_s <= 0.5 + 1.0, tuner.trials  # over by at most one check of a trial and a shutdown


def _count_trials(monkeypatch: pytest.MonkeyPatch) -> list[LoaderSettings]:
    ran: list[LoaderSettings] = []
    real = runner_module.run_trial

    def counted(make_loader: Any, step: Any, settings: LoaderSettings, **kwargs: Any) -> Trial:
        ran.append(settings)
        return real(make_loader, step, settings, **kwargs)

    monkeypatch.setattr(runner_module, "run_trial", counted)
    return ran


@pytest.mark.slow
def test_cache_hit_skips_tuning_and_force_tunes_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran = _count_trials(monkeypatch)
    data = cases.SleepyDataset(400, 0.002)
    first = _tuner(steps_per_trial=4, cache_dir=tmp_path / "cache")
    cases.fit(data, [first], str(tmp_path), max_steps=2)
    assert ran and not first.cache_hit and first.decision is not None
    cached = json.loads((tmp_path / "cache" / "dataloader_tuner.json").read_text())["entries"]
    assert [entry["settings"] for entry in cached.values()] == [first.decision.as_dict()]
    ran.clear()
    second = _tuner(steps_per_trial=4, cache_dir=tmp_path / "cache")
    fitter, _ = cases.fit(data, [second], str(tmp_path), max_steps=2)
    assert ran == [] and second.trials == [] and second.cache_hit and second.decision == first.decision
    assert fitter.train_dataloader.num_workers == first.decision.num_workers
    resumed = _tuner(steps_per_trial=4, cache_dir=tmp_path / "empty")  # a checkpoint's state holds the decision
    resumed.load_state_dict(pickle.loads(pickle.dumps(first.state_dict())))
    cases.fit(data, [resumed], str(tmp_path), max_steps=2)
    assert ran == [] and resumed.cache_hit and resumed.decision == first.decision
    forced = _tuner(steps_per_trial=4, cache_dir=tmp_path / "cache", force=True)
    cases.fit(data, [forced], str(tmp_path), max_steps=2)
    assert ran and forced.trials and not forced.cache_hit


@pytest.mark.slow
@pytest.mark.parametrize(
    "text",
    ['{"entries": ["a list"]}', "[1, 2]", "not json", '{"entries": {"KEY": {"settings": {"num_threads": 3}}}}'],
)
def test_a_file_of_another_shape_is_a_miss_and_left_as_it_was(tmp_path: Path, text: str) -> None:
    """Rank zero alone reads the cache while the other ranks wait for it: no file it finds may raise there. A file
    that is not a decision cache (no `schema` of ours) is someone else's: it was replaced by the first decision, and
    is now left as it was, with a warning naming it."""
    cache = tmp_path / "cache" / "dataloader_tuner.json"
    cache.parent.mkdir()
    cache.write_text(text)
    with pytest.warns(LightningAccelWarning, match="decision cache is not used: .*dataloader_tuner.json"):
        assert DecisionCache(cache).get("KEY", max_workers=8) is None
        tuner = _tuner(steps_per_trial=4, cache_dir=cache.parent)
        cases.fit(cases.SleepyDataset(200, 0.001), [tuner], str(tmp_path), max_steps=2)
    assert tuner.trials and not tuner.cache_hit and tuner.decision is not None
    assert cache.read_text() == text


def test_a_cache_of_ours_with_entries_of_another_shape_is_a_miss_and_rewritten(tmp_path: Path) -> None:
    cache = tmp_path / "cache" / "dataloader_tuner.json"
    cache.parent.mkdir()
    cache.write_text(json.dumps({"schema": CACHE_SCHEMA, "entries": ["a list"]}))
    assert DecisionCache(cache).get("KEY", max_workers=8) is None
    tuner = _tuner(steps_per_trial=4, cache_dir=cache.parent)
    cases.fit(cases.SleepyDataset(200, 0.001), [tuner], str(tmp_path), max_steps=2)
    assert tuner.trials and not tuner.cache_hit and tuner.decision is not None
    (entry,) = json.loads(cache.read_text())["entries"].values()  # rewritten, with the new decision
    assert entry["settings"] == tuner.decision.as_dict()


@pytest.mark.slow
def test_an_unreadable_cache_warns_and_tunes(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    (folder / "dataloader_tuner.json").mkdir(parents=True)  # a folder where the file should be
    tuner = _tuner(steps_per_trial=4, cache_dir=folder)
    with pytest.warns(LightningAccelWarning, match="could not write its cache"):
        cases.fit(cases.SleepyDataset(200, 0.001), [tuner], str(tmp_path), max_steps=2)
    assert tuner.trials and tuner.decision is not None


@pytest.mark.slow
def test_a_tuned_fit_trains_exactly_like_an_untuned_one(tmp_path: Path) -> None:
    data = cases.SleepyDataset(200, 0.0005)  # shuffled: the trials must not move the RNG, the weights or BatchNorm
    _, plain = cases.fit(data, [], str(tmp_path), max_steps=12, val=cases.SleepyDataset(16, 0.0))
    tuner = _tuner(steps_per_trial=4, use_cache=False)
    _, tuned = cases.fit(data, [tuner], str(tmp_path), max_steps=12, val=cases.SleepyDataset(16, 0.0))
    assert tuner.decision is not None and tuner.trials
    for (name, a), (_, b) in zip(plain.state_dict().items(), tuned.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


class _MomentumEncoder(cases.Regression):
    """Updates a parameter that does not train inside `training_step` (a momentum encoder, an EMA)."""

    def __init__(self) -> None:
        super().__init__()
        self.ema = torch.nn.Parameter(torch.zeros(cases.FEATURES), requires_grad=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * batch[0].mean(0))
        return super().training_step(batch, batch_idx)


def test_trials_put_back_parameters_the_step_updates_itself(tmp_path: Path) -> None:
    data = cases.SleepyDataset(200, 0.0005)
    _, plain = cases.fit(data, [], str(tmp_path), max_steps=6, model=_MomentumEncoder())
    tuner = _tuner(steps_per_trial=4, use_cache=False)
    _, tuned = cases.fit(data, [tuner], str(tmp_path), max_steps=6, model=_MomentumEncoder())
    assert tuner.trials and torch.count_nonzero(plain.ema) > 0
    assert torch.equal(plain.ema, tuned.ema) and torch.equal(plain.layer.weight, tuned.layer.weight)


@pytest.mark.slow
def test_a_cached_decision_is_not_reused_by_a_search_with_other_bounds(tmp_path: Path) -> None:
    data = cases.SleepyDataset(400, 0.002)
    first = _tuner(steps_per_trial=4, cache_dir=tmp_path / "cache")
    cases.fit(data, [first], str(tmp_path), max_steps=2)
    capped = _tuner(steps_per_trial=4, cache_dir=tmp_path / "cache", max_workers=1)
    cases.fit(data, [capped], str(tmp_path), max_steps=2)
    assert not capped.cache_hit and capped.trials and capped.decision is not None
    assert max(t.settings.num_workers for t in capped.trials) <= 2  # the budget (2 CPUs), nothing above max_workers
    again = _tuner(steps_per_trial=4, cache_dir=tmp_path / "cache", max_workers=1)
    cases.fit(data, [again], str(tmp_path), max_steps=2)
    assert again.cache_hit and again.decision == capped.decision


class _LoaderSeen(cases.pl.Callback):
    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        self.workers = trainer.train_dataloader.num_workers


def test_a_resumed_fit_that_reloads_its_loaders_trains_with_the_decision(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    data, cache = cases.SleepyDataset(96, 0.004), tmp_path / "cache"  # 12 batches an epoch
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=16, save_top_k=-1)
    first = _tuner(steps_per_trial=4, cache_dir=cache)
    cases.fit(
        data,
        [first, saver],
        str(tmp_path),
        max_steps=16,
        enable_checkpointing=True,
        reload_dataloaders_every_n_epochs=1,
    )
    assert first.decision is not None and first.decision.num_workers > 0  # the loader's own: 0 workers
    (checkpoint,) = (tmp_path / "ckpt").glob("*.ckpt")  # in the middle of the second epoch
    seen, resumed = _LoaderSeen(), _tuner(steps_per_trial=4, cache_dir=cache)
    fitter, _ = cases.fit(
        data,
        [resumed, seen],
        str(tmp_path),
        max_steps=20,
        reload_dataloaders_every_n_epochs=1,
        ckpt_path=str(checkpoint),
    )
    assert fitter.global_step == 20 and resumed.decision == first.decision
    assert seen.workers == first.decision.num_workers


def test_a_failure_while_tuning_restores_the_loaders_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = loop_module.make_step

    def failing(trainer: Any, pl_module: Any) -> tuple[Callable[[Any, int], None], str]:
        step, mode = real(trainer, pl_module)
        calls = []

        def step_then_fail(batch: Any, batch_idx: int) -> None:
            calls.append(batch_idx)
            if len(calls) == 5:
                raise RuntimeError("injected")
            step(batch, batch_idx)

        return step_then_fail, mode

    class Loaders(cases.pl.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            self.train, self.val = trainer.train_dataloader, trainer.val_dataloaders

    monkeypatch.setattr(loop_module, "make_step", failing)
    seen, tuner = Loaders(), _tuner(use_cache=False)
    data, val = cases.SleepyDataset(200, 0.0005), cases.SleepyDataset(16, 0.0)
    with pytest.warns(LightningAccelWarning, match="injected"):
        fitter, tuned = cases.fit(data, [tuner, seen], str(tmp_path), max_steps=12, val=val)
    assert tuner.decision is None and fitter.global_step == 12
    assert seen.train.num_workers == 0 and not hasattr(seen.train, "_lightning_accel_tuned")
    assert seen.val.num_workers == 0 and not hasattr(seen.val, "_lightning_accel_tuned")
    _, plain = cases.fit(data, [], str(tmp_path), max_steps=12, val=val)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), tuned.state_dict().values(), strict=True))


def test_memory_guard_skips_what_does_not_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    batch_bytes = 8 * cases.FEATURES * 4 + 8 * 4  # x and y of one batch of 8, float32
    shm = ShmInfo(path="/dev/shm", size_bytes=2**30, free_bytes=3 * batch_bytes)
    monkeypatch.setattr(tuner_module, "read_shm", lambda: shm)
    tuner = _tuner(steps_per_trial=4, use_cache=False)
    cases.fit(cases.SleepyDataset(400, 0.002), [tuner], str(tmp_path), max_steps=2)
    skipped = {t.settings: t.note for t in tuner.trials if t.status == "skipped"}
    assert LoaderSettings(num_workers=CPUS, prefetch_factor=2, persistent_workers=True) in skipped, tuner.trials
    assert all(s.num_workers * (s.prefetch_factor or 0) > 3 and "/dev/shm" in note for s, note in skipped.items())
    assert tuner.decision is not None and tuner.decision.num_workers * (tuner.decision.prefetch_factor or 0) <= 3
    four = LoaderSettings(num_workers=4, prefetch_factor=4)
    assert memory_note(four, 2**20, 15 * 2**20, None).endswith("/dev/shm free")
    assert memory_note(four, 2**20, 16 * 2**20, 16 * 2**20, worker_bytes=0) == ""
    # the memory under the cgroup's limit also holds each worker's own footprint, not only the batches in flight
    over = memory_note(four, 2**20, 16 * 2**20, 100 * 2**20, worker_bytes=32 * 2**20)
    assert over == "144 MiB for 4 worker(s) (batches in flight and each worker's own 32 MiB) > 100 MiB memory free"
    assert memory_note(four, 2**20, 16 * 2**20, 144 * 2**20, worker_bytes=32 * 2**20) == ""


def test_trials_share_the_cpu_budget_with_the_thread_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under accel-train's thread plan each trial runs with the intra-op threads the plan gives that many workers;
    without it (no `ACCEL_THREADS_SET`), the trials leave torch's count alone."""
    from lightning_accel.system.threads import PLANNED_ENV, read_thread_plan
    from lightning_accel.tuning.dataloader.loop import share_threads

    seen: list[tuple[int, int]] = []

    def measure(settings: LoaderSettings, cut: float | None) -> Any:
        seen.append((settings.num_workers, torch.get_num_threads()))

    monkeypatch.delenv(PLANNED_ENV, raising=False)
    assert share_threads(measure, ranks=1) is measure
    monkeypatch.setenv(PLANNED_ENV, "OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    timed = share_threads(measure, ranks=1)
    for workers in (0, 1, 3):
        timed(LoaderSettings(num_workers=workers), None)
    assert seen == [(w, read_thread_plan(num_workers=w, env={}).intra_op) for w in (0, 1, 3)]
    assert torch.get_num_threads() == before


class _ThreadsSeen(cases.pl.Callback):
    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        self.threads = torch.get_num_threads()


def test_the_thread_plans_share_ends_with_the_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The intra-op threads the plan gives the chosen workers hold while the fit trains; torch's count is put back
    at teardown, so what runs after the fit (a test, an evaluation in the same process) has the threads it had."""
    monkeypatch.setattr(tuner_module, "planned_intra_op", lambda workers, ranks: 1)
    torch.set_num_threads(2)
    seen, tuner = _ThreadsSeen(), _tuner(steps_per_trial=4, use_cache=False)
    cases.fit(cases.SleepyDataset(64, 0.0005), [tuner, seen], str(tmp_path), max_steps=4)
    assert tuner.decision is not None
    assert seen.threads == 1 and torch.get_num_threads() == 2


class _Metrics(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.logged: dict[str, float] = {}

    name, version = "metrics", 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.update(metrics)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


@pytest.mark.slow
def test_table_is_printed_and_settings_are_logged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logger = _Metrics()
    tuner = _tuner(steps_per_trial=4, use_cache=False, print_table=True)
    cases.fit(cases.SleepyDataset(400, 0.002), [tuner], str(tmp_path), max_steps=2, logger=logger)
    assert "DataLoaderTuner" in capsys.readouterr().out
    assert tuner.decision is not None and logger.logged["dataloader_tuner/num_workers"] == tuner.decision.num_workers
    keys = (
        "num_workers",
        "prefetch_factor",
        "pin_memory",
        "persistent_workers",
        "samples_per_s",
        "data_wait_share",
        "speedup",
        "speedup_bound",
        "kept",
        "tuning_time_s",
        "trials",
        "cache_hit",
    )
    assert {k for k in logger.logged if k.startswith("dataloader_tuner/")} == {f"dataloader_tuner/{k}" for k in keys}
    assert logger.logged["dataloader_tuner/speedup"] > 1.0  # over the loader's own num_workers=0
    assert logger.logged["dataloader_tuner/speedup"] <= logger.logged["dataloader_tuner/speedup_bound"]
    assert logger.logged["dataloader_tuner/kept"] == 0.0


class _Stream(IterableDataset):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter([(torch.zeros(cases.FEATURES), torch.zeros(1))] * 32)


def test_an_iterable_dataset_is_left_alone(tmp_path: Path) -> None:
    with pytest.warns(LightningAccelWarning, match="IterableDataset"):
        fitter, _ = cases.fit(_Stream(), [_tuner()], str(tmp_path), max_steps=2)
    assert fitter.global_step == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tuning_time_s": 0}, "max_tuning_time_s=0"),
        ({"steps_per_trial": 0}, "steps_per_trial=0"),
        ({"max_workers": 0}, "max_workers=0"),
        ({"tolerance": 1.0}, "tolerance=1.0"),
        ({"prefetch_factors": []}, "prefetch_factors"),
        ({"prefetch_factors": [0]}, "prefetch_factors"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DataLoaderTuner(**kwargs)


def _torchrun_cases(*args: str) -> subprocess.CompletedProcess[str]:
    """`_dataloader_tuner_cases.py ARGS` on 2 CPU processes under torchrun."""
    return torchrun(cases.__file__, *args, env={"OMP_NUM_THREADS": "1"}, timeout=300)


@pytest.mark.slow
def test_two_ddp_processes_agree(tmp_path: Path) -> None:
    proc = _torchrun_cases(str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    tuned, cached = rank0
    assert tuned["world_size"] == 2 and tuned["decision"] is not None and not tuned["cache_hit"]
    assert rank1[0]["decision"] == tuned["decision"] and rank1[0]["trials"] == tuned["trials"]  # lockstep, one choice
    assert {t["num_workers"] for t in tuned["trials"]} >= {0, 1}  # the budget: 2 CPUs // 2 ranks = 1 worker per rank
    assert max(t["num_workers"] for t in tuned["trials"]) <= 4  # max_workers: 4 x 1
    for first, second in (rank0, rank1):
        assert first["loader_workers"] == tuned["decision"]["num_workers"] == second["loader_workers"]
        assert second["cache_hit"] and second["trials"] == [] and second["decision"] == tuned["decision"]
        assert first["global_step"] == second["global_step"] == 5
    assert rank0[0]["weight"] == rank1[0]["weight"] and rank0[1]["weight"] == rank1[1]["weight"]
    assert cached["decision"] == tuned["decision"]


@pytest.mark.slow
def test_two_ddp_ranks_tune_again_together_when_a_reused_decision_fails_its_check(tmp_path: Path) -> None:
    """A cached decision of 2 workers fails its check on the live loop (forced): both ranks tune again at the next
    epoch start, switch to the same new setting and train to the last step in lockstep (a hang here once ended the
    DDP preset's cached run, 2 -> 0 workers; a hang would hit the 300 s timeout with every rank's stacks)."""
    proc = _torchrun_cases(str(tmp_path), "retune")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    for first, second in (rank0, rank1):
        assert not first["cache_hit"] and first["global_step"] == 2
        assert second["retuned"] and second["global_step"] == 60  # tuned again after the hit, trained to the end
        assert second["decision"] == rank0[1]["decision"] and second["decision"]["num_workers"] != 2
        assert second["loader_workers"] == second["decision"]["num_workers"]  # trains with the new decision
    assert rank0[1]["weight"] == rank1[1]["weight"]  # DDP kept the ranks' models equal to the end
    stored = json.loads((tmp_path / "cache" / "dataloader_tuner.json").read_text())
    (entry,) = stored["entries"].values()
    assert entry["settings"]["num_workers"] == rank0[1]["decision"]["num_workers"]  # the planted entry replaced


@pytest.mark.slow
def test_a_failure_on_one_ddp_rank_stops_the_run_instead_of_hanging_it(tmp_path: Path) -> None:
    """Rank 1 fails between the tuner's collectives while rank 0 waits in one: the run ends, naming the rank."""
    proc = _torchrun_cases(str(tmp_path), "diverge")  # a hang would hit the 300 s timeout
    assert proc.returncode != 0
    assert "DataLoaderTuner failed on rank 1 (KeyError" in proc.stderr, proc.stderr[-4000:]


class _StallsAt(torch.utils.data.Dataset):
    """Item `stall` never comes (a worker stuck on a dead mount, say)."""

    def __init__(self, stall: int) -> None:
        self.stall = stall

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.stall:
            time.sleep(3600)
        return torch.zeros(2)


def _stalled_trial() -> float:
    """A trial whose worker never delivers item 8 fails on DataLoader's 1.5 s timeout; returns its seconds."""
    loader = torch.utils.data.DataLoader(_StallsAt(stall=8), batch_size=4)
    started = time.perf_counter()
    with pytest.raises(TrialError, match="timed out"):
        run_trial(
            lambda s: rebuild_loader(loader, s, stall_timeout_s=1.5),
            lambda batch, index: None,
            LoaderSettings(num_workers=1, prefetch_factor=2),
            warmup=1,
            steps=8,
            samples_per_batch=4,
        )
    return time.perf_counter() - started


@pytest.mark.slow
def test_a_stalled_worker_fails_its_trial_instead_of_blocking_it() -> None:
    loader = torch.utils.data.DataLoader(_StallsAt(stall=8), batch_size=4)
    assert rebuild_loader(loader, LoaderSettings(num_workers=1), stall_timeout_s=2).timeout == 2
    assert rebuild_loader(loader, LoaderSettings(), stall_timeout_s=2).timeout == 0  # no workers: no timeout
    _stalled_trial()  # the worker sleeps an hour: without the timeout this would not return


@pytest.mark.slow  # a wall-clock bound
def test_a_stalled_trial_ends_soon_after_its_timeout() -> None:
    assert _stalled_trial() < 30


def test_a_failing_worker_shutdown_fails_the_trial_on_every_rank() -> None:
    """The shutdown runs after the trial's last step check: its failure must still reach the final collective."""

    class Iterator:
        def __init__(self) -> None:
            self.batches = iter([torch.zeros(1)] * 8)

        def __next__(self) -> torch.Tensor:
            return next(self.batches)

        def _shutdown_workers(self) -> None:
            raise OSError("a worker would not stop")

    class Loader:
        def __iter__(self) -> Iterator:
            return Iterator()

    reports: list[list[float]] = []

    def sync(values: Any) -> list[float]:
        reports.append(list(values))
        return list(values)

    with pytest.raises(TrialError, match="a worker would not stop"):
        run_trial(
            lambda s: Loader(),
            lambda batch, index: None,
            LoaderSettings(),
            warmup=1,
            steps=4,
            samples_per_batch=1,
            sync=sync,
        )
    assert reports[-1][-2] == 1.0  # the last collective carried the failure (before the pending-signal flag)


class _FlaggingProbe(cases.QuietProbe):
    def stop(self) -> Interference:
        self.result = Interference(
            wall_s=1.0,
            cpus=CPUS,
            other_cpu_s=1.0,
            own_cpu_s=1.0,
            steal_s=0.0,
            load_start=None,
            load_end=None,
            flagged=True,
            reasons=("other processes used 1.00 of 2 CPU(s)",),
        )
        return self.result


@pytest.mark.slow
def test_a_decision_under_interference_is_applied_but_not_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(runner_module, "InterferenceProbe", _FlaggingProbe)  # the seam: every trial flagged
    tuner = _tuner(steps_per_trial=4, cache_dir=tmp_path / "cache", print_table=True)
    fitter, _ = cases.fit(cases.SleepyDataset(400, 0.002), [tuner], str(tmp_path), max_steps=2)
    assert tuner.decision is not None and fitter.train_dataloader.num_workers == tuner.decision.num_workers
    assert tuner.result is not None and not tuner.result.confident and "interference" in tuner.result.note
    assert all(t.flag for t in tuner.trials if t.status != "skipped")
    assert not (tmp_path / "cache" / "dataloader_tuner.json").exists()
    assert tuner.state_dict()["confident"] is False
    out = capsys.readouterr().out
    assert "not cached" in out and "interference" in out
    again = _tuner(steps_per_trial=4, cache_dir=tmp_path / "cache")
    again.load_state_dict(tuner.state_dict())  # a checkpoint's decision made under load is not reused either
    monkeypatch.setattr(runner_module, "InterferenceProbe", cases.QuietProbe)
    cases.fit(cases.SleepyDataset(400, 0.002), [again], str(tmp_path), max_steps=2)
    assert not again.cache_hit and again.trials and again.result is not None and again.result.confident


@pytest.mark.slow
def test_a_decision_beside_a_real_busy_process_is_not_cached(
    tmp_path: Path, real_probe: None, busy_process: int
) -> None:
    tuner = _tuner(steps_per_trial=4, cache_dir=tmp_path / "cache")
    cases.fit(cases.SleepyDataset(400, 0.002), [tuner], str(tmp_path), max_steps=2)
    assert tuner.result is not None and not tuner.result.confident, tuner.trials
    assert any("other processes used" in t.flag for t in tuner.trials)
    assert not (tmp_path / "cache" / "dataloader_tuner.json").exists()


@pytest.mark.slow
def test_a_wrong_decision_planted_in_the_cache_is_replaced(tmp_path: Path) -> None:
    data, folder = cases.SleepyDataset(400, 0.003), tmp_path / "cache"  # 50 batches an epoch, 24 ms each unloaded
    first = _tuner(steps_per_trial=8, cache_dir=folder)
    cases.fit(data, [first], str(tmp_path), max_steps=2)
    assert first.decision is not None and first.decision.num_workers > CPUS
    path = folder / "dataloader_tuner.json"
    stored = json.loads(path.read_text())
    ((key, entry),) = stored["entries"].items()
    entry["settings"] = {"num_workers": 0, "prefetch_factor": None, "pin_memory": False, "persistent_workers": False}
    entry["wait_share"] = 0.02  # as a decision made while another job inflated the step would record it
    path.write_text(json.dumps(stored))
    seen, second = _LoaderSeen(), _tuner(steps_per_trial=8, cache_dir=folder)
    fitter, _ = cases.fit(data, [second, seen], str(tmp_path), max_steps=60)  # the check, then epoch 2 re-tunes
    assert second.retuned and second.live_wait_share is not None and second.live_wait_share > 0.5
    assert second.decision is not None and second.decision.num_workers > CPUS
    assert seen.workers == fitter.train_dataloader.num_workers == second.decision.num_workers  # trains with it
    assert json.loads(path.read_text())["entries"][key]["settings"]["num_workers"] == second.decision.num_workers


@pytest.mark.slow
def test_a_right_cached_decision_passes_its_check(tmp_path: Path) -> None:
    data, folder = cases.SleepyDataset(400, 0.003), tmp_path / "cache"
    first = _tuner(steps_per_trial=8, cache_dir=folder)
    cases.fit(data, [first], str(tmp_path), max_steps=2)
    second = _tuner(steps_per_trial=8, cache_dir=folder, verify_steps=10)
    cases.fit(data, [second], str(tmp_path), max_steps=60)
    assert second.cache_hit or second.retuned
    assert second.decision is not None and second.decision.num_workers > CPUS


@pytest.mark.slow  # ~20 s beside a busy process; a decision under interference runs by default
def test_io_bound_choice_beside_a_busy_process_gets_many_workers(
    tmp_path: Path, real_probe: None, busy_process: int
) -> None:
    """The tuner's decision beside a real CPU-bound process that is not ours, on an I/O-bound dataset slow enough (80
    ms a batch per worker) that the right answer is unambiguous (8 workers several times 2's throughput). The figure
    behind it (>= 80% of the exhaustive sweep's best, in 9 of 10 runs) is the benchmark's:
    `python tests/benchmarks/bench_dataloader_tuner.py --cases io-busy`."""
    tuner = _tuner(max_tuning_time_s=60.0, use_cache=False)
    cases.fit(cases.SleepyDataset(1000, delay_s=0.01), [tuner], str(tmp_path), max_steps=2)
    assert tuner.decision is not None and tuner.decision.num_workers >= 4, tuner.trials


def _stretch_readings(monkeypatch: pytest.MonkeyPatch, factor: Callable[[LoaderSettings], float]) -> None:
    """Every trial's clock runs `factor(settings)` times as fast as the real one from the trial's start: each reading
    (its time, its wait, its cut against the baseline's pace) is scaled alike. Noise, scripted: the trial's own cut
    sees the scaled time too, so a machine busy with other work cannot cut a trial the script makes fast."""
    real = runner_module.run_trial

    def stretched(make_loader: Any, step: Any, settings: LoaderSettings, **kwargs: Any) -> Trial:
        scale, start = factor(settings), time.perf_counter()
        kwargs["clock"] = lambda: start + (time.perf_counter() - start) * scale
        return real(make_loader, step, settings, **kwargs)

    monkeypatch.setattr(runner_module, "run_trial", stretched)


def _tuner_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("DataLoaderTuner (")]


@pytest.mark.slow
def test_a_loader_waiting_10_percent_of_the_step_is_credited_no_more_than_1_11x(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's scripted loader: each batch costs 2 ms to collate and the step sleeps 18 ms, so the loader's own
    settings (0 workers) wait about 10% of step time and no setting can make a step more than about 1.11x faster.
    Noise is scripted in: every reading with workers comes out 3x faster than it ran. The speedup logged stays
    within the bound, and the report line names the excess as noise."""
    _stretch_readings(monkeypatch, lambda s: 1 / 3 if s.num_workers else 1.0)
    logger, tuner = _Metrics(), _tuner(use_cache=False)
    with caplog.at_level(logging.INFO, logger=tuner_module.__name__):
        cases.fit(
            cases.TensorItems(400),
            [tuner],
            str(tmp_path),
            max_steps=2,
            logger=logger,
            model=cases.Regression(step_sleep_s=0.018),
            loader={"collate_fn": cases.SlowCollate(0.002)},
        )
    result = tuner.result
    assert result is not None and result.baseline is not None, tuner.trials
    # the premise: about 10% (more on a loaded machine, where each sleep overruns), so a bound of about 1.11x
    assert 0.05 <= result.baseline.wait_share <= 0.2 and result.baseline.high <= 1.35, result.baseline
    logged = logger.logged["dataloader_tuner/speedup"]
    assert logged <= logger.logged["dataloader_tuner/speedup_bound"] == pytest.approx(result.baseline.high)
    assert result.measured_speedup is not None and result.measured_speedup > result.baseline.high  # the noise got in
    (line,) = _tuner_lines(caplog)
    assert "the excess is noise or interference, not credited" in line, line


def test_noise_alone_keeps_the_users_settings_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A scripted timing model where every setting runs alike (100 samples/s, 3% of the step waiting for data; 0
    workers 80 and 20%) and only noise differs: each reading stretched by 0.6-1.4x (seeded), every trial flagged.
    Readings 1.3x apart and more turn up, none is measurably faster, so the user's 2 workers stay: their loaders,
    train and validation, are never rebuilt, and the line says so."""
    rng = random.Random(0)

    def reading(make_loader: Any, step: Any, settings: LoaderSettings, **kwargs: Any) -> Trial:
        rate, wait = (100.0, 0.03) if settings.num_workers else (80.0, 0.2)
        seconds = kwargs["steps"] * kwargs["samples_per_batch"] / rate * rng.uniform(0.6, 1.4)
        return Trial(
            settings=settings,
            steps=kwargs["steps"],
            seconds=seconds,
            wait_s=wait * seconds,
            samples_per_batch=kwargs["samples_per_batch"],
        )

    monkeypatch.setattr(runner_module, "run_trial", reading)
    monkeypatch.setattr(runner_module, "InterferenceProbe", _FlaggingProbe)
    tuner = _tuner(use_cache=False)
    with caplog.at_level(logging.INFO, logger=tuner_module.__name__):
        fitter, _ = cases.fit(
            cases.TensorItems(400),
            [tuner],
            str(tmp_path),
            max_steps=2,
            val=cases.SleepyDataset(16, 0.0),
            loader={"num_workers": 2},
        )
    assert tuner.result is not None and tuner.result.kept, (tuner.result, tuner.trials)
    readings = [t.samples_per_s for t in tuner.trials if t.settings.num_workers]
    assert max(readings) > 1.3 * min(readings)  # the premise: alike settings read 1.3x apart and more
    assert tuner.decision == LoaderSettings(num_workers=2, prefetch_factor=2)  # exactly theirs: not persistent
    for loader in (fitter.train_dataloader, fitter.val_dataloaders):
        assert not hasattr(loader, "_lightning_accel_tuned")  # never rebuilt
    assert fitter.val_dataloaders.num_workers == 0
    (line,) = _tuner_lines(caplog)
    assert "kept your settings: no setting measurably faster (" in line, line


def test_a_loader_that_computes_gets_no_more_workers_than_the_cpu_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dataset that spins in Python on the 2-CPU budget, every trial flagged (which sends the search doubling past
    the budget) and readings with more workers scripted faster (the noise that made 8 workers look best on 2 CPUs):
    no count above 2 is timed, the one it would have tried is noted as over the budget, and the decision's reason
    says the budget bound the search. (The I/O-bound dataset still gets more workers than CPUs:
    `test_io_bound_dataset_gets_more_workers_than_cpus`.)"""
    monkeypatch.setattr(runner_module, "InterferenceProbe", _FlaggingProbe)
    _stretch_readings(monkeypatch, lambda s: 1 / (1 + s.num_workers))
    tuner = _tuner(use_cache=False, steps_per_trial=8)
    cases.fit(cases.BusyDataset(400, loops=10_000), [tuner], str(tmp_path), max_steps=2)
    assert max(tuner.trials, key=lambda t: t.samples_per_s).settings.num_workers == CPUS  # the premise: noise says 2
    timed = [t.settings.num_workers for t in tuner.trials if t.status != "skipped"]
    assert max(timed) <= CPUS and tuner.decision is not None and tuner.decision.num_workers <= CPUS, tuner.trials
    over = [t for t in tuner.trials if t.status == "skipped" and t.note.startswith(BUDGET_NOTE)]
    assert [t.settings.num_workers for t in over] == [2 * CPUS], tuner.trials
    assert tuner.result is not None and "the CPU budget bound the search" in tuner.result.reason


class _Counting(cases.Regression):
    """Counts its steps in an int (rebound: put back after the trials) and a list (changed in place: named)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.losses = 0, []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls += 1
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss))
        return loss


def test_state_the_trial_steps_change_is_put_back_or_named(tmp_path: Path) -> None:
    data = cases.SleepyDataset(200, 0.0005)
    tuner = _tuner(steps_per_trial=4, use_cache=False)
    with pytest.warns(LightningAccelWarning, match=r"changed `self\.losses` in place"):
        _, model = cases.fit(data, [tuner], str(tmp_path), max_steps=3, model=_Counting())
    assert tuner.trials and model.calls == 3  # the trials' calls were undone
    assert len(model.losses) > 3  # the list kept what the trials appended, as the warning says


class _Manual(cases.Regression):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "loader", "message"),
    [
        (_Manual, {}, "manual optimization, so the trials time the loading"),
        (cases.Regression, {"generator": torch.Generator().manual_seed(0)}, "has its own `generator`"),
    ],
    ids=["manual-optimization", "generator"],
)
def test_what_the_tuner_cannot_keep_identical_is_named_before_training(
    tmp_path: Path, model: type[cases.Regression], loader: dict[str, Any], message: str
) -> None:
    tuner = _tuner(steps_per_trial=4, use_cache=False)
    with pytest.warns(LightningAccelWarning, match=message):
        cases.fit(cases.SleepyDataset(200, 0.0005), [tuner], str(tmp_path), max_steps=2, model=model(), loader=loader)
    assert tuner.step_mode == ("data" if model is _Manual else "train")
