"""AccumulationScheduler and estimated_optimizer_steps: counts, LR ends, big-batch equivalence, resume, DDP no_sync."""

from __future__ import annotations

import functools
import random
import warnings
from typing import Any

import _accumulation_cases as cases
import lightning.pytorch as pl
import pytest
import torch
from _torchrun import rank_results
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from lightning_accel import estimated_optimizer_steps
from lightning_accel.callbacks import AccumulationScheduler
from lightning_accel.errors import ConfigError, LightningAccelWarning
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


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "lr_schedule"), CASES)
def test_two_ddp_processes(two_processes: list[dict[str, Any]], schedule: str, lr_schedule: str) -> None:
    rank0, rank1 = (r[f"{schedule}/{lr_schedule}"] for r in two_processes)
    assert rank0["world"] == 2
    _check_case(rank0, schedule, lr_schedule)
    assert rank1["final"] == rank0["final"]
    for result in (rank0, rank1):  # DDP all-reduces gradients only on the micro-batch that ends a window
        assert [sync for sync, _ in result["syncs"]] == [ends for _, ends in result["syncs"]]
        assert sum(ends for _, ends in result["syncs"]) == len(result["steps"])


@pytest.mark.slow
def test_two_processes_fsdp2_under_model_parallel_strategy(two_processes: list[dict[str, Any]]) -> None:
    rank0, rank1 = (r["step/fsdp"] for r in two_processes)
    _check_case(rank0, "step", "cosine")  # the same weights as big-batch steps, from sharded parameters
    assert rank1["final"] == rank0["final"]
    for result in (rank0, rank1):  # FSDP2 reduce-scatters only on the micro-batch that ends a window
        assert [sync for sync, _ in result["syncs"]] == [ends for _, ends in result["syncs"]]


@pytest.mark.slow
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


# -- a loader without a length: the last window of an epoch, known one fetch ahead ----------------------------------


class _Stream(torch.utils.data.IterableDataset):
    """The samples of a TensorDataset in order, without `__len__` (streaming data)."""

    def __init__(self, data: torch.utils.data.TensorDataset) -> None:
        self.data = data

    def __iter__(self) -> Any:
        return iter(self.data)


class _DivisorModel(cases.Regression):
    """Records, per micro-batch, what Lightning divided its loss by (the raw loss over the loss backward gets), and
    per optimizer step the window's size."""

    def __init__(self) -> None:
        super().__init__(None)
        self.divisors: list[float] = []
        self.windows: list[int] = []
        self._raw: torch.Tensor | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self._raw = loss.detach()
        return loss

    def on_before_backward(self, loss: torch.Tensor) -> None:
        assert self._raw is not None
        self.divisors.append(round(float(self._raw / loss.detach()), 9))

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.windows.append(self.trainer.accumulate_grad_batches)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=cases.LR)


class _DataLoaderIterModel(_DivisorModel):
    """The same, with a `training_step` that fetches its own batch (`dataloader_iter`: no batch fetched ahead)."""

    def training_step(self, dataloader_iter: Any) -> torch.Tensor:  # type: ignore[override]
        batch, _, _ = next(dataloader_iter)
        return super().training_step(batch, 0)


def _fit_divisors(
    batches: int, sized: bool, model: _DivisorModel | None = None, max_epochs: int = 2
) -> tuple[_DivisorModel, pl.Trainer, list[str]]:
    """Fit `batches` micro-batches per epoch of one dataset, in a sized loader or a stream, under `{0: 4}`."""
    data = torch.utils.data.TensorDataset(*(t[: batches * cases.MICRO_BATCH] for t in cases.dataset(2).tensors))
    assert len(data) == batches * cases.MICRO_BATCH
    loader = torch.utils.data.DataLoader(data if sized else _Stream(data), batch_size=cases.MICRO_BATCH)
    model = model or _DivisorModel()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=max_epochs,
        callbacks=[AccumulationScheduler({0: 4})],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader)
    ours = [str(w.message) for w in caught if issubclass(w.category, LightningAccelWarning)]
    return model, trainer, ours


def test_an_iterable_dataset_averages_its_last_window_over_its_real_length() -> None:
    """The issue's case: 13 batches under `{0: 4}` from an IterableDataset without `__len__` divide the last batch
    by 1, as a sized loader of the same data does (it divided by 4 before), and train the same weights."""
    sized, _, _ = _fit_divisors(13, sized=True)
    stream, trainer, warned = _fit_divisors(13, sized=False)
    assert trainer.num_training_batches == float("inf")  # the case the loader's length did not cover
    assert stream.divisors[-2:] == [4, 1] and stream.divisors[11:13] == [4, 1]  # each of the two epochs
    assert stream.divisors == sized.divisors == ([4.0] * 12 + [1.0]) * 2
    assert stream.windows == sized.windows == [4, 4, 4, 1] * 2
    for name, value in sized.layer.state_dict().items():
        torch.testing.assert_close(stream.layer.state_dict()[name], value, atol=1e-6, rtol=0)
    assert warned == []


