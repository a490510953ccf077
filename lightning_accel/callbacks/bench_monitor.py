"""Measures one benchmark stage: step-time split, throughput, FLOPs, peak memory and the validation metric over time."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_accel.batches import data_parallel_replicas, samples_in
from lightning_accel.errors import ConfigError
from lightning_accel.files import atomic_write

__all__ = ["BenchMonitor", "StageMeasurement"]

MODES = ("min", "max")


@dataclass(kw_only=True)
class StageMeasurement:
    """What `BenchMonitor` writes for `accel-bench` (global rank zero's view; step times are rank zero's)."""

    world_size: int = 1
    data_parallel_size: int = 1
    """Ranks that load batches of their own (the distributed sampler's replicas); the others share them (pipeline
    stages, tensor-parallel ranks): MFU per device divides by `world_size / data_parallel_size`."""
    device: str = "cpu"
    """`torch.cuda.get_device_name` of rank zero's device, or "cpu"."""
    compute_capability: list[int] | None = None
    """CUDA compute capability of that device ([8, 0] and up have TF32); None on a CPU."""
    sm_count: int | None = None
    """Streaming multiprocessors of rank zero's device (a MIG slice's own); its share of the GPU's SMs scales the
    peak for MFU. None on a CPU."""
    precision: str = ""
    float32_matmul_precision: str = ""
    optimizer_steps: int = 0
    batches: int = 0
    """Training micro-batches on rank zero."""
    samples: int = 0
    """Training samples over all ranks."""
    tokens: int = 0
    """Training tokens over all ranks (batches whose first tensor is 2-D integer ids); 0 when not token data."""
    train_s: float = 0.0
    """Training time from the first batch to the end of the fit, validation passes excluded."""
    validation_s: float = 0.0
    steady_batches: int = 0
    """Batches after the warm-up, over which the rates below are measured (a run's last batches after the last
    synchronised one are left out on CUDA with `split_every_n_batches` > 1)."""
    steady_s: float = 0.0
    steady_samples: int = 0
    steady_tokens: int = 0
    split_batches: int = 0
    """Of the steady batches, those timed phase by phase (every one, or one in `split_every_n_batches`): the four
    parts below are their shares, scaled to `steady_s`."""
    data_s: float = 0.0
    """Of steady_s: waiting for the next batch (previous batch end to this batch start)."""
    forward_s: float = 0.0
    """Of steady_s: batch start to the loss (the forward pass, with the step's hooks)."""
    backward_s: float = 0.0
    """Of steady_s: backward, including DDP's gradient all-reduce where it does not overlap."""
    optimizer_s: float = 0.0
    """Of steady_s: after backward to the batch end: clipping, the optimizer step, zeroing gradients."""
    flops_per_batch: float | None = None
    """FLOPs of one forward + backward over rank zero's batch (model-declared or counted); None if unknown."""
    flops_source: str = ""
    peak_memory_bytes: int | None = None
    """CUDA: `max_memory_allocated`; CPU: the process's peak resident set (`ru_maxrss`)."""
    memory_total_bytes: int | None = None
    """The device's memory (CUDA), or the host's (CPU)."""
    memory_kind: str = ""
    gpu_utilization_pct: float | None = None
    """Mean NVML utilisation over the fit from a `GPUMonitor` in the same Trainer; None without one or a GPU."""
    micro_batch: int | None = None
    """Samples per forward on one device: the size MicroBatchFinder ran last, else the train loader's batch size."""
    micro_batch_auto: bool = False
    """Whether MicroBatchFinder chose it (then `micro_batch_recoveries` counts its out-of-memory recoveries)."""
    micro_batch_recoveries: int = 0
    loader: dict[str, Any] | None = None
    """The train DataLoader settings a `DataLoaderTuner` in the same Trainer applied (num_workers, prefetch_factor,
    pin_memory, persistent_workers); None without one, or when it left the loader alone."""
    metric: str = ""
    mode: str = "min"
    validations: list[dict[str, float]] = field(default_factory=list)
    """One entry per validation pass: `{"step", "train_s", "value"}`."""
    final_metric: float | None = None
    target: float | None = None
    time_to_target_s: float | None = None
    """train_s when the metric first reached `target`; None when it never did (or no target)."""
    energy_j: float | None = None
    """Energy over `train_s` (validation passes left out), in joules: on CUDA NVML's total energy counter of every GPU
    of rank zero's node that the run uses; on a CPU RAPL's package counters (the whole packages, other processes
    included). None when no counter can be read; `energy_note` says why."""
    energy_note: str = ""
    """The counter read, or why there is none."""


