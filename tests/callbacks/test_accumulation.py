"""AccumulationScheduler and estimated_optimizer_steps: counts, LR ends, big-batch equivalence, resume, DDP no_sync."""

from __future__ import annotations

import functools
import random
from typing import Any

import _accumulation_cases as cases
import lightning.pytorch as pl
import pytest
import torch
from _torchrun import rank_results
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from lightning_accel import estimated_optimizer_steps
from lightning_accel.callbacks import AccumulationScheduler
from lightning_accel.errors import ConfigError
from lightning_accel.schedules import AccumulationPlan, count_optimizer_steps

# Window sizes (micro-batches per optimizer step) worked out by hand from cases.SCHEDULES, 10 micro-batches per rank
# and epoch: the reference the runs are held to, not derived from the code under test.
EXPECTED_WINDOWS = {
    ("epoch", 1): [1] * 10 + [2] * 5 + [4, 4, 2],
    ("epoch", 2): [1] * 10 + [2] * 5 + [4, 4, 2],
    ("step", 1): [1, 1, 1, 1, 3, 3, 3, 3, 3, 1],
    ("step", 2): [1, 1, 1, 1, 3, 3, 3, 3, 3, 1],
    ("global_batch", 1): [8, 2, 8, 2],  # 16 = 2 per device x 1 device x 8
    ("global_batch", 2): [4, 4, 2, 4, 4, 2],  # 16 = 2 per device x 2 devices x 4
    ("step_capped", 1): [1, 1, 1, 4, 3, 4, 4, 2, 4],  # max_steps=9 ends mid-epoch
    ("step_capped", 2): [1, 1, 1, 4, 3, 4, 4, 2, 4],
}
FINAL_LR = {"cosine": cases.LR * 0.1, "onecycle": cases.LR / 25.0 / 1e4}
CASES = [(s, lr) for s in cases.SCHEDULES for lr in cases.LR_SCHEDULES]


def _brute_force_steps(plan: AccumulationPlan, num_batches: int, max_epochs: int, max_steps: int) -> int:
    """One batch at a time, the way Lightning's loop walks an epoch."""
    steps = 0
    for epoch in range(max_epochs):
        in_window, window = 0, 0
        for batch in range(num_batches):
            if in_window == window:
                window, in_window = min(plan.at(epoch, steps), num_batches - batch), 0
            in_window += 1
            if in_window == window:
                steps += 1
                if steps == max_steps:
                    return steps
    return steps


def test_count_matches_a_batch_by_batch_walk() -> None:
    rng = random.Random(0)
    for _ in range(300):
        unit = rng.choice(["epoch", "step"])
        keys = sorted(rng.sample(range(1, 40), rng.randint(0, 3)))
        plan = AccumulationPlan(unit, ((0, rng.randint(1, 5)), *((k, rng.randint(1, 9)) for k in keys)))
        num_batches, max_epochs = rng.randint(1, 30), rng.randint(0, 6)
        max_steps = rng.choice([-1, rng.randint(1, 60)])
        expected = _brute_force_steps(plan, num_batches, max_epochs, max_steps)
        assert count_optimizer_steps(plan, num_batches, max_epochs, max_steps) == expected, (plan, num_batches)


def test_count_with_unlimited_epochs_and_iterable_data() -> None:
    plan = AccumulationPlan("step", ((0, 1), (10, 4)))
    assert count_optimizer_steps(plan, 7, -1, 25) == 25
    assert count_optimizer_steps(plan, float("inf"), None, 25) == 25
    with pytest.raises(ValueError, match="max_steps"):
        count_optimizer_steps(plan, 7, -1, -1)
    with pytest.raises(ValueError, match="max_steps"):
        count_optimizer_steps(plan, float("inf"), 3, -1)