def test_an_iterable_dataset_whose_last_window_began_full_is_rescaled_to_its_real_length() -> None:
    """14 batches: the last window starts as one of 4 (the loader cannot say it holds 2) and learns so at its last
    micro-batch; its gradients are rescaled to the mean over 2 before the step, as the sized loader's divisors of 2."""
    sized, _, _ = _fit_divisors(14, sized=True)
    stream, _, _ = _fit_divisors(14, sized=False)
    assert sized.divisors[12:14] == [2.0, 2.0] and stream.divisors[12:14] == [4.0, 4.0]  # the cut comes late
    assert stream.windows == sized.windows == [4, 4, 4, 2] * 2
    for name, value in sized.layer.state_dict().items():
        torch.testing.assert_close(stream.layer.state_dict()[name], value, atol=1e-6, rtol=0)
    reference = _reference_with_divisors(stream.initial, sized.divisors, stream.windows)
    torch.testing.assert_close(reference["weight"], stream.layer.weight.detach(), atol=1e-6, rtol=0)
    unscaled = _reference_with_divisors(stream.initial, stream.divisors, stream.windows)
    assert not torch.allclose(unscaled["weight"], stream.layer.weight.detach(), atol=1e-4)  # the rescale mattered


def _reference_with_divisors(
    initial: dict[str, torch.Tensor], divisors: list[float], windows: list[int]
) -> dict[str, torch.Tensor]:
    """Plain torch SGD on 14 batches per epoch, each micro-batch's loss divided by `divisors`: what the stream
    would train without the rescale."""
    x, y = (t[: 14 * cases.MICRO_BATCH] for t in cases.dataset(2).tensors)
    layer = torch.nn.Linear(cases.FEATURES, 1)
    layer.load_state_dict(initial)
    optimizer = torch.optim.SGD(layer.parameters(), lr=cases.LR)
    micro = iter(range(len(divisors)))
    for window in windows:
        optimizer.zero_grad()
        for _ in range(window):
            i = next(micro)
            batch = slice((i % 14) * cases.MICRO_BATCH, (i % 14 + 1) * cases.MICRO_BATCH)
            (torch.nn.functional.mse_loss(layer(x[batch]), y[batch]) / divisors[i]).backward()
        optimizer.step()
    return layer.state_dict()


def test_dataloader_iter_sized_windows_and_unsized_warning() -> None:
    """A `training_step(dataloader_iter)` is handed the previous batch's index: the windows still follow the loop's
    own count. Without a length the fetcher fetches nothing ahead, so a partial last window takes no step, as under
    `Trainer(accumulate_grad_batches=4)`, and a named warning says so before the first step."""
    sized, _, warned_sized = _fit_divisors(13, sized=True, model=_DataLoaderIterModel())
    assert sized.windows == [4, 4, 4, 1] * 2 and sized.divisors == ([4.0] * 12 + [1.0]) * 2
    assert warned_sized == []
    stream, trainer, warned = _fit_divisors(13, sized=False, model=_DataLoaderIterModel())
    assert trainer.global_step == 3 * 2 and stream.windows == [4, 4, 4] * 2
    assert len(warned) == 1 and "`dataloader_iter`" in warned[0] and "no optimizer step" in warned[0]


# -- `trainer.estimated_stepping_batches`, as a user's `configure_optimizers` reads it -------------------------------


class _LinearToZero(cases.Regression):
    """A Lightning-tutorial module: a step-interval LambdaLR to zero sized by `trainer.estimated_stepping_batches`
    in `configure_optimizers`; records the total it read and the LR of every optimizer step."""

    def __init__(self) -> None:
        super().__init__(None)
        self.total: int | float | None = None
        self.lrs: list[float] = []

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=cases.LR)
        self.total = total = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])


def _fit_linear_to_zero(callbacks: list[pl.Callback], max_epochs: int = 1, **trainer_kwargs: Any) -> _LinearToZero:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=max_epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    model = _LinearToZero()
    loader = torch.utils.data.DataLoader(cases.dataset(1), batch_size=cases.MICRO_BATCH)  # 10 batches
    trainer.fit(model, loader)
    assert model.trainer is trainer
    return model