class BenchMonitor(Callback):
    """Times each training batch by phase and records what `accel-bench` puts in its table, then writes it as JSON.

    Per training micro-batch after `warmup_batches`: the wait for data (previous batch end to this batch start),
    forward (batch start to backward), backward (all-reduce included where it does not overlap) and the optimizer
    part (after backward to batch end). On CUDA each boundary synchronises the device (`sync_cuda`), so the split
    is real rather than launch time. A synchronisation stops the host from queueing the next kernels while the GPU
    runs, which costs a fast step (a compiled bf16 GPT step of 25 ms) its host overhead; `split_every_n_batches=10`
    times one batch in ten by phase and lets the others run unsynchronised, the rates then counted between
    synchronised batch ends. It also records samples and tokens, FLOPs per batch (the
    model's `flops_per_batch(batch_size)` when it has one, else counted once with `torch.utils.flop_counter`),
    peak memory, the validation metric after each validation pass (and the time it first reached `target`), and
    GPU utilisation from a `GPUMonitor` in the same Trainer, and the energy of training (`telemetry.energy`: NVML on
    CUDA, RAPL on a CPU, else n/a with the reason). Global rank zero writes `output_path` at the end of
    the fit. It logs nothing.

    Keeps identical: the math of every step (the zoo); it only reads clocks, memory and metrics.
    Changes on purpose: on CUDA it synchronises the device at the timed batches' phase boundaries (slower, not
        different); `stop_at_target` ends the fit when the target is reached.
    Cannot serve: under manual optimization the split of a step has no backward phase (its time counts as forward).

    Args:
        output_path: where the JSON goes (`StageMeasurement` as a dict); None: keep it in `measurement` only.
        metric: the validation metric to follow (a key of `trainer.callback_metrics`).
        mode: `min` when lower is better, `max` when higher is.
        target: the metric value that counts as reached; None: no target.
        stop_at_target: stop the fit when the target is reached.
        warmup_batches: first batches left out of the split and the rates (allocation, caches, worker start-up).
        sync_cuda: synchronise the CUDA device at each phase boundary.
        split_every_n_batches: on CUDA with `sync_cuda`, time one batch in this many by phase (synchronising around
            it) and leave the rest unsynchronised; 1: every batch. The throughput and MFU count whole intervals
            between synchronised batch ends, so queued work is never missed.
        count_flops: count the FLOPs of the first batch when the model declares none.
        validate_at_end: when the fit stops at `max_steps` after a batch that is not a validation batch, validate
            there too (through `trainer.should_stop`), so the final metric is the trained model's. Without it, a fit
            whose epochs end in a partial accumulation window (an extra optimizer step per epoch) can stop short of
            its last `val_check_interval` and report an earlier validation.

    Raises:
        ValueError: for an unknown `mode`, a negative `warmup_batches` or `split_every_n_batches` below 1.

    Example::

        trainer = Trainer(callbacks=[BenchMonitor("stage.json", metric="val/loss", target=2.0, stop_at_target=True)])
    """

    def __init__(
        self,
        output_path: str | Path | None = None,
        metric: str = "val/loss",
        mode: str = "min",
        target: float | None = None,
        stop_at_target: bool = False,
        warmup_batches: int = 2,
        sync_cuda: bool = True,
        split_every_n_batches: int = 1,
        count_flops: bool = True,
        validate_at_end: bool = True,
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"`mode={mode!r}` must be 'min' (lower is better) or 'max' (higher is better).")
        if isinstance(warmup_batches, bool) or not isinstance(warmup_batches, int) or warmup_batches < 0:
            raise ConfigError(f"`warmup_batches={warmup_batches!r}` must be an integer >= 0.")
        every = split_every_n_batches
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"`split_every_n_batches={every!r}` must be an integer >= 1 (1: every batch).")
        if stop_at_target and target is None:
            raise ConfigError("`stop_at_target=True` needs a `target` value of the metric.")
        self.output_path = None if output_path is None else str(output_path)
        self.metric = metric
        self.mode = mode
        self.target = None if target is None else float(target)
        self.stop_at_target = stop_at_target
        self.warmup_batches = warmup_batches
        self.sync_cuda = sync_cuda
        self.split_every_n_batches = split_every_n_batches
        self.count_flops = count_flops
        self.validate_at_end = validate_at_end
        self._reset()

    def _reset(self) -> None:
        self.measurement = StageMeasurement(metric=self.metric, mode=self.mode, target=self.target)
        self._cuda = False
        self._cuda_index = 0  # the rank's CUDA device, kept: Lightning moves the module to the CPU before on_fit_end
        self._start: float | None = None
        self._validation_started: float | None = None
        self._last_end: float | None = None
        self._marks: dict[str, float] = {}
        self._anchor: float | None = None  # the last synchronised batch end after the warm-up
        self._pending = [0, 0, 0]  # batches, samples and tokens since the anchor
        self._split_parts = [0.0, 0.0, 0.0, 0.0]  # data, forward, backward, optimizer of the batches timed by phase
        self._split_s = 0.0
        self._flop_counter: Any = None
        self._flops_tried = False
        self._energy: Any = None

    def _now(self, batch: int | None = None) -> float:
        """The time, after synchronising the CUDA device when `batch` (1-based) is timed by phase (None: always)."""
        if self._cuda and self.sync_cuda and (batch is None or self._timed(batch)):
            torch.cuda.synchronize()
        return time.perf_counter()

    def _timed(self, batch: int) -> bool:
        """Whether batch number `batch` (1-based) is timed by phase, synchronised at each of its boundaries."""
        return batch % self.split_every_n_batches == 0

    def _synced_end(self, batch: int) -> bool:
        """Whether the end of batch `batch` is synchronised: a timed batch's, and the one before it (its data wait
        starts there). Off CUDA, or without `sync_cuda`, every end counts as synchronised."""
        return not (self._cuda and self.sync_cuda) or self._timed(batch) or self._timed(batch + 1)

    def _train_clock(self) -> float:
        assert self._start is not None
        return time.perf_counter() - self._start - self.measurement.validation_s

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        m = self.measurement
        m.world_size = trainer.world_size
        m.precision = str(trainer.precision)
        m.float32_matmul_precision = torch.get_float32_matmul_precision()
        self._cuda = pl_module.device.type == "cuda"
        if self._cuda:
            index = self._cuda_index = pl_module.device.index or 0
            m.device = torch.cuda.get_device_name(index)
            m.compute_capability = list(torch.cuda.get_device_capability(index))
            m.sm_count = int(torch.cuda.get_device_properties(index).multi_processor_count)
            m.memory_total_bytes = int(torch.cuda.get_device_properties(index).total_memory)
            m.memory_kind = "CUDA max_memory_allocated"
            torch.cuda.reset_peak_memory_stats(index)
        else:
            import psutil

            m.device = "cpu"
            m.memory_total_bytes = int(psutil.virtual_memory().total)
            m.memory_kind = "peak RSS of rank 0"

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()
        self._last_end = self._anchor = None
        self.measurement.data_parallel_size = data_parallel_replicas(trainer)
        if trainer.is_global_zero:
            self._open_energy(trainer)

    def _open_energy(self, trainer: pl.Trainer) -> None:
        """Start the energy meter; a failure leaves energy n/a with the reason, never stops the fit."""
        from lightning_accel.telemetry.energy import open_energy_meter

        m = self.measurement
        try:
            indices = list(trainer.device_ids) if self._cuda else None
            self._energy, m.energy_note = open_energy_meter(indices)
        except Exception as err:
            self._energy, m.energy_note = None, f"the energy counter failed ({type(err).__name__}: {err})"
        if self._energy is not None:
            m.energy_note = self._energy.source + (f"; node 0 of {trainer.num_nodes}" if trainer.num_nodes > 1 else "")

    def _energy_step(self, action: str) -> None:
        if self._energy is None:
            return
        try:
            getattr(self._energy, action)()
        except Exception as err:  # a counter that fails mid-run: energy n/a, training goes on
            self._energy = None
            self.measurement.energy_note = f"the energy counter failed ({type(err).__name__}: {err})"

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        m = self.measurement
        now = self._now(m.batches + 1)
        self._marks = {"start": now}
        if self._last_end is not None:
            self._marks["data"] = now - self._last_end
        if not self._flops_tried:
            self._flops_tried = True
            self._declared_flops(pl_module, batch)
            if m.flops_per_batch is None and self.count_flops:
                from torch.utils.flop_counter import FlopCounterMode

                counter = FlopCounterMode(display=False)
                try:
                    counter.__enter__()
                    self._flop_counter = counter
                except Exception as err:  # MFU becomes n/a; training goes on
                    m.flops_source = f"not counted: {type(err).__name__}: {err}"

    def _declared_flops(self, pl_module: pl.LightningModule, batch: Any) -> None:
        declared = getattr(pl_module, "flops_per_batch", None)
        if not callable(declared):
            return
        try:
            self.measurement.flops_per_batch = float(declared(samples_in(batch)))
            self.measurement.flops_source = f"{type(pl_module).__name__}.flops_per_batch"
        except Exception:  # another signature than flops_per_batch(batch_size): count instead
            self.measurement.flops_per_batch = None

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._marks["forward_end"] = self._now(self.measurement.batches + 1)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._marks["backward_end"] = self._now(self.measurement.batches + 1)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        m = self.measurement
        batch_number = m.batches + 1
        synced = self._synced_end(batch_number)
        now = self._now(None if synced else batch_number)
        if self._flop_counter is not None:
            counter, self._flop_counter = self._flop_counter, None
            try:
                counter.__exit__(None, None, None)
                m.flops_per_batch = float(counter.get_total_flops()) or None
                m.flops_source = "torch.utils.flop_counter (first batch)"
            except Exception as err:
                m.flops_source = f"not counted: {type(err).__name__}: {err}"
        replicas = data_parallel_replicas(trainer)  # pipeline and tensor-parallel ranks share their batches
        samples = samples_in(batch) * replicas
        tokens = _batch_tokens(batch) * replicas
        m.batches += 1
        m.samples += samples
        m.tokens += tokens
        m.optimizer_steps = trainer.global_step
        marks, self._last_end = self._marks, now
        last_validated = m.validations[-1]["step"] if m.validations else None
        if self.validate_at_end and 0 < trainer.max_steps <= trainer.global_step != last_validated:
            trainer.should_stop = True  # Lightning validates a fit that stops early (every rank does the same)
        if m.batches < self.warmup_batches:
            return
        if m.batches > self.warmup_batches and self._anchor is not None:
            pending = self._pending
            pending[0], pending[1], pending[2] = pending[0] + 1, pending[1] + samples, pending[2] + tokens
            if self._timed(m.batches) and "data" in marks:
                start = marks["start"]
                forward_end = marks.get("forward_end", start)  # no backward: manual optimization or a skipped batch
                backward_end = marks.get("backward_end", forward_end)
                parts = (marks["data"], forward_end - start, backward_end - forward_end, now - backward_end)
                self._split_parts = [a + b for a, b in zip(self._split_parts, parts, strict=True)]
                self._split_s += marks["data"] + now - start
                m.split_batches += 1
        if synced:
            self._close_interval(now)
            self._anchor = now

    def _close_interval(self, now: float) -> None:
        """Count the batches since the anchor over the time since it, and rescale the split to `steady_s`."""
        m, (batches, samples, tokens) = self.measurement, self._pending
        if self._anchor is None or batches == 0:
            return
        m.steady_batches += batches
        m.steady_samples += samples
        m.steady_tokens += tokens
        m.steady_s += now - self._anchor
        self._pending = [0, 0, 0]
        if self._split_s > 0:
            scale = m.steady_s / self._split_s
            m.data_s, m.forward_s, m.backward_s, m.optimizer_s = (part * scale for part in self._split_parts)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._start is not None and not trainer.sanity_checking:
            self._validation_started = self._now()  # the training batches queued before it are training time
            self._close_interval(self._validation_started)
            self._anchor = None  # the next interval starts at the next synchronised batch end
            self._energy_step("pause")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._validation_started is None:
            return
        m = self.measurement
        m.validation_s += time.perf_counter() - self._validation_started
        self._validation_started = None
        self._energy_step("resume")
        self._last_end = None  # the next batch's wait is not a data wait
        logged = trainer.callback_metrics.get(self.metric)
        if logged is None:
            return
        value, train_s = float(logged), self._train_clock()
        m.validations.append({"step": trainer.global_step, "train_s": train_s, "value": value})
        m.final_metric = value
        if m.time_to_target_s is None and self.target is not None and _reached(value, self.target, self.mode):
            m.time_to_target_s = train_s
            if self.stop_at_target:
                trainer.should_stop = True

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        m = self.measurement
        if self._start is not None:
            if self._cuda and self.sync_cuda:
                torch.cuda.synchronize(self._cuda_index)  # the work queued by the last batches is training time
            m.train_s = self._train_clock()
        m.optimizer_steps = trainer.global_step
        if self._cuda:
            m.peak_memory_bytes = int(torch.cuda.max_memory_allocated(self._cuda_index))
        else:
            m.peak_memory_bytes = _peak_rss_bytes()
        m.gpu_utilization_pct = _gpu_utilization(trainer)
        _record_micro_batch(m, trainer)
        m.loader = _loader_decision(trainer)
        self._energy_step("pause")
        if self._energy is not None:
            m.energy_j = float(self._energy.joules)
            self._energy_step("close")
            self._energy = None
        if self.output_path and trainer.is_global_zero:
            atomic_write(self.output_path, json.dumps(asdict(m), indent=2, sort_keys=True) + "\n")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._flop_counter is not None:
            self._flop_counter.__exit__(None, None, None)
            self._flop_counter = None


