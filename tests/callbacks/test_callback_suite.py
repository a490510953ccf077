"""The suite every callback of lightning_accel passes: constructible, picklable, two fits, state round trip, no GPU.

The state round trip is checked on a state the fits moved away from a new callback's: a callback that drops a field
when it loads fails it (the tests at the end prove that with deliberately lossy callbacks). A callback that keeps no
state in checkpoints is listed with the reason, and must inherit Lightning's empty `state_dict`.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable
from typing import Any

import _gpu_monitor_cases as gpu_cases
import lightning.pytorch as pl
import pytest
from _fake_nvml import FakeClock, FakeGPU, FakeNVML, install
from _tiny import TinyRegression, tiny_loader
from test_float8 import FakeTorchao
from test_nonfinite import NaNLossModel
from test_skipped_steps import InfGradModel, _fp16

import lightning_accel.callbacks as callbacks


def _gpu_monitor(mp: pytest.MonkeyPatch) -> callbacks.GPUMonitor:
    """Two fake GPUs read on a scripted clock, one reading after every batch (see `_gpu_monitor_cases.Driver`)."""
    clock = FakeClock()
    install(
        mp,
        FakeNVML([FakeGPU("GPU-a", utilization=50.0), FakeGPU("GPU-b", utilization=lambda t: 10.0 * t)], clock=clock),
    )
    mp.setattr(callbacks.GPUMonitor, "_clock", staticmethod(clock))
    mp.setattr(callbacks.GPUMonitor, "_threaded", False)
    return callbacks.GPUMonitor(device_indices=[0, 1], print_report=False)


@dataclasses.dataclass(frozen=True)
class Case:
    """How the suite fits one callback, and what of its state a resumed run must see again."""

    make: Callable[[pytest.MonkeyPatch], pl.Callback]
    """The callback, set to do its work on a CPU Trainer (fakes installed through the monkeypatch)."""
    model: Callable[[], pl.LightningModule] = TinyRegression
    """What each fit trains: one that makes the callback act (a NaN loss for NonFiniteGuard)."""
    helpers: Callable[[pl.Callback], list[pl.Callback]] = lambda callback: []
    """Callbacks fitted before it (the driver of GPUMonitor's scripted clock)."""
    trainer: Callable[[], dict[str, Any]] = dict
    """Extra Trainer arguments, new for each fit (fp16 for SkippedStepGuard)."""
    observe: Callable[[Any], Any] = lambda callback: None
    """Its state as a resumed run sees it, besides `state_dict()` (public attributes, properties)."""
    stateless: str = ""
    """Why it keeps nothing in checkpoints; empty for a callback with state."""


# One case per exported callback. A callback exported without an entry here fails
# `test_every_exported_callback_is_in_the_suite`.
CASES: dict[str, Case] = {
    "AccumulationScheduler": Case(
        lambda mp: callbacks.AccumulationScheduler({0: 1, 2: 2}, unit="step"),
        observe=lambda cb: {"window_complete": cb.window_complete},
    ),
    "BenchMonitor": Case(
        lambda mp: callbacks.BenchMonitor(metric="train/loss", target=1e9, warmup_batches=1),
        stateless="a measurement of one fit, written to its file; a resumed fit measures itself",
    ),
    "Compile": Case(
        lambda mp: callbacks.Compile(backend="eager"), stateless="compiles the model again in every fit's setup"
    ),
    "DataLoaderTuner": Case(
        lambda mp: callbacks.DataLoaderTuner(steps_per_trial=2, use_cache=False, print_table=False)
    ),
    "Float8Training": Case(
        lambda mp: (FakeTorchao().install(mp), callbacks.Float8Training())[1],
        stateless="converts the model again at the start of every fit",
    ),
    "MatmulPrecision": Case(
        lambda mp: callbacks.MatmulPrecision("high", requested="amp"),
        stateless="sets torch's matmul precision again in every stage's setup",
    ),
    "GPUMonitor": Case(
        _gpu_monitor,
        helpers=lambda cb: [gpu_cases.Driver(callbacks.GPUMonitor._clock, cb)],  # the FakeClock `_gpu_monitor` set
        observe=lambda cb: cb.report.to_dict(),
    ),
    "MicroBatchFinder": Case(
        lambda mp: callbacks.MicroBatchFinder(), observe=lambda cb: (cb.batch_size, cb.found, cb.size)
    ),
    "NonFiniteGuard": Case(
        lambda mp: callbacks.NonFiniteGuard(action="skip"),
        model=lambda: NaNLossModel(nan_batches=(1,)),
        observe=lambda cb: {"nonfinite_losses": cb.nonfinite_losses},
    ),
    "Parallelize": Case(
        lambda mp: callbacks.Parallelize(block_classes=["Linear"], activation_checkpointing=True),
        stateless="parallelizes the model again in every fit's `configure_model`",
    ),
    "Preflight": Case(lambda mp: callbacks.Preflight(), stateless="checks the machine again before every fit"),
    "RunStats": Case(lambda mp: callbacks.RunStats(), observe=lambda cb: cb.state_dict()),  # the accumulation
    "SkippedStepGuard": Case(
        lambda mp: callbacks.SkippedStepGuard(),
        model=lambda: InfGradModel(inf_batches=(1,)),
        trainer=lambda: {"plugins": [_fp16()]},
        observe=lambda cb: {"skipped_steps": cb.skipped_steps},
    ),
    "StopOnSignal": Case(
        lambda mp: callbacks.StopOnSignal(),
        stateless="acts on signals to the running process; the checkpoint it saves carries the others' state",
    ),
    "LRScaling": Case(lambda mp: callbacks.LRScaling("sqrt", reference_global_batch=8)),
}


def _fit(case: Case, callback: pl.Callback, root: str) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        callbacks=[*case.helpers(callback), callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        log_every_n_steps=1,
        **case.trainer(),
    )
    trainer.fit(case.model(), tiny_loader())
    return trainer


def check_state_round_trip(name: str, case: Case, fitted: pl.Callback, fresh: pl.Callback) -> None:
    """`fitted`'s state, saved and loaded into `fresh` (a new callback), is all there again.

    For a callback with state, the fits must have moved it off a new callback's (else the round trip proves nothing).
    """
    state = fitted.state_dict()
    if case.stateless:
        assert state == {}, f"{name} is listed as stateless ({case.stateless}) but saves {state}"
        overrides = [
            hook
            for hook in ("state_dict", "load_state_dict")
            if getattr(type(fitted), hook) is not getattr(pl.Callback, hook)
        ]
        assert not overrides, f"{name} is listed as stateless but overrides {overrides}: give it a case with state"
        return
    assert state != fresh.state_dict(), f"the fits left {name}'s state where a new one starts: {state}"
    fresh.load_state_dict(pickle.loads(pickle.dumps(state)))  # as a checkpoint stores it
    assert fresh.state_dict() == state, f"{name} lost state in the round trip"
    assert case.observe(fresh) == case.observe(fitted), f"{name} saved its state but a resumed run does not see it"


def test_every_exported_callback_is_in_the_suite() -> None:
    assert sorted(callbacks.__all__) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_constructible_and_picklable(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    callback = CASES[name].make(monkeypatch)
    assert isinstance(callback, pl.Callback)
    assert type(pickle.loads(pickle.dumps(callback))) is type(callback)


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_fits_in_a_row_and_state_round_trip(name: str, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    case = CASES[name]
    callback = case.make(monkeypatch)
    first = _fit(case, callback, str(tmp_path / "first"))
    second = _fit(case, callback, str(tmp_path / "second"))
    assert first.global_step > 0 and second.global_step == first.global_step
    check_state_round_trip(name, case, callback, case.make(monkeypatch))
    assert type(pickle.loads(pickle.dumps(callback))) is type(callback)  # still picklable after fitting


# --- the round trip catches a callback that loses state ---------------------------------------------------------------


class _ForgetsItsCount(callbacks.NonFiniteGuard):
    """Drops `nonfinite_losses` when it loads: a resumed run would count from 0."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "nonfinite_losses"})


class _EchoesButForgets(callbacks.SkippedStepGuard):
    """Saves again what it loaded, but never restores `skipped_steps` from it."""

    def state_dict(self) -> dict[str, Any]:
        return getattr(self, "_loaded", None) or super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict)


@pytest.mark.parametrize(
    ("name", "lossy", "message"),
    [
        ("NonFiniteGuard", lambda mp: _ForgetsItsCount(action="skip"), "NonFiniteGuard lost state"),
        ("SkippedStepGuard", lambda mp: _EchoesButForgets(), "a resumed run does not see it"),
    ],
    ids=["drops-a-field", "echoes-what-it-loaded"],
)
def test_the_round_trip_fails_for_a_callback_that_loses_state(
    name: str,
    lossy: Callable[[pytest.MonkeyPatch], pl.Callback],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path,
) -> None:
    case = dataclasses.replace(CASES[name], make=lossy)
    callback = case.make(monkeypatch)
    _fit(case, callback, str(tmp_path))
    with pytest.raises(AssertionError, match=message):
        check_state_round_trip(name, case, callback, case.make(monkeypatch))


def test_the_round_trip_fails_when_the_fit_left_the_state_untouched(tmp_path, monkeypatch) -> None:
    case = dataclasses.replace(CASES["NonFiniteGuard"], model=TinyRegression)  # no NaN loss: nothing counted
    callback = case.make(monkeypatch)
    _fit(case, callback, str(tmp_path))
    with pytest.raises(AssertionError, match="left NonFiniteGuard's state where a new one starts"):
        check_state_round_trip("NonFiniteGuard", case, callback, case.make(monkeypatch))


def test_a_callback_listed_stateless_may_not_save_state(tmp_path, monkeypatch) -> None:
    case = dataclasses.replace(CASES["NonFiniteGuard"], stateless="(wrongly)")
    callback = case.make(monkeypatch)
    _fit(case, callback, str(tmp_path))
    with pytest.raises(AssertionError, match="listed as stateless"):
        check_state_round_trip("NonFiniteGuard", case, callback, case.make(monkeypatch))
