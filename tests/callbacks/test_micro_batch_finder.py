"""MicroBatchFinder in a real CPU Trainer: the micro-batch sized on the first real step under a memory budget (no trial
steps: `training_step` runs as often as without it, once per piece), recovery from out-of-memory inside a step, the
update of the whole batch (weights equal a run without it, 1e-5), and the modules it cannot serve as they are: state
sized by the batch on the module (refused by name), BatchNorm (a warning naming the layers)."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _memory_budget import MemoryBudget
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.callbacks import AccumulationScheduler, MicroBatchFinder
from lightning_accel.errors import ConfigError, LightningAccelWarning
from lightning_accel.schedules import estimated_optimizer_steps
from lightning_accel.tuning.micro_batch_search import MicroBatchTooLargeError, Trial, split_sizes

FEATURES = 8
TOL = 1e-5


def budget_for(samples: int) -> MemoryBudget:
    """Room for `samples` samples of FEATURES values per forward (a batch's cost is samples x FEATURES)."""
    return MemoryBudget(limit_bytes=samples * FEATURES)


class BudgetedModel(pl.LightningModule):
    """An MLP whose forward asks a memory budget for room (out-of-memory above it), SGD with momentum.

    Args:
        budget: None: no limit (the reference run).
        oom_at_steps: optimizer steps whose first attempt runs out of memory once, whatever its size (an injected
            fault, as a fragmented allocator gives).
        onecycle: OneCycleLR over `estimated_optimizer_steps`, stepped every optimizer step.
    """

    def __init__(
        self, budget: MemoryBudget | None = None, oom_at_steps: tuple[int, ...] = (), onecycle: bool = False
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
        self.budget, self.oom_at_steps, self.onecycle = budget, set(oom_at_steps), onecycle
        self.pieces: list[int] = []  # samples of each training_step call inside a training batch past the budget
        self.outside: list[int] = []  # samples of each training_step call outside a training batch (none expected)
        self._in_batch = False
        self.lrs: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.global_step in self.oom_at_steps:
            self.oom_at_steps.discard(self.global_step)
            raise torch.OutOfMemoryError("CUDA out of memory (injected at this step)")
        if self.budget is not None:
            self.budget.check(x)
        (self.pieces if self._in_batch else self.outside).append(int(x.shape[0]))
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._in_batch = True
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._in_batch = False

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        if not self.onecycle:
            return optimizer
        total = estimated_optimizer_steps(self.trainer)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def loader(samples: int = 640, batch_size: int = 32) -> DataLoader:
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(samples, FEATURES, generator=gen), torch.randn(samples, 1, generator=gen))
    return DataLoader(data, batch_size=batch_size)


def fit(
    model: pl.LightningModule,
    callbacks: list[pl.Callback],
    root: Any,
    data: DataLoader | None = None,
    ckpt_path: str | None = None,
    **trainer: Any,
) -> pl.Trainer:
    args: dict[str, Any] = {"max_steps": 20, "enable_checkpointing": False}
    args.update(trainer)
    pl_trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        callbacks=callbacks,
        **args,
    )
    pl_trainer.fit(model, data if data is not None else loader(), ckpt_path=ckpt_path)
    return pl_trainer


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, rtol=TOL, atol=TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> BudgetedModel:
    """20 optimizer steps on whole batches of 32, no budget, no finder."""
    model = BudgetedModel()
    fit(model, [], tmp_path_factory.mktemp("reference"))
    assert set(model.pieces) == {32}
    return model


def test_a_budget_of_4_samples_gives_micro_batch_4_and_the_whole_batchs_weights(reference, tmp_path) -> None:
    """No trial steps: the first batch runs whole as a real step, runs out of memory at 32, 16 and 8 (the recovery
    path), fits at 4, and the 19 batches after it start at 4."""
    model, finder = BudgetedModel(budget_for(4)), MicroBatchFinder()
    trainer = fit(model, [finder], tmp_path)
    assert finder.found == finder.size == 4
    assert [(t.size, t.fits) for t in finder.sizing] == [(32, False), (16, False), (8, False), (4, True)]
    assert model.budget is not None and model.budget.ooms == 3  # on the first batch only
    assert trainer.global_step == 20
    assert model.outside == []  # no training_step call outside a training batch
    assert model.pieces == [4] * 8 * 20  # 8 micro-batches per batch
    assert finder.oom_recoveries == 0  # the first batch's errors sized the micro-batch
    assert trainer.callback_metrics["micro_batch/size"] == 4
    assert_same_weights(model, reference)