def _reference_final(result: dict[str, Any], windows: list[int], lr_schedule: str) -> dict[str, torch.Tensor]:
    """Plain torch: each optimizer step is one SGD step on the mean loss of the window's samples (a big batch)."""
    world = result["world"]
    x, y = cases.dataset(world).tensors
    layer = torch.nn.Linear(cases.FEATURES, 1)
    layer.load_state_dict({k: torch.tensor(v) for k, v in result["initial"].items()})
    optimizer = torch.optim.SGD(layer.parameters(), lr=cases.LR)
    scheduler = cases.LR_SCHEDULES[lr_schedule](optimizer, total_steps=len(windows))
    per_micro = cases.MICRO_BATCH * world  # DistributedSampler(shuffle=False) interleaves: one global micro-batch
    start = 0
    for window in windows:
        if start >= len(x):
            start = 0  # next epoch
        end = start + window * per_micro
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(layer(x[start:end]), y[start:end]).backward()
        optimizer.step()
        scheduler.step()
        start = end
    return layer.state_dict()


def _check_case(result: dict[str, Any], schedule: str, lr_schedule: str) -> None:
    windows = EXPECTED_WINDOWS[(schedule, result["world"])]
    assert [s["window"] for s in result["steps"]] == windows
    assert result["estimated"] == len(windows) == result["global_step"]
    assert result["steps"][-1]["lr"] == pytest.approx(FINAL_LR[lr_schedule], rel=1e-6)
    reference = _reference_final(result, windows, lr_schedule)
    for name, value in reference.items():
        torch.testing.assert_close(torch.tensor(result["final"][name]), value, atol=1e-5, rtol=0)
    assert result["accumulate_after_fit"] == 1  # restored after the fit


def _check_resume(results: dict[str, Any], schedule: str) -> None:
    run = results[f"{schedule}/resume"]
    full, resumed, at = run["full"]["steps"], run["resumed"]["steps"], run["resumed_at"]
    assert 0 < at < len(full) and full[at]["epoch"] == full[at - 1]["epoch"]  # a mid-epoch checkpoint
    assert [(s["step"], s["epoch"], s["window"]) for s in resumed] == [
        (s["step"], s["epoch"], s["window"]) for s in full[at:]
    ]
    assert [s["lr"] for s in resumed] == pytest.approx([s["lr"] for s in full[at:]], rel=1e-9)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return cases.run_all(str(tmp_path_factory.mktemp("accumulation")))


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return rank_results(cases.__file__, tmp_path_factory.mktemp("accumulation_ddp"))


@pytest.mark.parametrize(("schedule", "lr_schedule"), CASES)
def test_single_process(single_process: dict[str, Any], schedule: str, lr_schedule: str) -> None:
    _check_case(single_process[f"{schedule}/{lr_schedule}"], schedule, lr_schedule)


@pytest.mark.parametrize("schedule", ["epoch", "step", "global_batch"])
def test_single_process_resume_mid_schedule(single_process: dict[str, Any], schedule: str) -> None:
    _check_resume(single_process, schedule)


@pytest.mark.parametrize(("schedule", "lr_schedule"), CASES)
def test_two_ddp_processes(two_processes: list[dict[str, Any]], schedule: str, lr_schedule: str) -> None:
    rank0, rank1 = (r[f"{schedule}/{lr_schedule}"] for r in two_processes)
    assert rank0["world"] == 2
    _check_case(rank0, schedule, lr_schedule)
    assert rank1["final"] == rank0["final"]
    for result in (rank0, rank1):  # DDP all-reduces gradients only on the micro-batch that ends a window
        assert [sync for sync, _ in result["syncs"]] == [ends for _, ends in result["syncs"]]
        assert sum(ends for _, ends in result["syncs"]) == len(result["steps"])


def test_two_processes_fsdp2_under_model_parallel_strategy(two_processes: list[dict[str, Any]]) -> None:
    rank0, rank1 = (r["step/fsdp"] for r in two_processes)
    _check_case(rank0, "step", "cosine")  # the same weights as big-batch steps, from sharded parameters
    assert rank1["final"] == rank0["final"]
    for result in (rank0, rank1):  # FSDP2 reduce-scatters only on the micro-batch that ends a window
        assert [sync for sync, _ in result["syncs"]] == [ends for _, ends in result["syncs"]]


@pytest.mark.parametrize("schedule", ["epoch", "step", "global_batch"])
def test_two_ddp_processes_resume_mid_schedule(two_processes: list[dict[str, Any]], schedule: str) -> None:
    for results in two_processes:
        _check_resume(results, schedule)


