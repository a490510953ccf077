"""Live GPU telemetry from a background NVML sampler, with alerts, an end-of-run report, a heartbeat for accel-dash
and Prometheus metrics."""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_accel import _lightning
from lightning_accel.batches import data_parallel_replicas, samples_in
from lightning_accel.callbacks._gpu_monitor_job import (
    allocated_pct,
    check_publishing,
    cuda_uuids,
    health_reader,
    heartbeat_checks,
    job_info,
    shared_run_id,
    total_steps,
    warn_publishing,
    why_stopped,
)
from lightning_accel.errors import ConfigError, LightningAccelWarning
from lightning_accel.telemetry import nvml
from lightning_accel.telemetry.alerts import AlertThresholds, check_alerts
from lightning_accel.telemetry.heartbeat import default_runs_dir
from lightning_accel.telemetry.publisher import PublishSettings, RunPublisher
from lightning_accel.telemetry.ranks import allocated_by_device, pack_row, rank_stats, unpack_rows, window_metrics
from lightning_accel.telemetry.readings import READINGS
from lightning_accel.telemetry.run_report import COLUMNS, RunReport
from lightning_accel.telemetry.sampler import NVMLSampler, open_sampler

__all__ = ["GPUMonitor"]


class GPUMonitor(Callback):
    """Logs utilization, memory, power, temperature, clocks, throttling, PCIe and energy of every GPU of the run.

    A daemon thread on each node's local rank 0 reads NVML (nvidia-ml-py) every `interval_s` seconds for the GPUs
    of that node's ranks (CUDA ordinals resolved through `CUDA_VISIBLE_DEVICES`: indices, GPU and MIG UUIDs) and
    keeps time-weighted mean, min and max per logging window. Once training runs, the training thread makes no NVML
    call and no CUDA synchronisation: at each logging step (`Trainer(log_every_n_steps)`) it takes the finished
    window, all ranks all-gather one small CPU tensor over gloo (a gloo group of its own when the run uses NCCL;
    skipped on one process), and rank zero sends the metrics to every logger, checks the alerts and keeps the run
    report. A reading a GPU does not support is dropped once, quietly. Without GPUs or NVML, or when NVML fails
    mid-run, it warns once and stops sampling; training goes on.

    Alerts warn once per run on rank zero (`LightningAccelWarning`) with the number and the fix, and log
    `gpu_monitor/alert/<name>` = 1 at that step: `low_utilization` (input-bound), `memory_headroom`, `throttling`,
    `rank_skew`. At the end of the fit rank zero prints a table per GPU and writes `<report_name>.json`, `.md` and
    `.png` (curves over time) into `report_dir`; the report is kept in checkpoints, so a resumed run continues it.

    For the team (`publish`, on by default): each node's local rank 0 writes a heartbeat every `publish_interval_s`
    from a thread of its own into the runs directory (`runs_dir`, else `$ACCEL_RUNS_DIR`, else
    `$XDG_CACHE_HOME/lightning_accel/runs`): run id, name, host, user, pid, command, the node's ranks and their
    devices (and UUIDs), per GPU the latest window's means (the keys below without the `<gpu>/` prefix) and energy
    (`energy_j`, J since the fit began), ten minutes of history (SM and tensor activity, utilisation, power,
    temperature, memory), the step, samples (all data-parallel ranks), samples/s, ETA (s), the alerts and the status
    (`running`, then `finished` or `failed`; `accel-dash` shows a job that stopped writing as `stale`). A job without
    GPUs publishes too, with no cards. With `prometheus_port` it serves `/metrics` (the `accel_*` metrics of
    `lightning_accel.telemetry.prometheus.PROMETHEUS_METRICS`); `prometheus_textfile_dir` writes them for
    node_exporter's textfile collector, `prometheus_file_sd_dir` a `file_sd` target that is removed at exit.
    Publishing costs the training thread two counter updates per batch; any failure of it (an unwritable directory,
    a port taken) warns once on that node and training goes on.

    Keeps identical: the whole fit: it reads NVML on a thread of its own and writes logs, reports and heartbeats; the
        training step, the optimizer and the data are never touched (the zoo: every module's weights, logs and LRs).
    Changes on purpose: nothing in training.
    Cannot serve: a run with no CUDA device has nothing to watch: it warns once, logs nothing and still publishes the
        job's heartbeat.

    Args:
        interval_s: seconds between NVML readings.
        device_indices: CUDA ordinals of the GPUs to watch on each node, as its processes see them; None takes the
            Trainer's CUDA devices (none on a CPU Trainer: then the callback does nothing).
        readings: NVML readings to take, from `lightning_accel.telemetry.readings.READINGS` (utilization, memory,
            power, temperature, clocks, throttle, pcie, energy, gpm); None takes all. `pcie` blocks the sampler
            thread 20 ms per GPU and reading.
        log_min_max: also log each window's min and max, not only its time-weighted mean.
        low_utilization_pct: alert when a GPU's mean utilization over a window is below this; None: off.
        min_memory_headroom_pct: alert when a GPU's free memory at its window peak is below this %; None: off.
        max_throttle_pct: alert when a GPU's clocks are held down more than this % of a window; None: off.
        max_rank_skew_pct: alert when the slowest rank needs more than this % of the median step time in extra host
            time per step; None: off.
        hung_after_steps: the heartbeat's `no_progress` alert: no optimizer step for this many median step times
            (and 60 s at least); None: off. The heartbeat's alerts (`telemetry.heartbeat_alerts`: throttling,
            memory headroom, a non-finite loss NonFiniteGuard counted, a hung job) are checked on the publisher's
            thread, with or without `log_metrics`: nothing per step.
        warmup_steps: no alert on windows before this global step (start-up is slow by nature).
        report_dir: where the report files go; None: the Trainer's `log_dir`.
        report_name: file name of the report files, without suffix.
        plot: write the PNG (needs matplotlib).
        print_report: print the table at the end of the fit.
        log_metrics: send the window metrics to the loggers, check alerts and write the report; False leaves only the
            publishing (no gather across ranks, nothing logged).
        publish: write the heartbeat that `accel-dash` reads.
        runs_dir: the runs directory of the heartbeat; None: `$ACCEL_RUNS_DIR`, else
            `$XDG_CACHE_HOME/lightning_accel/runs` (`~/.cache/lightning_accel/runs`).
        publish_interval_s: seconds between heartbeats (and textfile writes).
        run_name: the name the dashboard shows; None: the name of the run's directory (`report_dir`, else the
            Trainer's `log_dir`).
        prometheus_port: serve `/metrics` on this port on each node's local rank 0 (0: a free port, the way to go
            with `prometheus_file_sd_dir`); None: no server.
        prometheus_addr: the address `/metrics` binds; "0.0.0.0" lets a Prometheus on another machine scrape it
            (anyone who reaches the port reads the metrics).
        prometheus_textfile_dir: write `accel_<run>.<host>.<node>.prom` here for node_exporter's textfile collector
            every `publish_interval_s`, removed at exit; None: none.
        prometheus_file_sd_dir: write `<run>.<host>.<node>.target.json`, a Prometheus `file_sd` target of the
            `/metrics` server, here while the fit runs (needs `prometheus_port`); None: none.

    Raises:
        ValueError: for a non-positive `interval_s`, an unknown reading, a bad threshold or device index, a bad
            publishing setting.

    Logs (`<gpu>` is `gpu/<cuda ordinal>`, or `node<k>/gpu/<cuda ordinal>` on several nodes; units in the name):
        `<gpu>/<metric>`: the window's time-weighted mean, for every metric of `telemetry.readings.METRICS`:
        `utilization_pct`, `memory_utilization_pct` (% of time), `memory_used_mib`, `memory_total_mib` (MiB),
        `memory_used_pct` (%), `power_w`, `power_limit_w` (W), `power_pct` (% of the enforced limit),
        `temperature_c` (C), `sm_clock_mhz`, `memory_clock_mhz` (MHz), `sm_clock_pct`, `memory_clock_pct` (% of
        max), `throttle_thermal_frac`, `throttle_power_frac`, `throttle_hw_slowdown_frac`, `throttle_any_frac`
        (fraction of time), `pcie_rx_mb_s`, `pcie_tx_mb_s` (MB/s), `energy_wh` (Wh since the run began; a
        counter, not a mean), and on Hopper or newer `sm_activity_pct`, `sm_occupancy_pct`,
        `tensor_activity_pct`, `dram_bw_util_pct` (% of time or peak, NVML GPM).
        `<gpu>/<metric>/min`, `<gpu>/<metric>/max`: with `log_min_max`, for the gauges (not the fractions, totals
        and energy).
        `gpus/<metric>/min|median|max`: across GPUs, for utilization_pct, memory_used_pct, power_w,
        temperature_c and sm_clock_mhz, with two or more GPUs.
        `ranks/step_time_s/min|median|max` (s, training batch end to batch end), `ranks/data_time_s/min|median|max`
        (s, batch end to next batch start), `ranks/slowest` (the rank number), `ranks/skew_pct` (%), with two or
        more ranks.
        `gpu_monitor/alert/<name>`: 1 at the step the alert fires. `gpu_monitor/overhead_pct`: this callback's
        time on the training thread, % of the fit. At the end, `gpu_monitor/summary/<gpu>/<column>` for the
        report's columns (utilization_mean_pct, utilization_peak_pct, memory_peak_gib, memory_total_gib,
        power_mean_w, throttled_pct, temperature_max_c, energy_wh) and `gpu_monitor/summary/overhead_pct`.

    Exports (with `prometheus_port` or `prometheus_textfile_dir`; labels host, rank, run_id, slurm_job_id under SLURM,
    and gpu, uuid on the GPU series; `lightning_accel.telemetry.prometheus.PROMETHEUS_METRICS`):
        per GPU: `accel_gpu_sm_active_ratio`, `accel_gpu_tensor_active_ratio`, `accel_gpu_sm_occupancy_ratio`,
        `accel_gpu_dram_active_ratio` (0-1, NVML GPM), `accel_gpu_utilization_ratio` (0-1, the fallback),
        `accel_gpu_memory_utilization_ratio` (0-1), `accel_gpu_memory_used_bytes`, `accel_gpu_memory_total_bytes` (B),
        `accel_gpu_power_watts`, `accel_gpu_power_limit_watts` (W), `accel_gpu_temperature_celsius` (C),
        `accel_gpu_sm_clock_hertz`, `accel_gpu_memory_clock_hertz` (Hz), `accel_gpu_throttle_ratio` (0-1, by
        `reason`), `accel_gpu_pcie_rx_bytes_per_second`, `accel_gpu_pcie_tx_bytes_per_second` (B/s),
        `accel_gpu_energy_joules_total` (J, a counter since the fit began), `accel_gpu_info` (1, with `name`);
        per GPU's health (`telemetry.health`, read on the publisher's thread): `accel_gpu_xid_last` (the last XID,
        shown for an hour), `accel_gpu_xid_last_time_seconds` (Unix s), `accel_gpu_ecc_errors_total` (by `kind`,
        `counter`), `accel_gpu_remapped_rows` (by `kind`), `accel_gpu_row_remap_pending`,
        `accel_gpu_row_remap_failure`, `accel_gpu_retired_pages` (by `cause`), `accel_gpu_retired_pages_pending`,
        `accel_gpu_lost` (1 once the card answered GPU_IS_LOST);
        per node of a run: `accel_run_info` (1, with `name`, `user`), `accel_run_start_time_seconds` (Unix s),
        `accel_train_global_step` (steps), `accel_train_samples_total` (this node's samples, a counter),
        `accel_train_eta_seconds` (s).

    Example::

        trainer = Trainer(callbacks=[GPUMonitor(interval_s=0.5, low_utilization_pct=60)], log_every_n_steps=50)
    """

    _clock: Callable[[], float] = staticmethod(time.monotonic)  # the sampler's time; tests script it
    _threaded = True  # tests turn the thread off and call `sampler.sample_once()` themselves

    def __init__(
        self,
        interval_s: float = 0.5,
        device_indices: Sequence[int] | None = None,
        readings: Sequence[str] | None = None,
        log_min_max: bool = True,
        low_utilization_pct: float | None = 50.0,
        min_memory_headroom_pct: float | None = 5.0,
        max_throttle_pct: float | None = 25.0,
        max_rank_skew_pct: float | None = 20.0,
        hung_after_steps: float | None = 10.0,
        warmup_steps: int = 50,
        report_dir: str | Path | None = None,
        report_name: str = "gpu_report",
        plot: bool = True,
        print_report: bool = True,
        log_metrics: bool = True,
        publish: bool = True,
        runs_dir: str | Path | None = None,
        publish_interval_s: float = 2.0,
        run_name: str | None = None,
        prometheus_port: int | None = None,
        prometheus_addr: str = "127.0.0.1",
        prometheus_textfile_dir: str | Path | None = None,
        prometheus_file_sd_dir: str | Path | None = None,
    ) -> None:
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s > 0:
            raise ConfigError(f"`interval_s={interval_s!r}` must be a positive number of seconds.")
        if device_indices is not None and (
            isinstance(device_indices, (int, str))
            or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in device_indices)
        ):
            raise ConfigError(f"`device_indices={device_indices!r}` must be a list of CUDA ordinals >= 0, e.g. [0, 1].")
        unknown = sorted(set(readings or ()) - set(READINGS))
        if isinstance(readings, str) or unknown:
            raise ConfigError(f"`readings={readings!r}` has unknown {unknown}; use any of {list(READINGS)}.")
        thresholds = {
            "low_utilization_pct": low_utilization_pct,
            "min_memory_headroom_pct": min_memory_headroom_pct,
            "max_throttle_pct": max_throttle_pct,
            "max_rank_skew_pct": max_rank_skew_pct,
        }
        for name, value in thresholds.items():
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
            ):
                raise ConfigError(f"`{name}={value!r}` must be a percentage >= 0, or None to turn the alert off.")
        if hung_after_steps is not None and (
            isinstance(hung_after_steps, bool)
            or not isinstance(hung_after_steps, (int, float))
            or not hung_after_steps > 0
            or not math.isfinite(hung_after_steps)
        ):
            raise ConfigError(
                f"`hung_after_steps={hung_after_steps!r}` must be a number of median step times > 0 (e.g. 10), or None "
                "to turn the hung-job alert off."
            )
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ConfigError(f"`warmup_steps={warmup_steps!r}` must be an integer >= 0.")
        if not report_name or "/" in report_name:
            raise ConfigError(f"`report_name={report_name!r}` must be a file name without suffix, e.g. 'gpu_report'.")
        check_publishing(publish_interval_s, prometheus_port, prometheus_addr, prometheus_file_sd_dir)
        self.interval_s = float(interval_s)
        self.device_indices = None if device_indices is None else list(device_indices)
        self.readings = None if readings is None else list(readings)
        self.log_min_max = log_min_max
        self.thresholds = AlertThresholds(**thresholds)
        self.hung_after_steps = None if hung_after_steps is None else float(hung_after_steps)
        self.warmup_steps = warmup_steps
        self.report_dir = report_dir
        self.report_name = report_name
        self.plot = plot
        self.print_report = print_report
        self.log_metrics = log_metrics
        self.publish = publish
        self.runs_dir = runs_dir
        self.publish_interval_s = float(publish_interval_s)
        self.run_name = run_name
        self.prometheus_port = prometheus_port
        self.prometheus_addr = prometheus_addr
        self.prometheus_textfile_dir = prometheus_textfile_dir
        self.prometheus_file_sd_dir = prometheus_file_sd_dir
        self.sampler: NVMLSampler | None = None
        self.heartbeat_file: Path | None = None
        """The heartbeat this process wrote in the last fit (None: it publishes none)."""
        self.metrics_url: str | None = None
        """Where the last fit served `/metrics` (None: nowhere)."""
        self.report = RunReport()
        self.report_files: list[Path] = []
        self._reset()

    def _reset(self) -> None:
        self._indices: list[int] = []
        self._active = self._gather = self._multi_node = False
        self._node = 0
        self._dir: Path | None = None
        self._last_end: float | None = None
        self._batch_start = 0.0
        self._step_s = self._data_s = 0.0
        self._steps = 0
        self._logged_step = -1
        self._start = self._fit_base = 0.0
        self._local_info: dict[str, dict[str, Any]] = {}
        self._group: Any = None  # the gloo process group of the per-log-step gather; None: the strategy's
        self._own_group = False
        self._gpus: list[dict[str, Any]] = []  # the node's watched GPUs: index, uuid, name
        self._devices: list[Any] = []  # their `nvml.GpuDevice`s, while the sampler holds NVML open
        self._publisher: RunPublisher | None = None
        self._replicas = 1

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset()
        self.report, self.report_files = RunReport(), []
        node_devices = getattr(trainer.strategy, "parallel_devices", None) or [trainer.strategy.root_device]
        cuda = [device.index or 0 for device in node_devices if device.type == "cuda"]
        self._indices = self.device_indices if self.device_indices is not None else cuda
        publishing = self._publishes()
        run_id = shared_run_id(trainer) if publishing else ""  # a broadcast from rank 0 where no launcher names it
        if publishing or (self._indices and self.log_metrics):
            self._dir = Path(self.report_dir if self.report_dir is not None else (trainer.log_dir or "."))  # collective
        self._node, self._multi_node = trainer.node_rank, trainer.num_nodes > 1
        if not self._indices:
            if self.log_metrics:
                rank_zero_warn(
                    "GPUMonitor: this run uses no CUDA device, so there is nothing to watch; it logs nothing"
                    f"{' (its heartbeat still publishes the job)' if publishing else ''}. "
                    "Pass `device_indices=[...]` to watch GPUs all the same.",
                    category=LightningAccelWarning,
                )
        else:
            self._active = self.log_metrics
            self._gather = self.log_metrics and trainer.world_size > 1
            if self._gather:
                self._group, self._own_group = _cpu_group()
            if trainer.local_rank == 0:
                uuids = cuda_uuids(self._indices) if self.device_indices is None else None
                self.sampler = self._start_sampler(uuids, views=int(self.log_metrics) + int(publishing))
                self._active = self.log_metrics and (self._gather or self.sampler is not None)
        if publishing and trainer.local_rank == 0:
            self._publisher = self._make_publisher(trainer, run_id)

    def _publishes(self) -> bool:
        return self.publish or self.prometheus_port is not None or self.prometheus_textfile_dir is not None

    def _make_publisher(self, trainer: pl.Trainer, run_id: str) -> RunPublisher:
        """The node's publisher (not started): the job's fixed facts, and the sampler view after the logging one."""
        runs_dir = None
        if self.publish:
            runs_dir = Path(self.runs_dir).expanduser() if self.runs_dir is not None else default_runs_dir()
        textfile = self.prometheus_textfile_dir
        settings = PublishSettings(
            runs_dir=runs_dir,
            interval_s=self.publish_interval_s,
            prometheus_port=self.prometheus_port,
            prometheus_addr=self.prometheus_addr,
            textfile_dir=None if textfile is None else Path(textfile),
            file_sd_dir=None if self.prometheus_file_sd_dir is None else Path(self.prometheus_file_sd_dir),
        )
        assert self._dir is not None
        job = job_info(trainer, run_id, self.run_name or self._dir.resolve().name, self._gpus)
        view = 1 if self.log_metrics else 0
        alerts = (lambda: self.report.alerts) if trainer.global_rank == 0 else None  # rank zero checks the alerts
        checks = heartbeat_checks(trainer, self.thresholds, self.log_metrics, self.hung_after_steps)
        devices, self._devices = self._devices, []  # the reader holds them (NVML handles do not pickle)
        return RunPublisher(
            settings,
            job,
            self.sampler,
            view,
            alerts=alerts,
            checks=checks,
            health=health_reader(devices if self.sampler is not None else []),
            warn=warn_publishing,
            warn_nvml=not self.log_metrics,
        )

    def _start_sampler(self, uuids: list[str] | None, views: int = 1) -> NVMLSampler | None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        sampler, devices, problem = open_sampler(
            self._indices, visible, uuids, self.readings, self.interval_s, clock=self._clock, views=views
        )
        self._gpus = [{"index": d.index, "uuid": d.uuid, "name": d.name} for d in devices]
        self._devices = list(devices) if sampler is not None else []
        for device in devices:
            info = {"name": device.name, "uuid": device.uuid, "nvml_index": device.nvml_index}
            self._local_info[self._key(self._node, device.index)] = info
        if sampler is None:
            warnings.warn(
                f"GPUMonitor is off on this node: {problem}. Training goes on without GPU telemetry.",
                LightningAccelWarning,
                stacklevel=2,
            )
        return sampler

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            if self.sampler is not None:
                self.sampler.start(threaded=self._threaded)
            self._start_publisher(trainer)
            return
        self.report.begin_fit()  # a checkpoint's report is loaded by now
        self._start, self._fit_base = self._clock(), self.report.fit_s
        infos = [self._local_info]
        if self._multi_node and self._group is not None:
            infos = [{}] * trainer.world_size  # once per fit: names and UUIDs of the other nodes' GPUs
            torch.distributed.all_gather_object(infos, self._local_info, group=self._group)
        for info in infos:
            self.report.info.update(info)
        if self.sampler is not None:
            self.sampler.start(threaded=self._threaded)
        self._start_publisher(trainer)

    def _start_publisher(self, trainer: pl.Trainer) -> None:
        publisher = self._publisher
        if publisher is None:
            return
        self._replicas = data_parallel_replicas(trainer)
        publisher.job.max_steps = total_steps(trainer)
        publisher.progress.step = trainer.global_step  # a resumed fit goes on from its checkpoint's step
        publisher.start(threaded=self._threaded)
        self.heartbeat_file, self.metrics_url = publisher.path, publisher.metrics_url

    def _finish_publisher(self, status: str, reason: str = "") -> None:
        if self._publisher is not None:
            self._publisher.finish(status, reason)
            self._publisher = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        publisher = self._publisher
        if publisher is not None:  # read by the publisher's thread
            publisher.progress.step = trainer.global_step
            publisher.progress.samples += samples_in(batch) * self._replicas
        if not self._active:
            return
        now = time.perf_counter()
        if self._last_end is not None:
            self._step_s += now - self._last_end
            self._data_s += max(0.0, self._batch_start - self._last_end)
            self._steps += 1
        self._last_end = now
        step = _lightning.optimizer_steps_logged(trainer)
        every = _lightning.trainer_log_every_n_steps(trainer)
        if every > 0 and (step + 1) % every == 0 and step != self._logged_step:
            self._logged_step = step
            self._flush(trainer, step)
        self.report.overhead_s += time.perf_counter() - now

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_end = None  # validation is not a training step

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_end = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            self._finish_publisher("finished")
            self._stop_sampler()
            return
        started = time.perf_counter()
        step = _lightning.optimizer_steps_logged(trainer)
        self._flush(trainer, step)
        self._update_fit_time()
        self.report.last_step = step
        self._stop_sampler()
        self._active = False
        self.report.overhead_s += time.perf_counter() - started
        self._finish_publisher("finished")
        if trainer.global_rank != 0 or not self.report.gpus:
            return
        summary = {
            f"gpu_monitor/summary/{row['gpu']}/{column}": float(row[column])
            for row in self.report.gpu_rows()
            for column in (*COLUMNS, "energy_wh")
            if not math.isnan(row[column])
        }
        summary["gpu_monitor/summary/overhead_pct"] = self.report.to_dict()["monitor_overhead_pct"]
        for logger in trainer.loggers:
            logger.log_metrics(summary, step=step)
        assert self._dir is not None
        self.report_files = self.report.write(self._dir, self.report_name, plot=self.plot)
        if self.print_report:
            from rich.console import Console

            Console().print(self.report.table())

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._finish_publisher("failed", why_stopped(exception, trainer.global_step))
        from lightning_accel.callbacks.stop_on_signal import SignalExit

        if isinstance(exception, SignalExit) and self._active:  # an agreed stop: the report is written as at the end
            try:
                self.on_train_end(trainer, pl_module)
            except Exception as err:  # monitoring never stops the way out
                rank_zero_warn(
                    f"GPUMonitor: the report at the stop failed: {type(err).__name__}: {err}",
                    category=LightningAccelWarning,
                )
        self._stop_sampler()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._finish_publisher("finished")
        self._stop_sampler()
        self._active = False
        if self._own_group:  # every rank tears down
            torch.distributed.destroy_process_group(self._group)
        self._group, self._own_group = None, False

    @override
    def state_dict(self) -> dict[str, Any]:
        self._update_fit_time()
        return self.report.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.report.load_state_dict(state_dict)

    def _key(self, node: int, index: int) -> str:
        return f"node{node}/gpu/{index}" if self._multi_node else f"gpu/{index}"

    def _update_fit_time(self) -> None:
        if self._active:
            self.report.fit_s = self._fit_base + self._clock() - self._start

    def _stop_sampler(self) -> None:
        if self.sampler is not None:
            if self.sampler.stop():
                nvml.shutdown_nvml()
            self.sampler = None
        self._devices = []

    def _all_gather(self, trainer: pl.Trainer, row: list[float]) -> list[list[float]]:
        tensor = torch.tensor(row, dtype=torch.float64)
        if self._group is None:  # on the strategy's devices: reading the result waits for the work queued before it
            gathered = trainer.strategy.all_gather(tensor.to(trainer.strategy.root_device))
            return gathered.reshape(-1, len(row)).tolist()
        rows = [torch.empty_like(tensor) for _ in range(trainer.world_size)]
        torch.distributed.all_gather(rows, tensor, group=self._group)
        return [r.tolist() for r in rows]

    def _flush(self, trainer: pl.Trainer, step: int) -> None:
        """Close the window, gather every rank's row, and on rank zero log, alert and fold it into the report."""
        window = None
        if self.sampler is not None:
            window = self.sampler.close_window()
            if self.sampler.failure is not None:
                warnings.warn(
                    f"GPUMonitor stops sampling: NVML failed mid-run ({self.sampler.failure}). Training goes "
                    "on without GPU telemetry.",
                    LightningAccelWarning,
                    stacklevel=2,
                )
                self._stop_sampler()  # the report keeps what was read so far
        if window is None and not self._gather:
            return  # no new reading (log steps come faster than `interval_s`): nothing to log, timings carry over
        steps = self._steps
        device, allocated = allocated_pct(trainer.strategy.root_device)
        row = pack_row(
            self._node,
            self._indices,
            window,
            self._step_s / max(steps, 1),
            self._data_s / max(steps, 1),
            steps,
            has_sampler=window is not None,
            device=device,
            allocated_pct=allocated,
        )
        self._step_s = self._data_s = 0.0
        self._steps = 0
        rows = self._all_gather(trainer, row) if self._gather else [row]
        if trainer.global_rank != 0:
            return
        timings, devices = unpack_rows(rows, len(self._indices))
        gpus = {self._key(node, index): stats for (node, index), stats in sorted(devices.items())}
        allocated_pcts = {self._key(node, index): pct for (node, index), pct in allocated_by_device(timings).items()}
        ranks = rank_stats(timings)
        self._update_fit_time()
        self.report.add_window(self.report.fit_s, step, gpus, timings)
        metrics = window_metrics(gpus, ranks, self.report.energy_wh, self.log_min_max)
        if step >= self.warmup_steps:
            for alert in check_alerts(step, gpus, ranks, self.thresholds, self.report.fired, allocated_pcts):
                rank_zero_warn(f"GPUMonitor at step {step}: {alert.message}", category=LightningAccelWarning)
                self.report.add_alert(alert)
                metrics[f"gpu_monitor/alert/{alert.name}"] = 1.0
        if not metrics:
            return
        metrics["gpu_monitor/overhead_pct"] = 100.0 * self.report.overhead_s / max(self.report.fit_s, 1e-9)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


def _cpu_group() -> tuple[Any, bool]:
    """A gloo process group for small CPU gathers (the default one if it is gloo), and whether it is new."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return None, False
    if dist.get_backend() == "gloo":
        return dist.group.WORLD, False
    try:
        return dist.new_group(backend="gloo"), True
    except Exception:  # no gloo: gather on the strategy's devices instead
        return None, False