class Observed(BudgetedModel):
    """Everything a `training_step` does besides its loss, as a user would see it: a Python counter, a buffer, a
    Python random draw, and the samples of the first call (kept in a list: a batch-sized tensor held as an attribute
    would be state the finder refuses to split)."""

    def __init__(self, budget: MemoryBudget | None = None) -> None:
        super().__init__(budget)
        self.calls = 0
        self.register_buffer("seen", torch.zeros(()))
        self.draws: list[float] = []
        self.first_x: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        import random

        self.calls += 1
        self.seen += 1
        self.draws.append(random.random())
        if not self.first_x:
            self.first_x.append(batch[0].clone())
        return super().training_step(batch, batch_idx)


def _observed_fit(tmp_path: Any, callbacks: list[pl.Callback], steps: int = 4) -> Observed:
    import random

    random.seed(3)
    torch.manual_seed(5)
    model = Observed()
    fit(model, callbacks, tmp_path, data=DataLoader(loader().dataset, batch_size=32, shuffle=True), max_steps=steps)
    return model


@pytest.mark.parametrize(("setting", "per_batch"), [("auto", 1), (32, 1), (64, 1), (8, 4), (12, 3)])
def test_training_step_runs_exactly_as_often_as_without_the_finder(tmp_path, setting: Any, per_batch: int) -> None:
    """4 steps of batches of 32: `auto` on a CPU and a size >= the batch run whole, exactly as without the finder (the
    same calls, buffer, Python draws, shuffled order and weights); a size k splits each batch into ceil(32 / k)
    pieces: steps x ceil(32 / k) calls, not one more."""
    plain = _observed_fit(tmp_path / "plain", [])
    finder = MicroBatchFinder(micro_batch_size=setting)
    model = _observed_fit(tmp_path / "finder", [finder])
    assert plain.calls == plain.seen.item() == 4
    assert model.calls == model.seen.item() == 4 * per_batch
    assert model.pieces == (plain.pieces if per_batch == 1 else split_sizes(32, setting) * 4)
    if per_batch == 1:
        assert model.draws == plain.draws and finder.found == 32 and finder.sizing in ([], [Trial(32, fits=True)])
    torch.testing.assert_close(model.first_x[0], plain.first_x[0][: model.pieces[0]])  # the same shuffled order
    assert_same_weights(model.net, plain.net)  # (the `seen` buffer counts the pieces)


@pytest.mark.parametrize("setting", [8, 32])
def test_state_a_step_changes_on_every_call_is_named_before_the_first_optimizer_step(tmp_path, setting: int) -> None:
    """A split batch runs `training_step` once per piece: the counter and the list of draws the module keeps change
    once per piece (what an RL agent's environment steps would do), named at the first split batch; a cache built
    once is not named, and a batch that runs whole warns of nothing."""

    class Cached(Observed):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if not hasattr(self, "table"):
                self.table = torch.ones(3)  # built at the first call, then only read
            return super().training_step(batch, batch_idx)

    steps: list[int] = []

    class Steps(pl.Callback):
        def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
            steps.append(sum("changes the module's own state" in str(w.message) for w in record))

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(Cached(), [MicroBatchFinder(micro_batch_size=setting), Steps()], tmp_path, max_steps=2)
    named = [str(w.message) for w in record if "changes the module's own state" in str(w.message)]
    if setting >= 32:
        assert named == []
        return
    assert len(named) == 1 and steps[0] == 1  # once, before the first optimizer step
    assert "`calls`" in named[0] and "`draws`" in named[0] and "table" not in named[0]


