"""`tuning.module_state`: the state a module carries between `training_step` calls, found and put back."""

from __future__ import annotations

from collections import deque

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_accel.tuning.module_state import Snapshot, changed, fingerprint


class Agent:
    def __init__(self) -> None:
        self.buffer: deque[tuple[int, float]] = deque(maxlen=4)
        self.position = 0


class Stateful(pl.LightningModule):
    """An RNN-like hidden state, a counter, an agent with a bounded buffer, a lazily built cache and a metric-like
    submodule: everything a step can leave behind."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self.register_buffer("running", torch.zeros(2))
        self.hidden: torch.Tensor | None = None
        self.calls = 0
        self.agent = Agent()
        self.cache: torch.Tensor | None = None

    def step(self, batch: torch.Tensor) -> None:
        if self.cache is None:
            self.cache = torch.ones(3)  # built once, reused after
        self.hidden = self.layer(batch).detach() if self.hidden is None else self.hidden + 1
        self.calls += 1
        self.agent.position += 1
        self.agent.buffer.append((self.calls, 0.5))
        self.running += 1  # a buffer: not this module's concern


def test_carried_state_changes_on_every_call_and_a_lazy_cache_only_on_the_first() -> None:
    module = Stateful()
    before = fingerprint(module)
    module.step(torch.ones(4, 2))
    first = fingerprint(module)
    module.step(torch.ones(4, 2))
    second = fingerprint(module)
    assert changed(before, first) == ["agent", "cache", "calls", "hidden"]
    assert changed(first, second) == ["agent", "calls", "hidden"]  # the cache stays: not carried state


def test_a_full_bounded_buffer_that_only_rotates_still_counts_as_changed() -> None:
    module = Stateful()
    for _ in range(5):
        module.step(torch.ones(1, 2))
    before = fingerprint(module)
    module.agent.buffer.append((99, 0.0))  # the deque is full: its length stays 4
    assert changed(before, fingerprint(module)) == ["agent"]


def test_a_tensor_changed_in_place_counts() -> None:
    module = Stateful()
    module.step(torch.ones(1, 2))
    before = fingerprint(module)
    with torch.no_grad():
        module.hidden.add_(1)  # type: ignore[union-attr]
    assert changed(before, fingerprint(module)) == ["hidden"]


def test_parameters_buffers_internals_and_metrics_are_not_state() -> None:
    module = Stateful()
    module.metric = _MetricLike()
    before = fingerprint(module)
    with torch.no_grad():
        module.layer.weight.add_(1)
    module.running += 1
    module.metric.total += 5
    module.train(False)
    assert "layer.weight" not in before and "running" not in before
    assert changed(before, fingerprint(module)) == []


class _MetricLike(nn.Module):
    """What torchmetrics' Metric looks like to the fingerprint: `_defaults` and `_update_count`."""

    def __init__(self) -> None:
        super().__init__()
        self._defaults = {"total": 0}
        self._update_count = 0
        self.total = torch.zeros(())


def test_a_snapshot_puts_back_what_it_copied_removes_what_the_steps_made_and_names_the_rest() -> None:
    module = Stateful()
    snapshot = Snapshot.take(module)
    for _ in range(3):
        module.step(torch.ones(4, 2))
    module.made = torch.ones(1)  # an attribute the steps created
    restored, lost = snapshot.restore()
    assert sorted(restored) == ["cache", "calls", "hidden", "made"]
    assert not hasattr(module, "made")
    assert lost == ["agent"]  # a plain object is not copied: named instead
    assert module.hidden is None and module.calls == 0 and module.cache is None
    assert module.agent.position == 3  # what could not be put back stays as the steps left it


def test_a_snapshot_restores_a_tensor_to_its_value_before_and_can_restore_again() -> None:
    module = Stateful()
    module.step(torch.ones(1, 2))
    kept = module.hidden.clone()  # type: ignore[union-attr]
    snapshot = Snapshot.take(module)
    module.step(torch.ones(1, 2))
    snapshot.restore()
    assert torch.equal(module.hidden, kept)  # type: ignore[arg-type]
    module.step(torch.ones(1, 2))
    snapshot.restore()
    assert torch.equal(module.hidden, kept)  # type: ignore[arg-type]


def test_a_tensor_made_where_a_freed_one_was_still_reads_as_changed() -> None:
    # a call that replaces `self.hidden` frees the old tensor, and CPython often builds the one of the call after at
    # the same address, so the two share an `id`: the fingerprint must still tell them apart (else a Snapshot leaves
    # it as the search left it)
    module = Stateful()
    module.step(torch.ones(1, 2))
    reused = 0
    for _ in range(200):
        before = fingerprint(module)
        old = id(module.hidden)
        module.step(torch.ones(1, 2))
        module.step(torch.ones(1, 2))
        reused += id(module.hidden) == old
        assert "hidden" in changed(before, fingerprint(module))
    assert reused > 0  # the case above happened: an address was reused while the fingerprint lived


def test_a_fingerprint_keeps_no_tensor_alive_in_a_tuple_either() -> None:
    import gc
    import weakref

    module = Stateful()
    module.hidden = (torch.zeros(64, 64), torch.zeros(64, 64))  # type: ignore[assignment]  # an LSTM's (h, c)
    gone = [weakref.ref(t) for t in module.hidden]  # type: ignore[union-attr]
    before = fingerprint(module)
    module.hidden = (torch.ones(64, 64), torch.ones(64, 64))  # type: ignore[assignment]
    gc.collect()
    assert [ref() for ref in gone] == [None, None]  # the fingerprint held neither the old tuple nor its tensors
    assert "hidden" in changed(before, fingerprint(module))  # and still tells the new pair from the old
