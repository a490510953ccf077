"""StopOnSignal in one process: a signal stops at the next batch with last.ckpt and exit 128 + N; handlers restored."""

from __future__ import annotations

import os
import signal
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _tiny import TinyRegression, tiny_loader
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_accel.callbacks import StopOnSignal
from lightning_accel.callbacks.stop_on_signal import SignalExit, parse_signals
from lightning_accel.errors import ConfigError, LightningAccelWarning


class _Tiny(TinyRegression):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", self.loss(batch))


class _SendAt(pl.Callback):
    """Sends `signum` to this process after training batch `at` (or validation batch `at` when `stage="val"`)."""

    def __init__(self, signum: int, at: int, stage: str = "train", times: int = 1) -> None:
        self.signum, self.at, self.stage, self.times = signum, at, stage, times

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.stage == "train" and trainer.global_step == self.at:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)

    def on_validation_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.stage == "val" and args[-1 if isinstance(args[-1], int) else -2] == self.at:
            os.kill(os.getpid(), self.signum)


def _loader() -> DataLoader:
    return tiny_loader(64)


def _trainer(tmp_path, *callbacks: pl.Callback, **kwargs: Any) -> pl.Trainer:
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, monitor=None)
    options = dict(
        accelerator="cpu",
        max_steps=40,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return pl.Trainer(callbacks=[*callbacks, checkpoint], **options)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_at_the_next_step_with_last_ckpt_and_exit_128_plus_n(tmp_path, signum: int) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    trainer = _trainer(tmp_path, StopOnSignal(), _SendAt(signum, at=5))
    with pytest.raises(SignalExit) as stopped:
        trainer.fit(_Tiny(), _loader())
    assert stopped.value.code == 128 + signum
    assert trainer.global_step == 6  # the batch in flight finished, none after it
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True, map_location="cpu")
    assert saved["global_step"] == 6
    assert {s: signal.getsignal(s) for s in before} == before

    resumed = _trainer(tmp_path, StopOnSignal(), max_steps=9)
    resumed.fit(_Tiny(), _loader(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed.global_step == 9


def test_without_the_callback_lightning_ends_a_sigterm_run_with_exit_code_zero(tmp_path) -> None:
    """What the callback fixes: Lightning's SIGTERMException is a SystemExit with code 0."""
    trainer = _trainer(tmp_path, _SendAt(signal.SIGTERM, at=5))
    with pytest.raises(SystemExit) as stopped:
        trainer.fit(_Tiny(), _loader())
    assert stopped.value.code in (None, 0)


def test_a_signal_during_validation_stops_at_the_next_validation_batch(tmp_path) -> None:
    trainer = _trainer(tmp_path, StopOnSignal(), _SendAt(signal.SIGTERM, at=2, stage="val"), val_check_interval=4)
    with pytest.raises(SignalExit) as stopped:
        trainer.fit(_Tiny(), _loader(), _loader())
    assert stopped.value.code == 143
    assert trainer.global_step == 4


def test_a_repeated_sigint_within_a_second_is_one_event_and_stops_cleanly(tmp_path) -> None:
    trainer = _trainer(tmp_path, StopOnSignal(), _SendAt(signal.SIGINT, at=3, times=2))
    with pytest.raises(SignalExit):
        trainer.fit(_Tiny(), _loader())
    assert trainer.global_step == 4


def test_signals_outside_a_stage_keep_their_own_handlers(tmp_path) -> None:
    """Between fits the callback holds no handler: a plain Ctrl-C in a notebook still raises KeyboardInterrupt."""
    # Python's own Ctrl-C handler, as a notebook has it: pytest started in the background by a shell inherits SIGINT
    # ignored, which would hide a callback that leaves SIG_IGN behind.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        callback = StopOnSignal()
        _trainer(tmp_path, callback, max_steps=2).fit(_Tiny(), _loader())
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
    assert callback._watchdog is None and callback._handlers is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"signals": ["SIGBOGUS"]}, "no signal"),
        ({"signals": ["SIGKILL"]}, "no process can catch"),
        ({"grace_s": 0}, "grace_s=0"),
        ({"save_checkpoint": "yes"}, "save_checkpoint='yes'"),
    ],
)
def test_bad_settings_name_the_argument(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        StopOnSignal(**kwargs)


def test_parse_signals_takes_names_short_names_and_numbers() -> None:
    assert parse_signals(["SIGTERM", "int", 10]) == [signal.SIGTERM, signal.SIGINT, 10]


class _SendAtBatch(pl.Callback):
    def __init__(self, signum: int, batch: int) -> None:
        self.signum, self.batch = signum, batch

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.batch:
            os.kill(os.getpid(), self.signum)


def test_a_signal_mid_window_stops_when_the_window_closes(tmp_path) -> None:
    """4 micro-batches per step: a signal at batch 5 stops after batch 7, the window's last, so the checkpoint holds
    whole optimizer steps only."""
    trainer = _trainer(tmp_path, StopOnSignal(), _SendAtBatch(signal.SIGTERM, batch=5), accumulate_grad_batches=4)
    with pytest.raises(SignalExit):
        trainer.fit(_Tiny(), _loader())
    assert trainer.global_step == 2 and trainer.fit_loop.epoch_loop.batch_progress.current.processed == 8
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True, map_location="cpu")
    assert saved["global_step"] == 2