def test_two_injected_out_of_memory_errors_recover_with_the_same_weights(reference, tmp_path) -> None:
    model = BudgetedModel(budget_for(4), oom_at_steps=(5, 12))
    finder = MicroBatchFinder(grow_after=None)
    with pytest.warns(UserWarning, match="out of memory at step 5"):
        trainer = fit(model, [finder], tmp_path)
    assert finder.oom_recoveries == 2
    assert finder.size == 1  # 4 -> 2 at step 5, 2 -> 1 at step 12: halved once per error
    assert trainer.callback_metrics["micro_batch/oom_recoveries"] == 2
    assert trainer.global_step == 20
    assert_same_weights(model, reference)


def test_after_clean_steps_it_grows_back_to_the_size_found(reference, tmp_path) -> None:
    model = BudgetedModel(budget_for(4), oom_at_steps=(3,))
    finder = MicroBatchFinder(grow_after=4)
    fit(model, [finder], tmp_path)
    assert finder.oom_recoveries == 1 and finder.size == 4 == finder.found
    assert 2 in model.pieces[: 8 * 10]  # ran at 2 for a while
    assert model.pieces[-8:] == [4] * 8
    assert_same_weights(model, reference)


def test_an_uneven_split_batch_30_in_pieces_of_8(tmp_path) -> None:
    whole = BudgetedModel()
    fit(whole, [], tmp_path / "whole", data=loader(600, 30))
    split = BudgetedModel(budget_for(8))
    finder = MicroBatchFinder(micro_batch_size=8)
    fit(split, [finder], tmp_path / "split", data=loader(600, 30))
    assert split.pieces[:4] == [8, 8, 8, 6]
    assert_same_weights(split, whole)


def test_a_data_dependent_oom_long_batches_split_short_ones_do_not(tmp_path) -> None:
    """Sequences of 4 tokens fit 32 per forward; one batch of 16-token sequences does not, and is split."""

    class SeqModel(BudgetedModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            self.budget.check(x)  # type: ignore[union-attr]
            (self.pieces if self._in_batch else self.outside).append(int(x.shape[0]))
            return self.net(x.mean(dim=1)).pow(2).mean()

    short = [torch.randn(32, 4, FEATURES) for _ in range(3)]
    long = torch.randn(32, 16, FEATURES)
    batches = [*short, long, *short]
    data = DataLoader([(b,) for b in batches], batch_size=None)
    budget = MemoryBudget(limit_bytes=32 * 4 * FEATURES)  # cost: samples x tokens (x FEATURES, bytes_per_token)
    budget.cost = lambda x: int(x.shape[0] * x.shape[1] * FEATURES)  # type: ignore[method-assign]
    model, finder = SeqModel(budget), MicroBatchFinder(grow_after=1)
    with pytest.warns(UserWarning, match="out of memory at step 3"):
        fit(model, [finder], tmp_path, data=data, max_steps=7)
    assert finder.found == 32 and finder.oom_recoveries == 2  # 32 -> 16 -> 8 for the long batch
    assert model.pieces[:3] == [32, 32, 32] and model.pieces[3:7] == [8, 8, 8, 8]
    assert model.pieces[7:] == [8, 8, 8, 8, 16, 16, 32]  # doubled back after each clean batch, up to the size found


def test_one_sample_that_does_not_fit_fails_before_any_step(tmp_path) -> None:
    model = BudgetedModel(MemoryBudget(limit_bytes=FEATURES - 1))
    with pytest.raises(MicroBatchTooLargeError, match=r"not even one sample.*32, 16, 8, 4, 2, 1.*activation checkp"):
        fit(model, [MicroBatchFinder()], tmp_path)
    assert model.pieces == [] and model.trainer.global_step == 0


def test_resume_keeps_the_micro_batch_and_the_accumulation(tmp_path) -> None:
    """10 steps, a checkpoint, 10 more from it (no new search) equal 20 straight, with a global batch of 64."""
    straight = BudgetedModel(budget_for(4))
    fit(straight, [MicroBatchFinder(), AccumulationScheduler(global_batch_size=64)], tmp_path / "straight")
    first = BudgetedModel(budget_for(4))
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=10)
    fit(
        first,
        [MicroBatchFinder(), AccumulationScheduler(global_batch_size=64), saver],
        tmp_path / "first",
        max_steps=10,
        enable_checkpointing=True,
    )
    resumed, finder, accumulation = (
        BudgetedModel(budget_for(4)),
        MicroBatchFinder(),
        AccumulationScheduler(global_batch_size=64),
    )
    budget = resumed.budget
    fit(resumed, [finder, accumulation], tmp_path / "resumed", ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert finder.sizing == [] and finder.size == 4  # resumed, not sized again
    assert budget.ooms == 0  # no batch ran above the budget
    assert accumulation.get_accumulate_grad_batches(0) == 2
    assert resumed.pieces == [4] * 8 * 2 * 10
    assert_same_weights(resumed, straight)


def test_optimizer_steps_stay_exact_and_onecycle_ends_at_its_final_lr(tmp_path) -> None:
    model = BudgetedModel(budget_for(4), onecycle=True)
    accumulation = AccumulationScheduler(global_batch_size=64)
    trainer = fit(
        model, [MicroBatchFinder(), accumulation], tmp_path, max_steps=-1, max_epochs=2, data=loader(656, 32)
    )  # 21 batches per epoch: 11 windows, the last of 1 batch
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert trainer.global_step == 22 == scheduler.total_steps  # type: ignore[attr-defined]
    final = scheduler.optimizer.param_groups[0]["min_lr"]  # type: ignore[attr-defined]
    assert model.lrs[-1] == pytest.approx(final, rel=1e-6)  # the last step ran at OneCycle's final LR
    assert set(model.pieces) == {4}


def test_it_splits_each_micro_batch_of_an_accumulation_window(reference, tmp_path) -> None:
    """Loader batches of 16, 2 per optimizer step (global 32), each run as 4 pieces of 4: the reference's weights."""
    model = BudgetedModel(budget_for(4))
    fit(model, [MicroBatchFinder(), AccumulationScheduler(global_batch_size=32)], tmp_path, data=loader(640, 16))
    assert model.pieces == [4] * 4 * 2 * 20
    assert_same_weights(model, reference)


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"micro_batch_size": "big"}, "micro_batch_size"),
        ({"memory_fraction": 1.5}, "memory_fraction"),
        ({"memory_fraction": 0}, "memory_fraction"),
        ({"grow_after": 0}, "grow_after"),
    ],
)
def test_bad_options_name_the_setting(kwargs: dict[str, Any], setting: str) -> None:
    with pytest.raises(ConfigError, match=setting) as info:
        MicroBatchFinder(**kwargs)
    assert info.value.setting == setting


