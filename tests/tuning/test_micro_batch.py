"""Micro-batch sizing: the candidates, the size a measured peak asks for, the split, sample-weighted losses, and what
makes a module's update differ when its batch is split (state sized by the batch, batch statistics)."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from _memory_budget import BudgetedMLP, MemoryBudget

from lightning_accel.errors import ConfigError, ConfigTypeError
from lightning_accel.tuning.micro_batch_search import (
    batch_sized_state,
    batch_statistics_layers,
    candidate_sizes,
    held_tensors,
    is_out_of_memory,
    micro_batch_for_budget,
    sample_weights,
    split_batch,
    split_sizes,
)


def test_candidates_are_the_divisors_largest_first() -> None:
    assert candidate_sizes(32) == [32, 16, 8, 4, 2, 1]
    assert candidate_sizes(12) == [12, 6, 4, 3, 2, 1]
    assert candidate_sizes(1) == [1]
    with pytest.raises(ConfigError, match=r"`batch_size=0` must be an integer >= 1"):
        candidate_sizes(0)
    with pytest.raises(ConfigTypeError):
        candidate_sizes(8.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ran", "peak", "expected"),
    [
        (32, 1900, 32),  # within the budget of 2000: keep it
        (32, 4200, 8),  # 1000 + 100 per sample: 16 would peak at 2600, 8 at 1800
        (30, 4000, 10),  # not a divisor itself (halved from 60): the divisors of 60 below it, 10 peaks at 2000
        (8, 100_000, 1),  # not even 1 is estimated to fit: 1, and the next step measures it
        (1, 100_000, 1),
    ],
)
def test_a_measured_peak_over_the_budget_asks_for_the_largest_divisor_estimated_to_fit(
    ran: int, peak: int, expected: int
) -> None:
    batch = 60 if ran == 30 else 32
    size = micro_batch_for_budget(batch, ran, peak_bytes=peak, base_bytes=1000, budget_bytes=2000)
    assert size == expected


def test_what_counts_as_out_of_memory() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(MemoryError())  # host memory: not something a smaller micro-batch fixes


def test_split_sizes_even_and_uneven() -> None:
    assert split_sizes(32, 4) == [4] * 8
    assert split_sizes(30, 8) == [8, 8, 8, 6]
    assert split_sizes(3, 8) == [3]
    assert sample_weights([8, 8, 8, 6]) == [8 / 30] * 3 + [6 / 30]
    with pytest.raises(ConfigError):
        split_sizes(0, 4)


def test_split_batch_keeps_the_structure() -> None:
    Pair = namedtuple("Pair", "x y")
    batch = {
        "input": (torch.arange(30).view(30, 1), [torch.arange(30)]),
        "pair": Pair(torch.zeros(30, 2), "tag"),
        "name": "b",
    }
    pieces = split_batch(batch, [8, 8, 8, 6])
    assert [p["input"][0].shape[0] for p in pieces] == [8, 8, 8, 6]
    assert torch.equal(torch.cat([p["input"][1][0] for p in pieces]), torch.arange(30))
    assert isinstance(pieces[3]["pair"], Pair) and pieces[3]["pair"].y == "tag" and pieces[3]["name"] == "b"
    with pytest.raises(ConfigError, match=r"shape \(29,\) cannot be split into micro-batches of \[8, 8, 8, 6\]"):
        split_batch((torch.zeros(30), torch.zeros(29)), [8, 8, 8, 6])


@pytest.mark.parametrize(("n", "piece"), [(32, 4), (30, 8), (7, 3)])
def test_sample_weighted_pieces_give_the_whole_batchs_gradient(n: int, piece: int) -> None:
    """The foundation of exact recovery: the pieces' mean losses, each weighted by its share of the samples, sum to
    the whole batch's mean loss, so the gradients match (an equal-weight average of an uneven split would not)."""
    x, y = torch.randn(n, 8, dtype=torch.float64), torch.randn(n, 1, dtype=torch.float64)
    whole = BudgetedMLP(MemoryBudget(limit_bytes=10**9)).double()
    split = BudgetedMLP(MemoryBudget(limit_bytes=piece * 8)).double()  # the whole batch would not fit
    split.load_state_dict(whole.state_dict())
    torch.nn.functional.mse_loss(whole(x), y).backward()
    sizes = split_sizes(n, piece)
    for (px, py), weight in zip(split_batch((x, y), sizes), sample_weights(sizes), strict=True):
        (torch.nn.functional.mse_loss(split(px), py) * weight).backward()
    for a, b in zip(whole.parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    if n % piece:  # equal weights differ: the reason for sample weights
        equal = BudgetedMLP(MemoryBudget(limit_bytes=10**9)).double()
        equal.load_state_dict(whole.state_dict())
        for px, py in split_batch((x, y), sizes):
            (torch.nn.functional.mse_loss(equal(px), py) / len(sizes)).backward()
        assert not all(
            torch.allclose(a.grad, b.grad) for a, b in zip(whole.parameters(), equal.parameters(), strict=True)
        )


def test_a_long_sequence_batch_runs_out_where_short_ones_fit() -> None:
    """The data-dependent case: the same micro-batch fits short sequences and not a long one."""
    budget = MemoryBudget(limit_bytes=16 * 64)
    short, long = torch.zeros(16, 64), torch.zeros(16, 512)
    assert budget.check(short) == 16 * 64
    with pytest.raises(torch.OutOfMemoryError):
        budget.check(long)
    assert budget.check(long[:2]) == 2 * 512  # 2 long ones fit


def _whole_and_split(n: int, limit_samples: int) -> tuple[BudgetedMLP, BudgetedMLP, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    data = (torch.randn(n, 8, dtype=torch.float64), torch.randn(n, 1, dtype=torch.float64))
    whole = BudgetedMLP(MemoryBudget(limit_bytes=10**9)).double()
    split = BudgetedMLP(MemoryBudget(limit_bytes=limit_samples * 8)).double()
    split.load_state_dict(whole.state_dict())
    return whole, split, data


def _mse(model: BudgetedMLP):  # noqa: ANN202
    return lambda part: torch.nn.functional.mse_loss(model(part[0]), part[1])


def test_an_oom_splits_the_batch_and_keeps_the_whole_batchs_gradient() -> None:
    from lightning_accel.tuning.micro_batch_search import backward_in_pieces

    whole, split, data = _whole_and_split(32, limit_samples=5)  # 32 and 16 and 8 run out; 4 fits
    earlier = [torch.full_like(p, 0.5) for p in split.parameters()]  # an earlier micro-batch of the window
    for p, g in zip(split.parameters(), earlier, strict=True):
        p.grad = g.clone()
    for p, g in zip(whole.parameters(), earlier, strict=True):
        p.grad = g.clone()
    expected = _mse(whole)(data)
    expected.backward()
    attempts: list[int] = []
    step = backward_in_pieces(_mse(split), data, list(split.parameters()), on_attempt=attempts.append)
    assert (step.piece, step.recoveries) == (4, 3)  # halved once per error: 32 -> 16 -> 8 -> 4
    assert attempts == [32, 16, 8, 4]
    torch.testing.assert_close(step.loss.double(), expected.detach(), rtol=1e-12, atol=1e-12)
    for a, b in zip(whole.parameters(), split.parameters(), strict=True):  # failed attempts left no trace
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


def test_an_uneven_batch_in_pieces_of_8() -> None:
    from lightning_accel.tuning.micro_batch_search import backward_in_pieces

    whole, split, data = _whole_and_split(30, limit_samples=8)
    _mse(whole)(data).backward()
    step = backward_in_pieces(_mse(split), data, list(split.parameters()), piece=8)
    assert (step.piece, step.recoveries) == (8, 0) and split.budget.ooms == 0
    for a, b in zip(whole.parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


def test_another_ranks_oom_makes_this_rank_retry_at_the_same_smaller_size() -> None:
    from lightning_accel.tuning.micro_batch_search import backward_in_pieces

    whole, split, data = _whole_and_split(16, limit_samples=10**6)  # this rank would fit everything
    _mse(whole)(data).backward()
    votes = iter([True, False])  # the other rank ran out at 16, and fitted at 8
    step = backward_in_pieces(_mse(split), data, list(split.parameters()), agree=lambda mine: mine or next(votes))
    assert (step.piece, step.recoveries) == (8, 1)
    for a, b in zip(whole.parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


def test_one_sample_that_does_not_fit_fails_fast_naming_the_fixes() -> None:
    from lightning_accel.tuning.micro_batch_search import MicroBatchTooLargeError, backward_in_pieces

    _, split, data = _whole_and_split(8, limit_samples=0)
    with pytest.raises(
        MicroBatchTooLargeError,
        match=r"One sample of this batch does not fit .*activation "
        r"checkpointing.*bf16.*ModelParallelStrategy",
    ):
        backward_in_pieces(_mse(split), data, list(split.parameters()))
    assert all(p.grad is None for p in split.parameters())  # nothing half-accumulated is left behind


def test_ranks_with_batches_of_different_lengths_halve_the_same_size() -> None:
    """The size halves from what every rank holds, not from this rank's shorter batch: a last batch of 3 with size
    4 goes 4 -> 2 with the other rank, never 3 -> 1 (which would part the ranks)."""
    from lightning_accel.tuning.micro_batch_search import backward_in_pieces

    _, split, data = _whole_and_split(3, limit_samples=10**6)
    votes = iter([True, False])  # the other rank, on a batch of 4, ran out at 4 and fitted at 2
    step = backward_in_pieces(
        _mse(split), data, list(split.parameters()), piece=4, agree=lambda mine: mine or next(votes)
    )
    assert (step.piece, step.recoveries) == (2, 1)


def test_a_failed_attempt_frees_its_activations_before_the_retry_and_keeps_earlier_gradients() -> None:
    """The failed piece's graph is gone when the retry's first forward runs (a GPU needs that memory), and the
    gradients from before the batch are put back by reference, then summed with the batch's."""
    import gc
    import weakref

    from lightning_accel.tuning.micro_batch_search import backward_in_pieces

    layer = torch.nn.Linear(4, 1).double()
    layer.weight.grad = torch.ones_like(layer.weight)
    earlier = layer.weight.grad
    x = torch.randn(8, 4, dtype=torch.float64)
    alive: list[weakref.ref] = []
    seen_alive: list[int] = []
    failed = [False]

    def loss_fn(part: torch.Tensor) -> torch.Tensor:
        gc.collect()
        seen_alive.append(sum(ref() is not None for ref in alive))
        hidden = layer(part) * 2.0
        alive.append(weakref.ref(hidden))
        if part.shape[0] == 8 and not failed[0]:
            failed[0] = True

            def boom(grad: torch.Tensor) -> torch.Tensor:
                raise torch.OutOfMemoryError("CUDA out of memory (in backward)")

            hidden.register_hook(boom)
        return hidden.pow(2).mean()

    step = backward_in_pieces(loss_fn, x, list(layer.parameters()))
    assert step.recoveries == 1 and step.piece == 4
    assert seen_alive == [0, 0, 0]  # nothing of the failed attempt (nor of the piece before) alive at each forward
    expected = torch.autograd.grad((layer(x) * 2.0).pow(2).mean(), layer.weight)[0] + 1.0
    assert layer.weight.grad is earlier  # the gradient from before the batch, summed in place
    torch.testing.assert_close(layer.weight.grad, expected, rtol=1e-12, atol=1e-12)


def test_state_sized_by_the_batch_that_a_step_leaves_on_the_module() -> None:
    """An RNN's hidden state (layers x batch x features) set by the step is found, by name, in a tuple; a buffer, a
    parameter, a tensor the step did not set, a list of outputs and a tensor of another size are not."""
    module = torch.nn.Sequential(torch.nn.Linear(3, 3))
    module.register_buffer("counter", torch.zeros(4))
    module.constant = torch.zeros(4, 4)  # set before the step: not the step's state
    module.outputs = []
    before = held_tensors(module)
    module.hidden = (torch.zeros(2, 4, 16), torch.zeros(2, 4, 16))
    module.outputs.append(torch.zeros(4, 1))  # collected for the epoch's end: a split keeps it whole
    module[0].last = torch.zeros(5, 3)  # another size
    module[0].seen = {"x": torch.zeros(4, 3)}
    found = batch_sized_state(before, held_tensors(module), 4)
    assert found == {"hidden[0]": (2, 4, 16), "hidden[1]": (2, 4, 16), "0.seen['x']": (4, 3)}
    assert batch_sized_state(before, held_tensors(module), 7) == {}


def test_layers_that_take_statistics_over_the_batch() -> None:
    module = torch.nn.Sequential(
        torch.nn.Linear(4, 4),
        torch.nn.BatchNorm1d(4),
        torch.nn.Sequential(torch.nn.InstanceNorm1d(4), torch.nn.InstanceNorm1d(4, track_running_stats=True)),
        torch.nn.GroupNorm(2, 4),
        torch.nn.LayerNorm(4),
        torch.nn.BatchNorm1d(4, track_running_stats=False),
    )
    assert batch_statistics_layers(module) == {"1": "BatchNorm1d", "2.1": "InstanceNorm1d", "5": "BatchNorm1d"}
    module.eval()  # running statistics: no batch statistics, but for a BatchNorm that keeps none
    assert batch_statistics_layers(module) == {"5": "BatchNorm1d"}
