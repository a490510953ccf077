"""One fit of a zoo module, recorded: optimizer steps, `training_step` calls, final weights, every logged value,
the LR of every optimizer step, the warnings of lightning_accel and Lightning with the optimizer step they came at,
and the error that ended the fit, if one did."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from zoo_modules import ZooEntry

# What a callback logs about itself: left out when a fit's metrics are compared with the fit without it.
OWN_KEYS = (
    "micro_batch/",
    "train/accumulation",
    "dataloader_tuner/",
    "train/nonfinite",
    "train/skipped",
    "gpu",
    "lr-",  # LearningRateMonitor, in accel-train's default set
)


class MemoryLogger(Logger):
    """Every logged value, by step, in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    @property
    @rank_zero_experiment
    def experiment(self) -> None:
        return None

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        kept = {k: float(v) for k, v in metrics.items() if k != "epoch" and not k.startswith(OWN_KEYS)}
        if kept:
            self.history.append((-1 if step is None else int(step), kept))


class Recorder(pl.Callback):
    """Counts optimizer steps and keeps the LR each one used (every param group of every optimizer)."""

    def __init__(self) -> None:
        self.optimizer_steps = 0
        self.lrs: list[tuple[float, ...]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.optimizer_steps += 1
        self.lrs.append(tuple(float(group["lr"]) for group in optimizer.param_groups))


@dataclass
class Fit:
    """What one fit did."""

    optimizer_steps: int = 0
    training_steps: int = 0
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    lrs: list[tuple[float, ...]] = field(default_factory=list)
    logged: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    warnings: list[tuple[str, str, int]] = field(default_factory=list)
    """(category name, message, optimizer steps taken when it came)."""
    error: BaseException | None = None
    error_at_step: int | None = None


def _count_calls(module: pl.LightningModule, fit: Fit) -> None:
    """`training_step` counts its calls on the instance (the class stays as its author wrote it)."""
    step = module.training_step

    @functools.wraps(step)  # Lightning reads the signature (`batch_idx` or not)
    def counted(*args: Any, **kwargs: Any) -> Any:
        fit.training_steps += 1
        return step(*args, **kwargs)

    module.training_step = counted  # type: ignore[method-assign]


def fit(
    entry: ZooEntry,
    callbacks: Sequence[pl.Callback] = (),
    *,
    trainer: dict[str, Any] | None = None,
    adjust: Callable[[pl.LightningModule], None] | None = None,
    seed: int = 0,
) -> Fit:
    """Train `entry` from `seed` with `callbacks` (and the entry's own) on one CPU device; never raises."""
    pl.seed_everything(seed, verbose=False)
    module, loaders = entry.build()
    if adjust is not None:
        adjust(module)
    result = Fit()
    _count_calls(module, result)
    recorder, logger = Recorder(), MemoryLogger()
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": entry.max_epochs,
        "logger": logger,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,
        "deterministic": True,
    }
    settings.update(trainer or {})
    checkpointing = any(isinstance(cb, pl.callbacks.ModelCheckpoint) for cb in callbacks)
    if checkpointing:
        settings["enable_checkpointing"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("always")

        def record(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
            result.warnings.append((category.__name__, str(message), recorder.optimizer_steps))

        warnings.showwarning = record
        try:
            t = pl.Trainer(callbacks=[*entry.callbacks(), *callbacks, recorder], **settings)
            t.fit(module, **loaders)
        except BaseException as err:  # noqa: B036 - a signal test's SystemExit is a result too
            result.error, result.error_at_step = err, recorder.optimizer_steps
    result.optimizer_steps = recorder.optimizer_steps
    result.lrs = recorder.lrs
    result.logged = logger.history
    result.weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return result


def weight_difference(a: Fit, b: Fit) -> float:
    """The largest absolute difference between the two fits' final weights and buffers (inf for other keys)."""
    if a.weights.keys() != b.weights.keys():
        return float("inf")
    worst = 0.0
    for key, value in a.weights.items():
        other = b.weights[key]
        if value.shape != other.shape:
            return float("inf")
        if value.is_floating_point():
            worst = max(worst, float((value - other).abs().max()) if value.numel() else 0.0)
        elif not torch.equal(value, other):
            return float("inf")
    return worst


def logged_difference(a: Fit, b: Fit) -> float:
    """The largest absolute difference between the values both fits logged (inf when the keys or steps differ)."""
    if [(s, sorted(m)) for s, m in a.logged] != [(s, sorted(m)) for s, m in b.logged]:
        return float("inf")
    worst = 0.0
    for (_, ma), (_, mb) in zip(a.logged, b.logged, strict=True):
        for key, value in ma.items():
            other = mb[key]
            if value != other:
                worst = max(worst, abs(value - other) if value == value and other == other else float("inf"))
    return worst


def lr_difference(a: Fit, b: Fit) -> float:
    """The largest absolute difference between the LR curves (inf when their lengths differ)."""
    if len(a.lrs) != len(b.lrs) or any(len(x) != len(y) for x, y in zip(a.lrs, b.lrs, strict=True)):
        return float("inf")
    pairs = (pair for la, lb in zip(a.lrs, b.lrs, strict=True) for pair in zip(la, lb, strict=True))
    return max((abs(x - y) for x, y in pairs), default=0.0)