def test_manual_optimization_and_other_strategies_are_refused(tmp_path) -> None:
    class Manual(BudgetedModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ConfigError, match="manual optimization"):
        fit(Manual(), [MicroBatchFinder()], tmp_path)
    from lightning.pytorch.callbacks import BatchSizeFinder

    class OwnLoader(BudgetedModel):
        batch_size = 32

        def train_dataloader(self) -> DataLoader:
            return loader()

    with pytest.raises(ConfigError, match="BatchSizeFinder"):
        pl.Trainer(
            accelerator="cpu",
            max_steps=1,
            logger=False,
            enable_progress_bar=False,
            callbacks=[MicroBatchFinder(), BatchSizeFinder()],
        ).fit(OwnLoader())


@pytest.fixture(scope="module")
def ddp_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], BudgetedModel]:
    """`_micro_batch_cases.py`'s two fits on 2 gloo ranks, and one process's fit on whole batches of 64 (the same
    samples per step)."""
    import _micro_batch_cases as cases
    from _torchrun import rank_results

    root = tmp_path_factory.mktemp("ddp")
    ranks = rank_results(cases.__file__, root, ranks=2)
    whole = BudgetedModel()
    fit(whole, [], root / "whole", data=loader(640, 64))
    return ranks, whole


def _assert_ranks_equal_whole(ranks: list[dict[str, Any]], whole: BudgetedModel) -> None:
    assert ranks[0]["weights"] == ranks[1]["weights"]  # identical on both ranks
    for name, value in whole.state_dict().items():
        torch.testing.assert_close(torch.tensor(ranks[0]["weights"][name]), value.flatten(), rtol=TOL, atol=TOL)