def _fit(callbacks: list[pl.Callback], **trainer_kwargs: Any) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=trainer_kwargs.pop("max_epochs", 1),
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    model = cases.Regression(functools.partial(cases.schedules.cosine_schedule))
    loader = torch.utils.data.DataLoader(cases.dataset(1), batch_size=cases.MICRO_BATCH)
    trainer.fit(model, loader)
    return trainer


def test_lightning_gradient_accumulation_scheduler_is_counted_right() -> None:
    # The case: {0: 1, 2: 4} over 4 epochs of 10 batches is 10 + 10 + 3 + 3 = 26 steps, not Lightning's 40.
    trainer = _fit([GradientAccumulationScheduler({0: 1, 2: 4})], max_epochs=4)
    assert trainer.global_step == 26 == trainer.lightning_module.estimated_steps


def test_two_fits_in_a_row_and_state_round_trip() -> None:
    callback = AccumulationScheduler({0: 1, 3: 2}, unit="step")
    first = _fit([callback])
    second = _fit([callback])
    assert first.global_step == second.global_step == 3 + 4 == estimated_optimizer_steps(second)
    state = callback.state_dict()
    fresh = AccumulationScheduler({0: 1, 3: 2}, unit="step")
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    assert "_accumulated_batches_reached" not in second.fit_loop.epoch_loop.__dict__


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of `scheduling` and `global_batch_size`"),
        ({"scheduling": {0: 2}, "global_batch_size": 8}, "exactly one"),
        ({"scheduling": {0: 2}, "unit": "epochs"}, "unit='epochs'"),
        ({"scheduling": {-1: 2}}, "key -1"),
        ({"scheduling": {0: 0}}, r"scheduling\[0\]=0"),
        ({"scheduling": {}}, "non-empty"),
        ({"global_batch_size": 0}, "global_batch_size=0"),
        ({"global_batch_size": 8, "micro_batch_size": 2.5}, "micro_batch_size=2.5"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AccumulationScheduler(**kwargs)


def test_global_batch_that_does_not_divide_names_the_numbers() -> None:
    with pytest.raises(ConfigError, match=r"`global_batch_size=5` is not a multiple of .* = 2; use 4 or 6"):
        _fit([AccumulationScheduler(global_batch_size=5)])  # the loader's batches of 2


def test_a_micro_batch_size_other_than_the_loaders_is_an_error_not_a_wrong_log() -> None:
    """lightning-hydra-template divides `data.batch_size` by the world size: `micro_batch_size: ${data.batch_size}`
    logged a global batch twice the real one on 2 ranks. The loader the Trainer built decides."""
    with pytest.raises(ConfigError, match=r"`micro_batch_size=4`, but the train DataLoader .* yields 2 samples"):
        _fit([AccumulationScheduler(global_batch_size=8, micro_batch_size=4)])


def test_conflicts_are_errors() -> None:
    with pytest.raises(ConfigError, match="accumulate_grad_batches=2"):
        _fit([AccumulationScheduler({0: 2})], accumulate_grad_batches=2)
    with pytest.raises(ConfigError, match="GradientAccumulationScheduler"):
        _fit([AccumulationScheduler({0: 2}), GradientAccumulationScheduler({0: 2})])


def test_the_first_batch_is_checked_when_the_loader_does_not_say_its_batch_size() -> None:
    """A batch sampler without `batch_size`: `micro_batch_size=4` is taken on trust, and the first batch (2 samples)
    proves it wrong before any step is counted."""
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[AccumulationScheduler(global_batch_size=8, micro_batch_size=4)],
    )
    model = cases.Regression(functools.partial(cases.schedules.cosine_schedule))
    data = cases.dataset(1)
    pairs = [[i, i + 1] for i in range(0, len(data) - 1, 2)]  # a plain list of index lists: no batch_size to read
    loader = torch.utils.data.DataLoader(data, batch_sampler=pairs)
    with pytest.raises(ConfigError, match=r"computed from 4 samples per device, but the first batch holds 2"):
        trainer.fit(model, loader)
