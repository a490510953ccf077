"""Lightning callbacks of lightning_accel, one per module."""

from __future__ import annotations

from lightning_accel.callbacks.accumulation import AccumulationScheduler
from lightning_accel.callbacks.bench_monitor import BenchMonitor
from lightning_accel.callbacks.compile import Compile
from lightning_accel.callbacks.dataloader_tuner import DataLoaderTuner
from lightning_accel.callbacks.float8 import Float8Training
from lightning_accel.callbacks.gpu_monitor import GPUMonitor
from lightning_accel.callbacks.lr_scaling import LRScaling
from lightning_accel.callbacks.matmul_precision import MatmulPrecision
from lightning_accel.callbacks.micro_batch import MicroBatchFinder
from lightning_accel.callbacks.nonfinite import NonFiniteGuard
from lightning_accel.callbacks.parallelize import Parallelize
from lightning_accel.callbacks.preflight import Preflight
from lightning_accel.callbacks.run_stats import RunStats
from lightning_accel.callbacks.skipped_steps import SkippedStepGuard
from lightning_accel.callbacks.stop_on_signal import StopOnSignal

__all__ = [
    "AccumulationScheduler",
    "BenchMonitor",
    "Compile",
    "DataLoaderTuner",
    "Float8Training",
    "GPUMonitor",
    "LRScaling",
    "MatmulPrecision",
    "MicroBatchFinder",
    "NonFiniteGuard",
    "Parallelize",
    "Preflight",
    "RunStats",
    "SkippedStepGuard",
    "StopOnSignal",
]