@pytest.mark.slow
def test_two_ddp_ranks_recover_together_when_only_rank_1_runs_out_of_memory(ddp_ranks) -> None:
    """2 gloo ranks x batches of 32 under a budget of 4, rank 1 out of memory at step 5: both ranks redo the step at
    2, and their weights equal each other and one process's on whole batches of 64."""
    ranks, whole = ddp_ranks
    for rank, result in enumerate(r["oom"] for r in ranks):
        assert result["found"] == 4 and result["steps"] == 20
        assert [s[:2] for s in result["sizing"]] == [[32, False], [16, False], [8, False], [4, True]]
        assert result["recoveries"] == 1 and result["size"] == 2  # rank 0 recovered too, in lockstep
        ran_at_4 = 8 * 5 + (8 if rank == 0 else 0)  # rank 0 finished step 5 at 4, then redid it with rank 1 at 2
        assert result["pieces"][:ran_at_4] == [4] * ran_at_4
        assert result["pieces"][ran_at_4:] == [2] * 16 * 15
    _assert_ranks_equal_whole([r["oom"] for r in ranks], whole)


@pytest.mark.slow
def test_two_ddp_ranks_take_the_smallest_ranks_size_from_their_peaks(ddp_ranks) -> None:
    """The first batch of 32 peaks over both ranks' budgets; rank 0's alone would take 8, rank 1's 4: both run 4 from
    the second batch on, and the update is the whole batches' still."""
    ranks, whole = ddp_ranks
    for result in (r["peak"] for r in ranks):
        assert result["sizing"] == [[32, False, 4200], [4, True, 1400]]
        assert result["found"] == result["size"] == 4 and result["recoveries"] == 0
        assert result["pieces"] == [32] + [4] * 8 * 19
    _assert_ranks_equal_whole([r["peak"] for r in ranks], whole)


def _two_runs(make_model: Any, callbacks: Any, tmp_path: Any, **trainer: Any) -> tuple[Any, Any, Any, Any]:
    """The same fit without and with MicroBatchFinder(micro_batch_size=2) on batches of 4: (model, callbacks) each."""
    from _tiny import tiny_loader

    out = []
    for with_finder in (False, True):
        torch.manual_seed(0)  # the same initial weights
        model, extra = make_model(), callbacks()
        finder = [MicroBatchFinder(micro_batch_size=2)] if with_finder else []
        pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=4,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(tmp_path),
            callbacks=[*extra, *finder],
            **trainer,
        ).fit(model, tiny_loader())
        out += [model, extra[0]]
    return tuple(out)  # type: ignore[return-value]


def test_it_composes_with_nonfinite_guard_skipping_a_nan_step(tmp_path) -> None:
    from test_nonfinite import NaNLossModel

    from lightning_accel.callbacks import NonFiniteGuard

    plain, plain_guard, split, split_guard = _two_runs(
        lambda: NaNLossModel(nan_batches=(1,)), lambda: [NonFiniteGuard(action="skip")], tmp_path
    )
    assert plain_guard.nonfinite_losses == split_guard.nonfinite_losses == 1  # seen once per batch, not per piece
    assert plain.steps == split.steps  # the same LR held on the skipped step
    for a, b in zip(plain.weights, split.weights, strict=True):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)
    torch.testing.assert_close(split.weights[1], split.weights[2])  # the NaN step moved nothing


def test_it_composes_with_fp16_loss_scaling_and_skipped_step_guard(tmp_path) -> None:
    from test_skipped_steps import InfGradModel, _fp16

    from lightning_accel.callbacks import SkippedStepGuard

    plain, plain_guard, split, split_guard = _two_runs(
        lambda: InfGradModel(inf_batches=(1,)), lambda: [SkippedStepGuard()], tmp_path, plugins=[_fp16()]
    )
    assert plain_guard.skipped_steps == split_guard.skipped_steps == 1
    assert plain.lrs == split.lrs
    for (_, _, a), (_, _, b) in zip(plain.steps, split.steps, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-3)  # fp16 sums pieces' gradients in another order