def test_a_schedule_sized_by_estimated_stepping_batches_ends_where_lightnings_accumulation_ends() -> None:
    """The issue's case: the LR of the last step under `{0: 2}` and under a global batch of 2 x the loader's batch
    equals `Trainer(accumulate_grad_batches=2)`'s; Lightning's own count (10 micro-batches) would have left it at
    0.6 x the base LR."""
    lightning = _fit_linear_to_zero([], accumulate_grad_batches=2)
    constant = _fit_linear_to_zero([AccumulationScheduler({0: 2})])
    global_batch = _fit_linear_to_zero([AccumulationScheduler(global_batch_size=2 * cases.MICRO_BATCH)])
    assert lightning.total == constant.total == global_batch.total == 5
    assert len(lightning.lrs) == len(constant.lrs) == len(global_batch.lrs) == 5
    assert constant.lrs[-1] == pytest.approx(lightning.lrs[-1], abs=1e-12, rel=0)
    assert global_batch.lrs[-1] == pytest.approx(lightning.lrs[-1], abs=1e-12, rel=0)
    unpatched = cases.LR * (1 - 4 / 10)  # step 4 of a schedule sized for 10 steps
    assert abs(constant.lrs[-1] - unpatched) > 1e-3 and abs(global_batch.lrs[-1] - unpatched) > 1e-3


def test_estimated_stepping_batches_is_lightnings_again_after_the_fit() -> None:
    """The property is patched for the fit's Trainer only and put back in teardown, and after an exception."""
    from lightning.pytorch import Trainer

    original = vars(Trainer)["estimated_stepping_batches"]
    model = _fit_linear_to_zero([AccumulationScheduler({0: 2})])
    assert vars(Trainer)["estimated_stepping_batches"] is original
    assert model.trainer.estimated_stepping_batches == 10  # Lightning's count with `accumulate_grad_batches=1`
    assert _fit_linear_to_zero([]).total == 10  # a second fit of the same config without the callback

    class Fails(_LinearToZero):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            raise RuntimeError("boom")

    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, callbacks=[AccumulationScheduler({0: 2})], logger=False)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Fails(), torch.utils.data.DataLoader(cases.dataset(1), batch_size=cases.MICRO_BATCH))
    assert vars(Trainer)["estimated_stepping_batches"] is original


def test_a_varying_factor_counts_exactly_and_warns_naming_estimated_optimizer_steps() -> None:
    """`{0: 1, 1: 2}` over 2 epochs of 10 batches: 10 + 5 steps. The property says 15 (Lightning's says 20) and a
    warning before the first optimizer step names the function and the value; a constant factor does not warn."""
    with pytest.warns(LightningAccelWarning, match=r"returns 15.*estimated_optimizer_steps\(trainer\)") as caught:
        varying = _fit_linear_to_zero([AccumulationScheduler({0: 1, 1: 2})], max_epochs=2)
    assert varying.total == 15 == len(varying.lrs) and varying.lrs[-1] == pytest.approx(cases.LR / 15, rel=1e-12)
    assert sum("varies over this fit" in str(w.message) for w in caught) == 1  # once, however often it is read
    with warnings.catch_warnings():
        warnings.simplefilter("error", LightningAccelWarning)
        _fit_linear_to_zero([AccumulationScheduler({0: 2, 5: 4})], max_epochs=2)  # epoch 5 is never reached


@pytest.mark.parametrize(
    "kwargs",
    [dict(max_epochs=e, max_steps=s, limit_train_batches=b) for e in (1, 3) for s in (-1, 4) for b in (1.0, 0.5, 3)]
    + [dict(max_epochs=-1, max_steps=-1), dict(max_epochs=2, limit_train_batches=0), dict(max_epochs=-1, max_steps=6)],
)
def test_estimated_stepping_batches_under_a_constant_factor_is_lightnings_own_formula(kwargs: dict[str, Any]) -> None:
    """Under `{0: 3}` the property answers as `Trainer(accumulate_grad_batches=3)` does, edges included (a fit
    without an end, no training batch). Each fit stops in `configure_optimizers`."""

    class Stop(Exception):
        pass

    class Reads(cases.Regression):
        def configure_optimizers(self) -> Any:
            raise Stop(self.trainer.estimated_stepping_batches)

    def read(callbacks: list[pl.Callback], **extra: Any) -> Any:
        trainer = pl.Trainer(accelerator="cpu", callbacks=callbacks, logger=False, **kwargs, **extra)
        with pytest.raises(Stop) as stopped:
            trainer.fit(Reads(None), torch.utils.data.DataLoader(cases.dataset(1), batch_size=cases.MICRO_BATCH))
        return stopped.value.args[0]

    assert read([AccumulationScheduler({0: 3})]) == read([], accumulate_grad_batches=3)