class _Logged(_Tiny):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss if isinstance(loss, torch.Tensor) else loss["loss"])
        return loss


def test_a_stop_loses_no_logged_step(tmp_path) -> None:
    """SIGTERM at step 5 of a plain script: the CSV holds the row of every step that ran (Lightning logs a step's
    metrics after `on_train_batch_end`, where the stop is agreed; the exit waits for them and flushes the logger)."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path / "logs")
    trainer = _trainer(tmp_path, StopOnSignal(), _SendAt(signal.SIGTERM, at=5), logger=logger, log_every_n_steps=1)
    with pytest.raises(SignalExit):
        trainer.fit(_Logged(), _loader())
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True, map_location="cpu")
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        steps = [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]
    assert ckpt["global_step"] == trainer.global_step == 6
    assert steps == list(range(ckpt["global_step"])), steps  # rows of steps 0..5: the six steps that ran


@pytest.mark.parametrize("save_checkpoint", [True, False])
def test_no_model_checkpoint_to_save_through_is_said_before_the_first_step(save_checkpoint: bool, tmp_path) -> None:
    """A Trainer without a ModelCheckpoint (`enable_checkpointing=False`, the zoo's): a signal could save nothing."""
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[StopOnSignal(save_checkpoint=save_checkpoint)],
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(TinyRegression(seed=0), tiny_loader())
    said = [
        w for w in record if issubclass(w.category, LightningAccelWarning) and "no ModelCheckpoint" in str(w.message)
    ]
    assert len(said) == (1 if save_checkpoint else 0)


class _Child:
    """A child rank as Lightning's `ddp` launcher holds it (a Popen): records the signals sent to it."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def poll(self) -> None:
        return None

    def send_signal(self, signum: int) -> None:
        self.sent.append(signum)


def _held_by(callback: StopOnSignal, local_rank: int, child: _Child) -> None:
    from types import SimpleNamespace

    launcher = SimpleNamespace(procs=[child])
    callback._trainer = SimpleNamespace(local_rank=local_rank, strategy=SimpleNamespace(launcher=launcher))  # type: ignore[assignment]


def test_a_second_signal_is_said_and_a_third_ends_at_once_with_the_child_ranks(monkeypatch, capfd) -> None:
    """A second Ctrl-C a second after the first raised KeyboardInterrupt (Lightning's shutdown, exit 1); a third was
    no different from the second."""
    from lightning_accel import signals

    class Ended(Exception):
        pass

    def ended(code: int) -> None:
        raise Ended(code)

    signals.forget_stop()
    monkeypatch.setattr(os, "_exit", ended)
    callback, child = StopOnSignal(), _Child()
    _held_by(callback, 0, child)
    callback._on_signal(signal.SIGTERM, None)
    assert callback.received == signal.SIGTERM and child.sent == [signal.SIGTERM]  # forwarded, as before
    callback._on_signal(signal.SIGINT, None)
    assert (
        "SIGINT again: the stop goes on and the process exits 143 once the checkpoint is written"
        in capfd.readouterr().err
    )
    with pytest.raises(Ended) as third:
        callback._on_signal(signal.SIGINT, None)
    assert third.value.args == (143,) and child.sent == [signal.SIGTERM, signal.SIGKILL]
    assert "SIGINT a third time: ending at once with exit 143" in capfd.readouterr().err
    signals.forget_stop()


def test_a_launched_rank_takes_rank_zeros_forwarded_copy_as_the_same_signal(monkeypatch) -> None:
    """`kill -TERM` to the group reaches a child rank twice (its own, and rank 0's forwarded copy): one event."""
    from lightning_accel import signals

    signals.forget_stop()
    monkeypatch.setattr(os, "_exit", lambda code: pytest.fail(f"ended at once with {code}"))
    callback, child = StopOnSignal(), _Child()
    _held_by(callback, 1, child)
    for _ in range(3):  # its own, rank 0's copy, then rank 0's copy of a second `kill` within the second
        callback._on_signal(signal.SIGTERM, None)
    assert signals.stop_signal() == signal.SIGTERM and child.sent == [signal.SIGTERM]
    signals.forget_stop()