def test_bf16_mixed_precision_runs_the_pieces_under_autocast(tmp_path) -> None:
    """Under bf16-mixed the pieces' forwards run in bf16 (the precision context is entered per piece)."""
    seen: list[torch.dtype] = []

    class Recording(BudgetedModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append(self.net[0](batch[0]).dtype)
            return super().training_step(batch, batch_idx)

    model = Recording(budget_for(8))
    fit(model, [MicroBatchFinder()], tmp_path, max_steps=2, precision="bf16-mixed")
    assert model.pieces == [8] * 4 * 2 and set(seen) == {torch.bfloat16}


def test_a_training_step_without_batch_idx_and_epoch_means_weighted_by_samples(tmp_path) -> None:
    """`training_step(self, batch)` works (Lightning passes batch_idx only when asked), and an on-epoch mean logged
    per piece equals the whole batch's: 30 samples in 8, 8, 8, 6 weigh the last piece 6/30."""

    class NoIndex(BudgetedModel):
        def training_step(self, batch: Any) -> torch.Tensor:  # type: ignore[override]
            self.log("train/x_mean", batch[0].mean(), on_step=False, on_epoch=True)
            return super().training_step(batch, 0)

    whole, split = NoIndex(), NoIndex(budget_for(8))
    plain = fit(whole, [], tmp_path / "whole", data=loader(60, 30), max_steps=2)
    finder = fit(split, [MicroBatchFinder(micro_batch_size=8)], tmp_path / "split", data=loader(60, 30), max_steps=2)
    assert split.pieces == [8, 8, 8, 6] * 2
    torch.testing.assert_close(finder.callback_metrics["train/x_mean"], plain.callback_metrics["train/x_mean"])


class _FakeMeter:
    """The CUDA meter of a sizing step, on a CPU: the peak of an attempt is a base of 1000 B plus 100 B per sample of
    its largest piece (read from the model's record of pieces), against `budget` (2000 B: 10 samples)."""

    def __init__(self, model: BudgetedModel, budget: int = 2000) -> None:
        self.model, self.base, self.budget, self._start = model, 1000, budget, 0

    def reset(self) -> None:
        self._start = len(self.model.pieces)

    def peak(self) -> int:
        return self.base + 100 * max(self.model.pieces[self._start :])


def test_on_cuda_the_first_batchs_peak_sets_the_next_batches_size(reference, tmp_path, monkeypatch) -> None:
    """The first batch of 32 runs whole, peaks at 4200 B over a budget of 2000 B: the next batch runs at 8 (the
    largest divisor whose estimated peak, 1800 B, fits), peaks within the budget, and 8 is kept; every batch's work
    counts: one call for the first batch, 4 for each after it, and the weights of whole batches."""
    from lightning_accel.callbacks import micro_batch

    monkeypatch.setattr(micro_batch, "_cuda_meter", lambda trainer, module, params, fraction: _FakeMeter(module))
    model, finder = BudgetedModel(), MicroBatchFinder()
    fit(model, [finder], tmp_path)
    assert [(t.size, t.fits, t.peak_bytes) for t in finder.sizing] == [(32, False, 4200), (8, True, 1800)]
    assert finder.found == finder.size == 8 and finder.oom_recoveries == 0
    assert model.pieces == [32] + [8] * 4 * 19
    assert_same_weights(model, reference)


def _lstm(vocab: int = 16) -> pl.LightningModule:
    """Lightning's `demos.lstm.LightningLSTM` as it is, with a tiny SimpleLSTM (2 layers of 16, dropout 0.2) and no
    WikiText2 download in `prepare_data` (the data is `_lstm_loader`'s)."""
    from lightning.pytorch.demos.lstm import LightningLSTM, SimpleLSTM

    torch.manual_seed(0)
    model = LightningLSTM(vocab_size=vocab)
    model.model = SimpleLSTM(vocab_size=vocab, ninp=8, nhid=16, nlayers=2)
    model.prepare_data = lambda: None  # type: ignore[method-assign]
    return model


def _lstm_loader(vocab: int = 16, length: int = 6) -> DataLoader:
    """Token windows and their next tokens (as `demos.transformer.WikiText2` gives), in the demo's SequenceSampler
    batches of 4: each row continues the row of the batch before it, whose hidden state the demo carries on."""
    from lightning.pytorch.demos.lstm import SequenceSampler

    tokens = torch.randint(0, vocab, (64 + length + 1,), generator=torch.Generator().manual_seed(2))
    data = [(tokens[i : i + length], tokens[i + 1 : i + length + 1]) for i in range(64)]
    return DataLoader(data, batch_sampler=SequenceSampler(data, batch_size=4))  # type: ignore[arg-type]


def _lstm_fit(model: pl.LightningModule, callbacks: list[pl.Callback], root: Any) -> pl.Trainer:
    torch.manual_seed(1)  # the dropout masks
    return fit(model, callbacks, root, data=_lstm_loader(), max_steps=4)


def test_lightnings_lstm_demo_trains_with_auto_as_without_it(tmp_path) -> None:
    """`demos.lstm.LightningLSTM` keeps its hidden state (2 layers x batch x 16) on `self`. On a CPU, auto runs each
    batch of 4 whole: it trains, with the weights of the run without the finder (the dropout draws untouched)."""
    plain, model = _lstm(), _lstm()
    _lstm_fit(plain, [], tmp_path / "plain")
    finder = MicroBatchFinder()
    trainer = _lstm_fit(model, [finder], tmp_path / "finder")
    assert trainer.global_step == 4 and finder.found == 4
    assert_same_weights(model, plain)


def test_lightnings_lstm_demo_split_in_pieces_is_refused_by_name_before_the_first_step(tmp_path) -> None:
    """Pieces of 2 would hand one piece's hidden state to the next: a ConfigError naming `hidden[0]` and the fixes,
    at the first piece, with the weights as they were (no optimizer step)."""
    model = _lstm()
    initial = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match=r"`hidden\[0\]` \(shape \(2, 2, 16\)\).*`micro_batch_size` >= 4") as info:
        _lstm_fit(model, [MicroBatchFinder(micro_batch_size=2)], tmp_path)
    assert info.value.setting == "micro_batch_size"
    assert model.trainer.global_step == 0
    for before, after in zip(initial, model.parameters(), strict=True):
        assert torch.equal(before, after)


