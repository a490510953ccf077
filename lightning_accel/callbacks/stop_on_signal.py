"""Ends every rank at the same step on SIGTERM, SIGINT or SLURM's requeue signal: a checkpoint, then exit 128 + N."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel import _lightning
from lightning_accel.errors import ConfigError, LightningAccelWarning
from lightning_accel.signals import SignalExit, clear_signal, forget_stop, insist, note_signal, pending_signal

__all__ = [
    "SignalExit",
    "StopOnSignal",
    "agree",
    "parse_signals",
    "pending_signal",
]

_FORWARDED_S = 1.0  # in a rank launched by rank 0, the same signal again this soon after the first is rank 0's
# forwarded copy of the same event (`kill -TERM` to the whole group reaches it twice), not a user insisting


def parse_signals(names: Sequence[str | int]) -> list[int]:
    """Signal numbers from names (`"SIGTERM"`, `"TERM"`) or numbers.

    Raises:
        ConfigError: for a name that is no signal, or SIGKILL/SIGSTOP, which no process can catch.
    """
    if isinstance(names, (str, int)):
        names = [names]
    numbers = []
    for name in names:
        text = str(name).upper()
        try:
            attr = text if text.startswith("SIG") else f"SIG{text}"
            number = int(name) if isinstance(name, int) or text.isdigit() else int(getattr(signal, attr))
            signal.Signals(number)
        except (AttributeError, ValueError):
            raise ConfigError(f"`signals` holds {name!r}, which is no signal here; use names like 'SIGTERM'.") from None
        if number in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(f"`signals` holds {name!r}, which no process can catch; leave it out.")
        numbers.append(number)
    return numbers


def agree(signum: int, requeue: bool = False, group: Any = None) -> tuple[int, bool]:
    """The largest stop signal any rank received (0: none) and whether any got the requeue signal, the same on
    every rank: one all-reduce on a gloo group (CPU tensors, no GPU sync), which every rank joins."""
    import torch.distributed as dist

    flags = torch.tensor([signum, int(requeue)], dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return int(flags[0]), bool(flags[1])


def _window_closed(trainer: pl.Trainer) -> bool:
    """Whether the batch that just ended closed an accumulation window (the optimizer stepped); True where the loop
    does not say (the loop's own answer is the same on every rank)."""
    return not _lightning.accumulating(trainer)


class StopOnSignal(Callback):
    """Stops training on every rank at the same step when any rank receives SIGTERM or SIGINT, keeping a checkpoint.

    Lightning's own SIGTERM handler broadcasts from inside the signal handler, a collective that the other ranks are
    not in, so a signal to one rank of a DDP job can hang all of them, and its `SIGTERMException` exits with 0. This
    callback takes over SIGTERM and SIGINT (and, on SLURM with auto-requeue, the requeue signal, SIGUSR1 by default)
    for each stage of the Trainer and:

    1. in the handler, only notes the signal (no collective, no I/O, no lock); on rank 0 of a job Lightning launched
       it forwards SIGTERM to the child ranks (a terminal's Ctrl-C reaches them all already). A second SIGINT or
       SIGTERM is said and changes nothing (the process still exits 128 + N once the checkpoint is written); a third
       ends the process at once with 128 + N (rank 0 kills the child ranks it started), without a new checkpoint;
    2. after each training batch that closes an accumulation window (so no window is cut), all ranks agree on a CPU
       all-reduce whether any rank received a signal (a gloo group beside NCCL, so no GPU sync), so they stop at the
       same step;
    3. then saves `last.ckpt` through the first `ModelCheckpoint` (atomically, see `AtomicCheckpointIO`), or, for the
       SLURM requeue signal, Lightning's `hpc_ckpt_<n>.ckpt` and `scontrol requeue` (the requeued job resumes from
       it), lets Lightning log that step's metrics (it logs them after `on_train_batch_end`), flushes every logger,
       and raises `SignalExit` on every rank at the next hook (the next batch's start, validation, the epoch's or the
       fit's end): exit code 128 + N (143 for SIGTERM, 130 for SIGINT, 138 for SIGUSR1). No logged step is lost;
    4. on more than one rank, a watchdog thread (started with the stage) ends the process with that code if it still
       runs `grace_s` after the signal, or after the agreement (the save counts from there): a rank stuck in data
       loading, a collective with a dead peer, a long validation.

    The handler is installed in `setup`, before anything slow runs (the DataLoaderTuner's trials in `on_fit_start`,
    MicroBatchFinder's first batches, compiling at the first forward, the sanity check), and Lightning's own SIGTERM
    handler is never registered while it runs (its registration is patched to leave ours in place). A signal before
    the first training batch of a new fit has ended, when there is nothing to save, ends the process at once with
    `SignalExit` (from the handler: a compile or a tuner's trial does not hold it; rank 0 forwards the signal, so
    every rank ends); the tuner's trials also check `pending_signal` between steps. Under one process a signal
    during validation, test or predict stops at the next batch (without a new checkpoint: the last one stays); under
    several, training stops at the next closed window and other stages by the watchdog.

    Keeps identical: every fit that receives no signal (the zoo); with a signal, every step up to the one it stops at,
        and no accumulation window is cut.
    Changes on purpose: on SIGTERM/SIGINT the fit ends at the next window boundary with `last.ckpt` and exits 128 + N
        (Lightning's own handler exits 0 and may hang DDP ranks); a second signal meanwhile is said and still exits
        128 + N once the checkpoint is written, a third ends the process at once (rank 0 kills the child ranks it
        started).
    Cannot serve: without a `ModelCheckpoint` in the Trainer nothing can be saved: `save_checkpoint=True` then warns
        at the start of the fit, and the signal still stops it.

    Logs:
        nothing; the stop is reported at INFO.

    Args:
        signals: the signals that stop the run, by name or number.
        grace_s: seconds after the signal before the watchdog ends a rank of a multi-rank job.
        save_checkpoint: save `last.ckpt` before stopping (needs a `ModelCheckpoint`; without one nothing is saved).
        requeue_on_slurm: handle the SLURM requeue signal (`SLURMEnvironment.requeue_signal`) when Lightning runs
            under SLURM with auto-requeue: save Lightning's HPC checkpoint and requeue, at a step all ranks agree on.

    Raises:
        ConfigError: for an unknown or uncatchable signal, a `grace_s` that is not positive.

    Example::

        trainer = Trainer(strategy="ddp", devices=4, callbacks=[ModelCheckpoint(save_last=True), StopOnSignal()])
        trainer.fit(model)  # `kill -TERM <any rank>`: every rank saves last.ckpt and exits 143 within seconds
    """

    def __init__(
        self,
        signals: Sequence[str | int] = ("SIGTERM", "SIGINT"),
        grace_s: float = 20.0,
        save_checkpoint: bool = True,
        requeue_on_slurm: bool = True,
    ) -> None:
        self.signals = parse_signals(signals)
        if not isinstance(grace_s, (int, float)) or isinstance(grace_s, bool) or not grace_s > 0:
            raise ConfigError(f"`grace_s={grace_s!r}` must be a positive number of seconds (e.g. 20).")
        for name, value in {"save_checkpoint": save_checkpoint, "requeue_on_slurm": requeue_on_slurm}.items():
            if not isinstance(value, bool):
                raise ConfigError(f"`{name}={value!r}` must be true or false.")
        self.grace_s = float(grace_s)
        self.save_checkpoint = save_checkpoint
        self.requeue_on_slurm = requeue_on_slurm
        self._reset()

    def _reset(self) -> None:
        self.received = 0
        """The first stop signal this rank received and has not acted on yet (0: none)."""
        self._received_at = 0.0
        self._requeue = False  # the SLURM requeue signal arrived
        self._handlers: ExitStack | None = None
        self._stage: str | None = None
        self._trainer: pl.Trainer | None = None
        self._group: Any = None
        self._requeue_signal: int | None = None
        self._deadline: float | None = None  # when the watchdog ends this rank (monotonic seconds)
        self._watchdog: threading.Thread | None = None
        self._stop_watchdog = threading.Event()
        self._patches: ExitStack | None = None  # the undo of the patch of Lightning's signal registration
        self._before_training = False  # from setup to the first training batch's end of a fit: nothing to save
        self._exit_with = 0  # the agreed stop's signal, raised at the next hook, once the step's metrics are logged

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(
            _handlers=None, _trainer=None, _group=None, _watchdog=None, _stage=None, _stop_watchdog=None, _patches=None
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._stop_watchdog = threading.Event()

    # -- handlers, installed per stage after Lightning registers its own (Trainer._run, after on_fit_start) --------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        import torch.distributed as dist

        self._trainer = trainer  # `received` is kept: a signal not acted on in fit still stops the next stage
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized() and self._group is None:
            # every rank runs setup, in the same order: creating the group is itself a collective
            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        environment = _lightning.cluster_environment(trainer)
        self._requeue_signal = None
        if self.requeue_on_slurm and environment is not None and getattr(environment, "auto_requeue", False):
            self._requeue_signal = int(environment.requeue_signal)
        self._before_training = stage == "fit" and trainer.global_step == 0 and not self.received
        if not self.received:
            forget_stop()  # a stop of an earlier fit in this process (a notebook's) no longer counts
        self._install(stage)  # before on_fit_start: the tuner's trials, a search, compiling, the sanity check
        self._keep_lightning_off(trainer)

    def _keep_lightning_off(self, trainer: pl.Trainer) -> None:
        """Lightning registers its SIGTERM handler after `on_fit_start` (it would broadcast inside the handler and
        exit 0): its registration is patched to leave ours in place (and to register only SLURM's requeue handler
        when this callback leaves requeueing to Lightning). Undone at teardown and on an exception."""
        connector = _lightning.signal_connector(trainer)
        if connector is None or self._patches is not None:
            return
        original = connector.register_signal_handlers

        def register() -> None:
            connector.received_sigterm = False
            if not self.requeue_on_slurm:  # Lightning's SIGUSR1 requeue, then ours back on SIGTERM
                original()
                _lightning.forget_lightning_sigterm_handler(connector)
            self._reassert()

        self._patches = ExitStack()
        self._patches.callback(
            _lightning.patch_signal_registration(connector, register, "StopOnSignal's handler for the whole run")
        )

    def _reassert(self) -> None:
        """Our handler on every signal we took over, where something replaced it since `_install`."""
        if self._handlers is None or threading.current_thread() is not threading.main_thread():
            return
        for number in dict.fromkeys([*self.signals, *([self._requeue_signal] if self._requeue_signal else [])]):
            if signal.getsignal(number) != self._on_signal:
                signal.signal(number, self._on_signal)

    def _install(self, stage: str) -> None:
        if self._handlers is not None or threading.current_thread() is not threading.main_thread():
            return
        stack = ExitStack()
        numbers = [*self.signals, *([self._requeue_signal] if self._requeue_signal else [])]
        for number in dict.fromkeys(numbers):
            previous = signal.signal(number, self._on_signal)
            stack.callback(self._restore_one, number, previous)
        self._handlers, self._stage = stack, stage
        if self._trainer is not None and self._trainer.world_size > 1 and self._watchdog is None:
            # started here, not in the handler: starting a thread inside a signal handler can deadlock
            self._stop_watchdog.clear()
            self._watchdog = threading.Thread(target=self._watch, name="StopOnSignal-watchdog", daemon=True)
            self._watchdog.start()

    def _restore_one(self, number: int, previous: Any) -> None:
        if signal.getsignal(number) == self._on_signal:  # Lightning's teardown may already have put its own back
            signal.signal(number, previous)

    def _uninstall(self, stage: str | None = None) -> None:
        if self._handlers is not None and (stage is None or stage == self._stage):
            self._handlers.close()
            self._handlers, self._stage = None, None
            if not self.received:
                clear_signal()
            if not self.received and self._watchdog is not None:  # after a signal it guards the way out
                self._stop_watchdog.set()
                self._watchdog = None
        if stage is None and self._patches is not None:
            self._patches.close()
            self._patches = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Only notes the signal: no collective, no I/O, no lock (it runs between two bytecodes of the main thread)."""
        now = time.monotonic()
        if signum == self._requeue_signal:
            self._requeue = True  # no deadline: SLURM sends SIGTERM at the limit, and that one has its own
            return
        if self.received:
            trainer = self._trainer
            launched = trainer is not None and trainer.local_rank > 0
            if launched and signum == self.received != signal.SIGINT and now - self._received_at < _FORWARDED_S:
                return  # rank 0's forwarded copy of the signal this rank already got
            count = note_signal(signum)
            if count >= 3:  # the user insists: no checkpoint, no agreement; the child ranks go too
                self._signal_child_ranks(signal.SIGKILL)
            insist(signum, count, "StopOnSignal")  # the second is said; the third ends the process here
            return
        self.received, self._received_at = signum, now
        note_signal(signum)
        if signum != signal.SIGINT:  # a terminal's Ctrl-C reaches every rank already; `kill` reaches one
            self._signal_child_ranks(signum)
        self._deadline = now + self.grace_s
        if self._before_training:  # nothing trained yet, so nothing to save: end now (a compile would hold it)
            self._uninstall()
            raise SignalExit(signum)

    def _signal_child_ranks(self, signum: int) -> None:
        """Send `signum` to the child ranks Lightning started (rank 0 of a `ddp` job only; none elsewhere)."""
        trainer = self._trainer
        launcher = getattr(trainer.strategy, "launcher", None) if trainer is not None else None
        for proc in getattr(launcher, "procs", None) or ():
            if callable(getattr(proc, "poll", None)) and proc.poll() is None:  # ddp's Popen (spawn: none here)
                proc.send_signal(signum)

    def _watch(self) -> None:
        while not self._stop_watchdog.wait(0.25):
            deadline = self._deadline
            if deadline is not None and self.received and time.monotonic() > deadline:
                _end_process(self.received, self.grace_s)

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install("fit")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install("fit")
        checkpoints = [cb for cb in _lightning.trainer_callbacks(trainer) if isinstance(cb, ModelCheckpoint)]
        if self.save_checkpoint and not checkpoints and trainer.global_step == 0:
            rank_zero_warn(
                "StopOnSignal: the Trainer has no ModelCheckpoint, so a signal stops the fit without saving "
                "`last.ckpt`; add ModelCheckpoint(save_last=True) (or keep `enable_checkpointing=True`), or pass "
                "`save_checkpoint=False` to stop without saving.",
                category=LightningAccelWarning,
            )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._exit_if_agreed(trainer)
        self._uninstall("fit")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._exit_if_agreed(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._exit_if_agreed(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._exit_if_agreed(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            self._install("validate")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._uninstall("validate")

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install("test")

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._uninstall("test")

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install("predict")

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._uninstall("predict")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._uninstall()  # Lightning skips teardown after an exception
        if isinstance(exception, SignalExit) and trainer.world_size == 1:
            self.received, self._requeue = 0, False  # acted on: a later fit in this process starts clean

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._uninstall()

    # -- the checks ----------------------------------------------------------------------------------------------

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._before_training = False  # from here a stop saves a checkpoint at a step all ranks agree on
        if not _window_closed(trainer):  # stopping mid-accumulation would resume with a part of the window's gradients
            return
        signum, requeue = self.received, self._requeue
        if self._group is not None:  # the same batches on every rank, so every rank joins this all-reduce
            signum, requeue = agree(signum, requeue, self._group)
        if not (signum or requeue):
            return
        if trainer.world_size > 1:
            self._deadline = time.monotonic() + self.grace_s  # from here: the save, then the way out
        # Lightning logs this step's metrics after this hook: the exit waits for the next hook, so no row is lost
        self._exit_with = self._save(trainer, signum, requeue, save=self.save_checkpoint)

    def _save(self, trainer: pl.Trainer, signum: int, requeue: bool, save: bool) -> int:
        """The agreed stop's checkpoint (or the SLURM requeue's); returns the signal the process exits with."""
        _quiet_child_observer()  # the child ranks exit 128 + N too, by agreement, not as a failure
        if requeue:
            assert self._requeue_signal is not None
            signum = self._requeue_signal
            rank_zero_info(f"StopOnSignal: {signal.Signals(signum).name}: saving the HPC checkpoint and requeueing")
            _lightning.requeue_on_slurm(trainer, signum)
        elif save:
            _save_last(trainer)
        rank_zero_info(
            f"StopOnSignal: {signal.Signals(signum).name} received; every rank stops at global step "
            f"{trainer.global_step} (exit {128 + signum})"
        )
        return signum

    def _exit_if_agreed(self, trainer: pl.Trainer) -> None:
        """Raise the agreed stop, after flushing every logger (a buffered row would be lost with the process)."""
        if not self._exit_with:
            return
        signum, self._exit_with = self._exit_with, 0
        clear_signal()
        _flush_loggers(trainer)
        raise SignalExit(signum)

    def _stop(self, trainer: pl.Trainer, signum: int, requeue: bool, save: bool) -> None:
        self._exit_with = self._save(trainer, signum, requeue, save)
        self._exit_if_agreed(trainer)

    def _check_alone(self, trainer: pl.Trainer) -> None:
        """One process, outside a training batch: stop at once (the requeue still saves and requeues)."""
        if (self.received or self._requeue) and trainer.world_size == 1:
            self._stop(trainer, self.received, self._requeue, save=False)

    @override
    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kw: Any
    ) -> None:
        self._check_alone(trainer)

    @override
    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kw: Any) -> None:
        self._check_alone(trainer)

    @override
    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kw: Any) -> None:
        self._check_alone(trainer)


def _save_last(trainer: pl.Trainer) -> None:
    """`last.ckpt` through the first ModelCheckpoint, on every rank (saving is a collective under DDP and FSDP)."""
    checkpoint = next((cb for cb in _lightning.trainer_callbacks(trainer) if isinstance(cb, ModelCheckpoint)), None)
    if checkpoint is None or checkpoint.dirpath is None:
        return
    # "link" would only point at an older checkpoint
    if not (checkpoint.save_last is True and _lightning.save_last_checkpoint(checkpoint, trainer)):
        trainer.save_checkpoint(
            os.path.join(checkpoint.dirpath, f"{checkpoint.CHECKPOINT_NAME_LAST}{checkpoint.FILE_EXTENSION}")
        )


def _flush_loggers(trainer: pl.Trainer) -> None:
    """Write what every logger still buffers (CSVLogger keeps rows in memory between saves); a logger that fails is
    skipped: the stop goes on."""
    for logger in trainer.loggers:
        try:
            logger.save()
        except Exception as err:  # flushing must not stop the way out
            rank_zero_info(f"StopOnSignal: {type(logger).__name__}.save() failed: {type(err).__name__}: {err}")


def _quiet_child_observer() -> None:
    """Lightning's launcher (rank 0 of a job it started) polls the child ranks every 5 s and SIGKILLs every process,
    rank 0 included, when one exits non-zero: the children's agreed exit 128 + N would turn rank 0's own exit into
    -9 whenever it ends a poll later than they do. Its `child-process-observer` thread is told it is done (a Lightning
    internal; absent elsewhere, nothing happens); the watchdog still bounds the way out."""
    _lightning.quiet_child_process_observer()


def _end_process(signum: int, grace_s: float) -> None:
    name = signal.Signals(signum).name
    message = f"StopOnSignal: {name} and {grace_s:.0f} s later this rank still runs; exit {128 + signum}\n"
    os.write(2, message.encode())  # not print: the main thread may hold stderr's lock
    os._exit(128 + signum)
