"""The heartbeat publisher: a daemon thread on each node's local rank 0 that writes the job's heartbeat and feeds the
Prometheus exporter, off the training thread; no Lightning imports.

The training thread only bumps two numbers (`Progress.step`, `Progress.samples`). Every `interval_s` the thread closes
its own window of the NVML sampler, folds it into the history, and writes the heartbeat atomically; the exporter
answers scrapes from the latest heartbeat in memory, so a scrape never touches NVML. `finish` writes the last
heartbeat (`finished` or `failed`), removes the Prometheus target and textfile, and stops the server; an `atexit` hook
does it for a process that exits without `finish`. Every failure warns once (through `warn`) and publishing goes
on where it can: monitoring never stops training.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_accel.telemetry.heartbeat import (
    HISTORY_METRICS,
    SCHEMA,
    History,
    heartbeat_path,
    prune_heartbeats,
    safe_component,
    write_json_atomic,
)
from lightning_accel.telemetry.heartbeat_alerts import HeartbeatAlerts
from lightning_accel.telemetry.readings import METRICS
from lightning_accel.telemetry.sampler import NVMLSampler

__all__ = ["JobInfo", "Progress", "PublishSettings", "RunPublisher", "process_command"]

_RATE_SPAN_S = 30.0  # samples/s and the ETA are taken over about this much of the recent past
_PRUNE_AFTER_S = 7 * 24 * 3600.0  # this user's heartbeats older than a week are removed when a job starts


@dataclass(kw_only=True, slots=True)
class PublishSettings:
    """Where and how often a job publishes."""

    runs_dir: Path | None
    """The runs directory the heartbeat goes into; None: no heartbeat."""
    interval_s: float = 2.0
    """Seconds between heartbeats (and textfile writes)."""
    prometheus_port: int | None = None
    """Serve `/metrics` on this port (0: a free one); None: no server."""
    prometheus_addr: str = "127.0.0.1"
    """The address the server binds."""
    textfile_dir: Path | None = None
    """Write `<run>.<host>.<node>.prom` here for node_exporter's textfile collector; None: no file."""
    file_sd_dir: Path | None = None
    """Write a Prometheus `file_sd` target file here while the job runs; None: no file."""


@dataclass(kw_only=True, slots=True)
class JobInfo:
    """What a heartbeat says about the job that does not change while it runs."""

    run_id: str
    name: str
    host: str
    user: str
    pid: int
    command: str
    node_rank: int = 0
    num_nodes: int = 1
    rank: int = 0
    """The global rank that publishes (the node's local rank 0)."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """This node's ranks: `{"rank", "local_rank", "device", "uuid"}`."""
    gpus: list[dict[str, Any]] = field(default_factory=list)
    """The GPUs watched on this node: `{"index", "uuid", "name"}` (CUDA ordinal, NVML UUID, product name)."""
    slurm_job_id: str | None = None
    max_steps: int | None = None
    node_share: float = 1.0
    """The share of the job's samples this node's ranks train (its ranks / all ranks), for the exporter's counter."""


@dataclass(slots=True)
class Progress:
    """Written by the training thread, read by the publisher's."""

    step: int = 0
    """Optimizer steps taken (the Trainer's global step)."""
    samples: int = 0
    """Training samples of the whole job so far (all data-parallel ranks)."""