class Normed(pl.LightningModule):
    """Linear-BatchNorm1d-Linear (or Linear-Tanh-Linear with `norm=False`), SGD; records the warnings seen by the time
    of the first optimizer step."""

    def __init__(self, norm: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        middle = nn.BatchNorm1d(16) if norm else nn.Tanh()
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), middle, nn.Linear(16, 1))
        self.warned_before_first_step: bool | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _one_epoch(norm: bool, callbacks: list[pl.Callback], root: Any) -> Normed:
    model = Normed(norm)
    fit(model, callbacks, root, data=loader(64, 8), max_steps=-1, max_epochs=1)  # 8 batches of 8, in order
    return model


def test_batchnorm_split_into_pieces_warns_naming_the_layer_before_the_first_step(tmp_path) -> None:
    import warnings

    seen: list[int] = []

    class FirstStep(pl.Callback):
        def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 0:
                seen.append(len([w for w in caught if issubclass(w.category, LightningAccelWarning)]))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = _one_epoch(True, [MicroBatchFinder(micro_batch_size=4), FirstStep()], tmp_path / "split")
    ours = [str(w.message) for w in caught if issubclass(w.category, LightningAccelWarning)]
    assert len(ours) == 1 and seen == [1]  # once, before the first optimizer step
    assert "`net.1` (BatchNorm1d)" in ours[0] and "GroupNorm or LayerNorm" in ours[0]
    assert "accept per-piece statistics" in ours[0]
    whole = _one_epoch(True, [], tmp_path / "whole")
    drift = max(float((a - b).abs().max()) for a, b in zip(split.parameters(), whole.parameters(), strict=True))
    assert drift > 1e-3  # what the warning is about: per-piece statistics give another update


def test_without_batchnorm_pieces_of_4_give_the_whole_batchs_weights_after_an_epoch(tmp_path) -> None:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = _one_epoch(False, [MicroBatchFinder(micro_batch_size=4)], tmp_path / "split")
    assert not [w for w in caught if issubclass(w.category, LightningAccelWarning)]
    whole = _one_epoch(False, [], tmp_path / "whole")
    assert split.trainer.global_step == whole.trainer.global_step == 8
    assert_same_weights(split, whole)