def _reached(value: float, target: float, mode: str) -> bool:
    return value <= target if mode == "min" else value >= target


def _batch_tokens(batch: Any) -> int:
    """Tokens of a batch whose first tensor holds integer ids of shape (batch, seq); 0 otherwise."""
    first = batch
    while isinstance(first, (list, tuple, dict)) and first:
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
        return int(first.numel())
    return 0


def _peak_rss_bytes() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


_C = TypeVar("_C", bound=Callback)


def _callback_of(trainer: pl.Trainer, kind: type[_C]) -> _C | None:
    """The Trainer's first callback of `kind`, or None."""
    return next((cb for cb in getattr(trainer, "callbacks", []) if isinstance(cb, kind)), None)


def _gpu_utilization(trainer: pl.Trainer) -> float | None:
    from lightning_accel.callbacks.gpu_monitor import GPUMonitor

    monitor = _callback_of(trainer, GPUMonitor)
    if monitor is None:
        return None
    values = [row["utilization_mean_pct"] for row in monitor.report.gpu_rows()]
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else None


def _loader_decision(trainer: pl.Trainer) -> dict[str, Any] | None:
    """The settings a DataLoaderTuner applied to the train loader in this fit (its decision), or None."""
    from lightning_accel.callbacks.dataloader_tuner import DataLoaderTuner

    tuner = _callback_of(trainer, DataLoaderTuner)
    return None if tuner is None or tuner.decision is None else tuner.decision.as_dict()


def _record_micro_batch(m: StageMeasurement, trainer: pl.Trainer) -> None:
    """The micro-batch the fit ran: MicroBatchFinder's last size and recoveries, else the loader's batch size."""
    from lightning_accel.batches import loader_batch_size
    from lightning_accel.callbacks.micro_batch import MicroBatchFinder

    finder = _callback_of(trainer, MicroBatchFinder)
    if finder is not None and finder.size is not None:
        m.micro_batch, m.micro_batch_auto, m.micro_batch_recoveries = finder.size, True, finder.oom_recoveries
        return
    m.micro_batch = loader_batch_size(getattr(trainer, "train_dataloader", None))