class RunPublisher:
    """Publishes one node's view of a job: the heartbeat file, and the data the Prometheus exporter serves.

    Args:
        settings: where and how often.
        job: the fixed facts of the job.
        sampler: the node's NVML sampler (None: a job without GPUs, or without NVML); the publisher closes `view`.
        view: the sampler view this publisher closes windows of.
        alerts: returns the alerts fired so far (`{"name", "step", "message"}`); None: none known on this node.
        checks: the heartbeat's own alerts, checked on this thread at each heartbeat (`HeartbeatAlerts`); None: none.
        health: reads each card's health at each heartbeat (`telemetry.health.HealthReader`, its `poll` never
            raises), into the GPU's `health` entry and the checks; None: none. `finish` closes it.
        warn: called once per kind of problem with a message (the caller warns; it may be called from the thread).
        warn_nvml: warn when the sampler fails mid-run (False where the caller warns of it already).
        clock: wall-clock time (s since the epoch) written into heartbeats.
    """

    def __init__(
        self,
        settings: PublishSettings,
        job: JobInfo,
        sampler: NVMLSampler | None = None,
        view: int = 0,
        alerts: Callable[[], Sequence[dict[str, Any]]] | None = None,
        checks: HeartbeatAlerts | None = None,
        health: Any = None,
        warn: Callable[[str], None] = lambda message: None,
        warn_nvml: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings, self.job, self.sampler, self.view = settings, job, sampler, view
        self.progress = Progress()
        self.status = "running"
        self.reason = ""
        self.heartbeat: dict[str, Any] | None = None
        """The latest heartbeat (what the exporter serves)."""
        self.path = (
            None
            if settings.runs_dir is None
            else heartbeat_path(settings.runs_dir, job.run_id, job.host, job.node_rank)
        )
        self.metrics_url: str | None = None
        self.exporter: Any = None
        self._alerts = alerts or (lambda: ())
        self._checks = checks
        self._health_reader = health
        self._health: dict[int, dict[str, Any]] = {}
        self._warn = warn
        self._warned: set[str] = set() if warn_nvml else {"nvml"}
        self._clock = clock
        self._started = clock()
        self._history = History()
        self._rates: deque[tuple[float, int, int]] = deque()
        self._latest: dict[int, dict[str, float]] = {}
        self._energy: dict[int, float] = {}
        self._textfile: Path | None = None
        self._target: Path | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._begun = self._finished = False

    # lifecycle
    def start(self, threaded: bool = True) -> None:
        """Write the first heartbeat here (so an unwritable runs directory warns on the calling thread), start the
        exporter and the target file, then the thread."""
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                prune_heartbeats(self.path.parent, _PRUNE_AFTER_S)
            except OSError as err:
                self._problem(
                    "heartbeat", f"the runs directory {self.path.parent} cannot be created ({err.strerror or err})"
                )
        self._begun = True
        if self.settings.prometheus_port is not None or self.settings.textfile_dir is not None:
            self._start_exporter()
        self.publish()
        atexit.register(self._at_exit)
        if threaded:
            self._thread = threading.Thread(target=self._run, name="GPUMonitor-publisher", daemon=True)
            self._thread.start()

    def finish(self, status: str, reason: str = "") -> None:
        """Stop the thread, write the last heartbeat with `status` ("finished" or "failed"), remove the target and
        textfile, stop the exporter; idempotent (the first call decides the status). A publisher never started (the
        fit failed before training began) has published nothing, and writes nothing."""
        assert status in ("finished", "failed"), status
        if self._finished:
            return
        self._finished = True
        if not self._begun:
            return
        atexit.unregister(self._at_exit)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.settings.interval_s))
            self._thread = None
        self.status, self.reason = status, reason
        self.publish()
        for path in (self._target, self._textfile):
            if path is not None:
                try:
                    path.unlink(missing_ok=True)
                except OSError:
                    pass
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
        if self._health_reader is not None:
            self._health_reader.close()

    def _at_exit(self) -> None:
        self.finish("failed", "the process exited before the fit ended")

    def _run(self) -> None:
        while not self._stop.wait(self.settings.interval_s):
            self.publish()

    # one heartbeat
    def publish(self) -> None:
        """Build the heartbeat from the sampler's window and the progress, and write it; never raises."""
        try:
            with self._lock:
                self.heartbeat = self._build(self._clock())
        except Exception as err:  # a bug here must not reach training
            self._problem("build", f"building the heartbeat failed ({type(err).__name__}: {err})")
            return
        if self.path is not None:
            try:
                write_json_atomic(self.path, self.heartbeat)
            except (OSError, ValueError) as err:
                self._problem(
                    "heartbeat",
                    f"the heartbeat cannot be written to {self.path} ({getattr(err, 'strerror', None) or err})",
                )
        if self.settings.textfile_dir is not None and self.exporter is not None and self.status == "running":
            try:
                path = self._textfile_path()
                if self._textfile is None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                self.exporter.write_textfile(path)
                self._textfile = path
            except OSError as err:
                self._problem(
                    "textfile",
                    f"the Prometheus textfile cannot be written into "
                    f"{self.settings.textfile_dir} ({err.strerror or err})",
                )

    def _build(self, now: float) -> dict[str, Any]:
        self._read_window()
        step, samples = self.progress.step, self.progress.samples
        if self._health_reader is not None and self.status == "running":
            self._health = {card.index: card.to_json() for card in self._health_reader.poll()}
        if self._checks is not None and self.status == "running":
            problems = {index: list(card.get("problems", ())) for index, card in self._health.items()}
            self._checks.check(now, step, self._latest, problems)
        self._rates.append((now, step, samples))
        while len(self._rates) > 2 and self._rates[1][0] < now - _RATE_SPAN_S:
            self._rates.popleft()
        samples_per_s = eta_s = None
        first = self._rates[0]
        if now - first[0] > 0 and len(self._rates) > 1:
            samples_per_s = (samples - first[2]) / (now - first[0])
            steps_per_s = (step - first[1]) / (now - first[0])
            if self.job.max_steps is not None and steps_per_s > 0 and self.status == "running":
                eta_s = max(0.0, (self.job.max_steps - step) / steps_per_s)
        point: dict[str, float | None] = {"samples_per_s": samples_per_s}
        for gpu in self.job.gpus:
            latest = self._latest.get(gpu["index"], {})
            point.update({f"{gpu['index']}/{m}": latest.get(m) for m in HISTORY_METRICS})
        if self.status == "running" and any(value is not None for value in point.values()):
            self._history.add(now, point)
        gpus = []
        for gpu in self.job.gpus:
            index = gpu["index"]
            history = {
                m: self._history.series(f"{index}/{m}")
                for m in HISTORY_METRICS
                if f"{index}/{m}" in self._history.keys()
            }
            gpus.append(
                {
                    **gpu,
                    "latest": {k: round(v, 4) for k, v in self._latest.get(index, {}).items()},
                    "energy_j": self._energy.get(index),
                    "history": history,
                    **({"health": self._health[index]} if index in self._health else {}),
                }
            )
        job = self.job
        return {
            "schema": SCHEMA,
            "run_id": job.run_id,
            "name": job.name,
            "host": job.host,
            "user": job.user,
            "pid": job.pid,
            "command": job.command,
            "node_rank": job.node_rank,
            "num_nodes": job.num_nodes,
            "started": self._started,
            "updated": now,
            "interval_s": self.settings.interval_s,
            "status": self.status,
            "reason": self.reason,
            "slurm_job_id": job.slurm_job_id,
            "metrics_url": self.metrics_url,
            "ranks": job.ranks,
            "gpus": gpus,
            "step": step,
            "max_steps": job.max_steps,
            "samples": samples,
            "samples_per_s": None if samples_per_s is None else round(samples_per_s, 3),
            "eta_s": None if eta_s is None else round(eta_s, 1),
            "alerts": [
                {"name": str(a["name"]), "step": int(a["step"]), "message": str(a["message"])}
                for a in [*self._alerts(), *(self._checks.alerts if self._checks is not None else ())]
            ],
            "history": {
                "t": [round(t, 2) for t in self._history.t],
                "samples_per_s": self._history.series("samples_per_s"),
            },
            "rank": job.rank,
        }

    def _read_window(self) -> None:
        """Fold the sampler's window since the last heartbeat into the latest values per GPU."""
        if self.sampler is None:
            return
        window = self.sampler.close_window(self.view)
        if self.sampler.failure is not None:
            self._problem(
                "nvml", f"NVML failed mid-run ({self.sampler.failure}); the heartbeat keeps the last readings"
            )
        if window is None:
            return
        for index, stats in window.devices.items():
            latest = {}
            for metric in METRICS:
                stat = stats.get(metric.name)
                if stat is None or metric.name == "energy_wh":
                    continue
                value = stat.mean
                if math.isfinite(value):
                    latest[metric.name] = value
            self._latest[index] = latest
            energy = stats.get("energy_wh")
            if energy is not None and math.isfinite(energy.last):
                self._energy[index] = round(energy.last * 3600.0, 3)

    # Prometheus
    def _start_exporter(self) -> None:
        from lightning_accel.telemetry.prometheus import Exporter, write_file_sd

        try:
            self.exporter = Exporter(lambda: self.heartbeat, node_share=self.job.node_share)
        except Exception as err:  # prometheus_client missing or broken
            self._problem("exporter", f"no Prometheus metrics ({type(err).__name__}: {err})")
            return
        if self.settings.prometheus_port is None:
            return  # the textfile only
        try:
            port = self.exporter.serve(self.settings.prometheus_port, self.settings.prometheus_addr)
        except Exception as err:  # a port taken, an address not ours
            self._problem(
                "exporter",
                f"/metrics cannot be served on {self.settings.prometheus_addr}:"
                f"{self.settings.prometheus_port} ({type(err).__name__}: {err}); choose "
                "another `prometheus_port` (0 takes a free one)",
            )
            return
        target = Exporter.target_host(self.settings.prometheus_addr, self.job.host)
        self.metrics_url = f"http://{target}:{port}/metrics"
        if self.settings.file_sd_dir is not None:
            try:
                self._target = write_file_sd(self.settings.file_sd_dir, self._file_stem(), f"{target}:{port}")
            except OSError as err:
                self._problem(
                    "file_sd",
                    f"the Prometheus target cannot be written into {self.settings.file_sd_dir} ({err.strerror or err})",
                )

    def _file_stem(self) -> str:
        return f"{safe_component(self.job.run_id, 120)}.{safe_component(self.job.host)}.{self.job.node_rank}"

    def _textfile_path(self) -> Path:
        assert self.settings.textfile_dir is not None
        return Path(self.settings.textfile_dir) / f"accel_{self._file_stem()}.prom"

    def _problem(self, kind: str, message: str) -> None:
        if kind in self._warned:
            return
        self._warned.add(kind)
        try:
            self._warn(message)
        except Exception:  # a warning filter set to "error" must not stop the publisher (or training)
            pass


def process_command(limit: int = 500) -> str:
    """This process's command line, cut to `limit` characters."""
    text = " ".join([os.path.basename(sys.executable), *sys.argv])
    return text if len(text) <= limit else text[: limit - 3] + "..."
