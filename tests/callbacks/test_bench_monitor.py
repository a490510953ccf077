"""BenchMonitor: the step-time split adds up, samples, tokens and FLOPs are counted, the target stops the fit."""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.callbacks import BenchMonitor


class _TokenModel(pl.LightningModule):
    """Integer token batches (batch, seq); the validation metric falls by 1 on every validation pass."""

    def __init__(self, declare_flops: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)
        self.passes = 0
        if declare_flops:
            self.flops_per_batch = lambda batch_size: 1000 * batch_size

    def _loss(self, batch: Any) -> torch.Tensor:
        (x,) = batch
        return nn.functional.cross_entropy(self.head(self.emb(x)).reshape(-1, 16), x.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/score", 10.0 - self.passes)

    def on_validation_epoch_end(self) -> None:
        self.passes += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(monitor: BenchMonitor, model: pl.LightningModule, tmp_path, max_steps: int = 12) -> pl.Trainer:
    data = TensorDataset(torch.randint(0, 16, (64, 5), generator=torch.Generator().manual_seed(0)))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        val_check_interval=3,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[monitor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    return trainer


def test_measurement_adds_up_and_is_written(tmp_path) -> None:
    path = tmp_path / "stage.json"
    monitor = BenchMonitor(path, metric="val/score", mode="min", target=8.0, warmup_batches=2)
    _fit(monitor, _TokenModel(), tmp_path)
    written = json.loads(path.read_text())
    m = monitor.measurement
    assert written["batches"] == m.batches == 12 and m.optimizer_steps == 12
    assert m.samples == 48 and m.tokens == 48 * 5
    assert m.flops_per_batch == 4000 and m.flops_source.endswith("flops_per_batch")
    # batches after the warm-up that followed another training batch (not the first, not right after validation)
    assert 0 < m.steady_batches <= 10
    parts = m.data_s + m.forward_s + m.backward_s + m.optimizer_s
    assert parts == pytest.approx(m.steady_s) and min(m.forward_s, m.backward_s, m.optimizer_s) > 0
    assert [v["value"] for v in m.validations] == [10.0, 9.0, 8.0, 7.0]
    assert m.final_metric == 7.0
    assert m.time_to_target_s == m.validations[2]["train_s"] and 0 < m.time_to_target_s <= m.train_s
    assert m.peak_memory_bytes and m.memory_total_bytes and m.device == "cpu"
    assert written["data_parallel_size"] == m.data_parallel_size == 1  # MFU divides by world / this


@pytest.mark.parametrize("declaration", ["none", "another signature"])
def test_stop_at_target_stops_the_fit_and_flops_are_counted_without_a_declaration(tmp_path, declaration) -> None:
    model = _TokenModel(declare_flops=False)
    if declaration == "another signature":
        model.flops_per_batch = lambda batch_size, seq_len: 0  # type: ignore[assignment]
    monitor = BenchMonitor(metric="val/score", target=9.0, stop_at_target=True)
    trainer = _fit(monitor, model, tmp_path, max_steps=30)
    assert trainer.global_step == 6  # second validation (step 6) reached 9.0
    assert monitor.measurement.flops_source.startswith("torch.utils.flop_counter")
    assert monitor.measurement.flops_per_batch and monitor.measurement.flops_per_batch > 0


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="mode='low'"):
        BenchMonitor(mode="low")
    with pytest.raises(ValueError, match="stop_at_target"):
        BenchMonitor(stop_at_target=True)
    with pytest.raises(ValueError, match="warmup_batches"):
        BenchMonitor(warmup_batches=-1)


@pytest.mark.parametrize("validate_at_end", [True, False])
def test_the_last_step_is_validated_when_epoch_ends_shift_the_validation_batches(tmp_path, validate_at_end) -> None:
    """16 batches an epoch, accumulate 3: each epoch ends in a partial window (6 optimizer steps an epoch), so 8
    steps end at batch 22, before the second `val_check_interval=12` batch: without the final validation the metric
    would be the one of step 4."""
    monitor = BenchMonitor(metric="val/score", validate_at_end=validate_at_end)
    data = TensorDataset(torch.randint(0, 16, (64, 5), generator=torch.Generator().manual_seed(0)))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=8,
        max_epochs=-1,
        accumulate_grad_batches=3,
        val_check_interval=12,
        check_val_every_n_epoch=None,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[monitor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(_TokenModel(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    m = monitor.measurement
    assert trainer.global_step == 8 and m.batches == 22
    steps = [v["step"] for v in m.validations]
    if validate_at_end:
        assert steps == [4, 8] and m.final_metric == 9.0
    else:
        assert steps == [4] and m.final_metric == 10.0  # what accel-bench --quick reported for model_parallel


def test_cuda_peak_memory_is_read_from_the_fit_start_device_not_the_module_after_teardown(monkeypatch) -> None:
    """Lightning moves the module back to the CPU before `on_fit_end`; asking CUDA about `pl_module.device` then
    raised "Expected a cuda device, but got: cpu" on a real H200. The rank's device index is kept from fit start."""
    asked: list[object] = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    props = type("Props", (), {"multi_processor_count": 132, "total_memory": 2**30})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda index=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda index=None: asked.append(index) or 123)

    class _Module:
        device = torch.device("cuda", 1)

    class _Trainer:
        world_size, precision, global_step, callbacks = 1, "32-true", 7, []

    monitor = BenchMonitor(None, sync_cuda=False)
    module = _Module()
    monitor.on_fit_start(_Trainer(), module)  # type: ignore[arg-type]
    module.device = torch.device("cpu")  # what Lightning's teardown does before on_fit_end
    monitor.on_fit_end(_Trainer(), module)  # type: ignore[arg-type]
    assert asked == [1]
    assert monitor.measurement.peak_memory_bytes == 123


@pytest.mark.parametrize("finder", [False, True])
def test_the_micro_batch_the_fit_ran_is_recorded(tmp_path, finder: bool) -> None:
    """The loader's batch (4) without MicroBatchFinder; its size, marked auto, with it."""
    from lightning_accel.callbacks import MicroBatchFinder

    monitor = BenchMonitor(metric="val/score")
    model = _TokenModel()
    extra = [MicroBatchFinder(micro_batch_size=2)] if finder else []
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        callbacks=[monitor, *extra],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        limit_val_batches=0,
    )
    data = TensorDataset(torch.randint(0, 16, (64, 5), generator=torch.Generator().manual_seed(0)))
    trainer.fit(model, DataLoader(data, batch_size=4))
    m = monitor.measurement
    assert (m.micro_batch, m.micro_batch_auto, m.micro_batch_recoveries) == ((2, True, 0) if finder else (4, False, 0))


def test_the_dataloader_tuners_decision_is_recorded(tmp_path) -> None:
    """With a DataLoaderTuner in the Trainer, the settings it applied (what accel-tune pins in a preset); without
    one, nothing."""
    from lightning_accel.callbacks import DataLoaderTuner

    data = TensorDataset(torch.randint(0, 16, (64, 5), generator=torch.Generator().manual_seed(0)))
    for tuner in (
        None,
        DataLoaderTuner(
            max_workers=1,
            steps_per_trial=2,
            warmup_steps=0,
            prefetch_factors=(2,),
            tune_pin_memory=False,
            use_cache=False,
            print_table=False,
        ),
    ):
        monitor = BenchMonitor(metric="val/score")
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=3,
            callbacks=[monitor, *([tuner] if tuner else [])],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(tmp_path),
            limit_val_batches=0,
        )
        trainer.fit(_TokenModel(), DataLoader(data, batch_size=4))
        loader = monitor.measurement.loader
        if tuner is None:
            assert loader is None
        else:
            decision = tuner.decision
            # counts within the CPU budget are tried before max_workers bounds any doubling above it
            budget = max(len(os.sched_getaffinity(0)), 1)
            assert decision is not None and loader == decision.as_dict() and loader["num_workers"] <= budget


class _QueuedWork:
    """A scripted CUDA device: each training step queues `step_s` of device work without waiting for it, as kernel
    launches do; `synchronize` waits for everything queued."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.queued_s, self.syncs = step_s, 0.0, 0

    def synchronize(self, device: object = None) -> None:
        import time

        self.syncs += 1
        time.sleep(self.queued_s)
        self.queued_s = 0.0


class _QueuingModel(_TokenModel):
    def __init__(self, device: _QueuedWork) -> None:
        super().__init__()
        self.device_work = device

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.device_work.queued_s += self.device_work.step_s
        return super().training_step(batch, batch_idx)


class _CudaBenchMonitor(BenchMonitor):
    """BenchMonitor on the scripted device: the CUDA branch of its timing, on a CPU fit."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._cuda = True


@pytest.mark.slow
@pytest.mark.parametrize("every", [1, 5])
def test_split_every_n_batches_counts_the_queued_device_work_with_fewer_synchronisations(
    tmp_path, monkeypatch: pytest.MonkeyPatch, every: int
) -> None:
    """One batch in `every` is timed by phase; the rates count whole intervals between synchronised batch ends, so
    the device work queued by the unsynchronised batches is in the step time (a launch-time clock would miss it)."""
    device = _QueuedWork(step_s=0.05)  # well above a busy machine's few ms of host work per step
    monkeypatch.setattr(torch.cuda, "synchronize", device.synchronize)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda index=None: 0)
    monitor = _CudaBenchMonitor(None, metric="val/score", split_every_n_batches=every)
    data = TensorDataset(torch.randint(0, 16, (160, 5), generator=torch.Generator().manual_seed(0)))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=40,
        val_check_interval=20,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[monitor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(_QueuingModel(device), DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    m = monitor.measurement
    assert m.steady_s / m.steady_batches >= 0.9 * device.step_s  # the queued work is in every step's time
    assert 30 <= m.steady_batches <= 37
    assert m.split_batches == pytest.approx(m.steady_batches / every, abs=2)
    assert m.data_s + m.forward_s + m.backward_s + m.optimizer_s == pytest.approx(m.steady_s)
    # The device work shows where it was queued. The split is scaled from a few timed batches, so one of them slowed
    # by a busy machine shifts it: 0.75 leaves room for about 15 ms of extra host work in a timed batch.
    assert m.forward_s >= 0.75 * device.step_s * m.steady_batches
    syncs_per_batch = device.syncs / m.batches
    assert syncs_per_batch >= 4 if every == 1 else syncs_per_batch <= 1.5


def test_split_every_n_batches_must_be_a_positive_integer() -> None:
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="split_every_n_batches"):
            BenchMonitor(split_every_n_batches=bad)  # type: ignore[arg-type]
