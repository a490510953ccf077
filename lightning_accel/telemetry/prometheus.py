"""Prometheus exposition of a job's heartbeat: the metric table, a collector, the `/metrics` server, node_exporter
textfiles and `file_sd` target files; no Lightning imports.

Names follow Prometheus conventions: the `accel_` prefix, base units in the name (bytes, watts, joules, hertz,
celsius, seconds), `_total` on counters, ratios in 0-1. Every series carries `host`, `rank` and `run_id` (and
`slurm_job_id` under SLURM); GPU series also `gpu` (the CUDA ordinal of the publishing process) and `uuid` (NVML's,
the key dcgm-exporter's `UUID` joins on). None is called `job` or `instance`: Prometheus sets those for the target.
A scrape reads the latest heartbeat in memory; it never calls NVML.

Health series (XID, ECC, remapped rows, retired pages, a lost card) come from a GPU's `health` entry, the
`telemetry.health.CardHealth.to_json()` of its last poll, where the heartbeat has one; a reading the card does not give
is left out, as the others are.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_accel.telemetry.heartbeat import write_json_atomic

__all__ = [
    "GPU_LABELS",
    "PROMETHEUS_METRICS",
    "RUN_LABELS",
    "TARGET_SCHEMA",
    "Exporter",
    "PromMetric",
    "health_samples",
    "metric_families",
    "write_file_sd",
]

GPU_LABELS = ("host", "gpu", "uuid", "rank", "run_id")
RUN_LABELS = ("host", "rank", "run_id")
TARGET_SCHEMA = "lightning_accel.target/1"
"""The marker a `file_sd` target file carries, as the value of its `__lightning_accel_schema` label (Prometheus drops
labels that start with `__` after relabeling: no series carries it)."""


@dataclass(frozen=True, slots=True)
class PromMetric:
    """One exported metric."""

    name: str
    """As exposed (a counter's with `_total`)."""
    kind: str
    """`gauge` or `counter`."""
    unit: str
    labels: tuple[str, ...]
    """Its labels (`slurm_job_id` is added under SLURM)."""
    help: str
    source: str = ""
    """The heartbeat's per-GPU `latest` key it comes from (GPU gauges)."""
    scale: float = 1.0
    """Factor from the heartbeat's unit to the base unit."""


def _gpu(name: str, unit: str, source: str, scale: float, help: str) -> PromMetric:
    return PromMetric(name, "gauge", unit, GPU_LABELS, help, source, scale)


_MIB = float(2**20)
PROMETHEUS_METRICS: tuple[PromMetric, ...] = (
    PromMetric(
        "accel_gpu_info",
        "gauge",
        "1",
        (*GPU_LABELS, "name"),
        "A GPU the job watches (always 1); `name` is its product name.",
    ),
    _gpu(
        "accel_gpu_sm_active_ratio",
        "ratio",
        "sm_activity_pct",
        0.01,
        "Share of time the SMs were busy (NVML GPM; Hopper or newer). Lead with this where present.",
    ),
    _gpu(
        "accel_gpu_tensor_active_ratio",
        "ratio",
        "tensor_activity_pct",
        0.01,
        "Share of time the tensor-core pipes were busy (NVML GPM; Hopper or newer).",
    ),
    _gpu(
        "accel_gpu_sm_occupancy_ratio",
        "ratio",
        "sm_occupancy_pct",
        0.01,
        "Resident warps over the maximum (NVML GPM; Hopper or newer).",
    ),
    _gpu(
        "accel_gpu_dram_active_ratio",
        "ratio",
        "dram_bw_util_pct",
        0.01,
        "DRAM bandwidth used over its peak (NVML GPM; Hopper or newer).",
    ),
    _gpu(
        "accel_gpu_utilization_ratio",
        "ratio",
        "utilization_pct",
        0.01,
        "Share of time any kernel ran (NVML utilization.gpu): the fallback where GPM is missing; a GPU can read 1 "
        "while most of its SMs idle.",
    ),
    _gpu(
        "accel_gpu_memory_utilization_ratio",
        "ratio",
        "memory_utilization_pct",
        0.01,
        "Share of time device memory was read or written (NVML).",
    ),
    _gpu("accel_gpu_memory_used_bytes", "bytes", "memory_used_mib", _MIB, "Device memory allocated by all processes."),
    _gpu("accel_gpu_memory_total_bytes", "bytes", "memory_total_mib", _MIB, "Device memory."),
    _gpu("accel_gpu_power_watts", "watts", "power_w", 1.0, "Board power draw."),
    _gpu("accel_gpu_power_limit_watts", "watts", "power_limit_w", 1.0, "Enforced power limit."),
    _gpu("accel_gpu_temperature_celsius", "celsius", "temperature_c", 1.0, "GPU core temperature."),
    _gpu("accel_gpu_sm_clock_hertz", "hertz", "sm_clock_mhz", 1e6, "SM clock."),
    _gpu("accel_gpu_memory_clock_hertz", "hertz", "memory_clock_mhz", 1e6, "Memory clock."),
    PromMetric(
        "accel_gpu_throttle_ratio",
        "gauge",
        "ratio",
        (*GPU_LABELS, "reason"),
        "Share of the last window the clocks were held down, by `reason`: thermal, power, hw_slowdown, any.",
    ),
    _gpu("accel_gpu_pcie_rx_bytes_per_second", "bytes/s", "pcie_rx_mb_s", 1e6, "PCIe receive throughput."),
    _gpu("accel_gpu_pcie_tx_bytes_per_second", "bytes/s", "pcie_tx_mb_s", 1e6, "PCIe transmit throughput."),
    PromMetric(
        "accel_gpu_energy_joules_total",
        "counter",
        "joules",
        GPU_LABELS,
        "Energy the GPU used since the job started (NVML total-energy counter); rate() gives watts.",
    ),
    PromMetric(
        "accel_gpu_xid_last",
        "gauge",
        "1",
        GPU_LABELS,
        "The last XID critical error of the card (NVML event), shown for the reader's xid_hold_s (default an hour) "
        "after it was seen, then absent.",
    ),
    PromMetric(
        "accel_gpu_xid_last_time_seconds",
        "gauge",
        "seconds",
        GPU_LABELS,
        "Unix time a poll saw the last XID; time() minus this is its age.",
    ),
    PromMetric(
        "accel_gpu_ecc_errors_total",
        "counter",
        "errors",
        (*GPU_LABELS, "kind", "counter"),
        "ECC errors by `kind` (corrected, uncorrected) and `counter`: volatile (since the driver loaded) or "
        "aggregate (over the card's life).",
    ),
    PromMetric(
        "accel_gpu_remapped_rows",
        "gauge",
        "rows",
        (*GPU_LABELS, "kind"),
        "Memory rows remapped, by the `kind` of error that caused it: corrected, uncorrected (Ampere or newer).",
    ),
    PromMetric(
        "accel_gpu_row_remap_pending",
        "gauge",
        "1",
        GPU_LABELS,
        "1 while a row remap waits for the next GPU reset (Ampere or newer).",
    ),
    PromMetric(
        "accel_gpu_row_remap_failure",
        "gauge",
        "1",
        GPU_LABELS,
        "1 when a row remap failed: the card needs service (Ampere or newer).",
    ),
    PromMetric(
        "accel_gpu_retired_pages",
        "gauge",
        "pages",
        (*GPU_LABELS, "cause"),
        "Memory pages retired, by `cause`: single_bit (repeated corrected errors), double_bit (before Ampere).",
    ),
    PromMetric(
        "accel_gpu_retired_pages_pending",
        "gauge",
        "1",
        GPU_LABELS,
        "1 while a page retirement waits for the next GPU reset (before Ampere).",
    ),
    PromMetric(
        "accel_gpu_lost",
        "gauge",
        "1",
        GPU_LABELS,
        "1 once NVML answered GPU_IS_LOST for the card (fallen off the bus), else 0.",
    ),
    PromMetric(
        "accel_run_info",
        "gauge",
        "1",
        (*RUN_LABELS, "name", "user"),
        "A running job (always 1); `name` is the run's name, `user` who started it.",
    ),
    PromMetric("accel_run_start_time_seconds", "gauge", "seconds", RUN_LABELS, "Unix time the job started publishing."),
    PromMetric("accel_train_global_step", "gauge", "steps", RUN_LABELS, "Optimizer steps taken (the global step)."),
    PromMetric(
        "accel_train_samples_total",
        "counter",
        "samples",
        RUN_LABELS,
        "Training samples of this node's ranks; sum by run_id for the job's.",
    ),
    PromMetric(
        "accel_train_eta_seconds",
        "gauge",
        "seconds",
        RUN_LABELS,
        "Estimated time to the end of the fit, at the recent step rate (absent when unknown).",
    ),
)
_THROTTLE = {
    "thermal": "throttle_thermal_frac",
    "power": "throttle_power_frac",
    "hw_slowdown": "throttle_hw_slowdown_frac",
    "any": "throttle_any_frac",
}


_HEALTH_GAUGES = {
    "accel_gpu_xid_last": "xid",
    "accel_gpu_xid_last_time_seconds": "xid_time",
    "accel_gpu_row_remap_pending": "row_remap_pending",
    "accel_gpu_row_remap_failure": "row_remap_failure",
    "accel_gpu_retired_pages_pending": "retired_pages_pending",
    "accel_gpu_lost": "lost",
}
_HEALTH_LABELLED = (
    *(
        ("accel_gpu_ecc_errors_total", (kind, counter), f"ecc_{kind}_{counter}")
        for kind in ("corrected", "uncorrected")
        for counter in ("volatile", "aggregate")
    ),
    *(("accel_gpu_remapped_rows", (kind,), f"remapped_rows_{kind}") for kind in ("corrected", "uncorrected")),
    *(("accel_gpu_retired_pages", (cause,), f"retired_pages_{cause}") for cause in ("single_bit", "double_bit")),
)
"""Health series with labels of their own: (metric, label values, the `CardHealth.to_json()` key)."""


def health_samples(health: Mapping[str, Any]) -> Iterator[tuple[str, tuple[str, ...], float]]:
    """(metric, its own label values, value) for one card's `CardHealth.to_json()`; readings it lacks left out."""
    for name, key in _HEALTH_GAUGES.items():
        if health.get(key) is not None:
            yield name, (), float(health[key])
    for name, labels, key in _HEALTH_LABELLED:
        if health.get(key) is not None:
            yield name, labels, float(health[key])


def _gpu_rank(heartbeat: Mapping[str, Any], index: int) -> str:
    """The global rank(s) whose CUDA device is `cuda:<index>` on this node; the publishing rank when none is."""
    ranks = [str(r["rank"]) for r in heartbeat["ranks"] if r.get("device") == f"cuda:{index}"]
    return ",".join(ranks) if ranks else str(heartbeat.get("rank", 0))


def metric_families(heartbeat: Mapping[str, Any] | None, node_share: float = 1.0) -> list[Any]:
    """prometheus_client metric families for `heartbeat` (none before the first); a reading a GPU does not give is
    left out, not exported as 0."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    if heartbeat is None:
        return []
    slurm = [heartbeat["slurm_job_id"]] if heartbeat.get("slurm_job_id") else []
    extra = ("slurm_job_id",) if slurm else ()
    run = [heartbeat["host"], str(heartbeat.get("rank", 0)), heartbeat["run_id"], *slurm]
    families = {}
    for metric in PROMETHEUS_METRICS:
        labels = [*metric.labels, *extra]
        family = CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily
        name = metric.name[: -len("_total")] if metric.kind == "counter" else metric.name
        families[metric.name] = family(name, metric.help, labels=labels)
    for gpu in heartbeat["gpus"]:
        ids = [
            heartbeat["host"],
            str(gpu["index"]),
            gpu["uuid"],
            _gpu_rank(heartbeat, gpu["index"]),
            heartbeat["run_id"],
        ]
        latest = gpu["latest"]
        families["accel_gpu_info"].add_metric([*ids, gpu["name"], *slurm], 1.0)
        for metric in PROMETHEUS_METRICS:
            if metric.source and latest.get(metric.source) is not None:
                families[metric.name].add_metric([*ids, *slurm], float(latest[metric.source]) * metric.scale)
        for reason, key in _THROTTLE.items():
            if latest.get(key) is not None:
                families["accel_gpu_throttle_ratio"].add_metric([*ids, reason, *slurm], float(latest[key]))
        if gpu.get("energy_j") is not None:
            families["accel_gpu_energy_joules_total"].add_metric([*ids, *slurm], float(gpu["energy_j"]))
        for name, own, value in health_samples(gpu.get("health") or {}):
            families[name].add_metric([*ids, *own, *slurm], value)
    families["accel_run_info"].add_metric([*run[:3], heartbeat["name"], heartbeat["user"], *slurm], 1.0)
    families["accel_run_start_time_seconds"].add_metric(run, float(heartbeat["started"]))
    families["accel_train_global_step"].add_metric(run, float(heartbeat["step"]))
    families["accel_train_samples_total"].add_metric(run, float(heartbeat["samples"]) * node_share)
    if heartbeat.get("eta_s") is not None:
        families["accel_train_eta_seconds"].add_metric(run, float(heartbeat["eta_s"]))
    return [family for family in families.values() if family.samples]


class Exporter:
    """A prometheus_client collector over the latest heartbeat, with the `/metrics` server and textfile writing.

    Args:
        snapshot: returns the latest heartbeat (None before the first).
        node_share: this node's share of the job's samples (`accel_train_samples_total` counts this node's).
    """

    def __init__(self, snapshot: Callable[[], Mapping[str, Any] | None], node_share: float = 1.0) -> None:
        from prometheus_client import CollectorRegistry

        self._snapshot, self.node_share = snapshot, node_share
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._server: Any = None
        self._thread: Any = None

    def collect(self) -> Iterator[Any]:
        yield from metric_families(self._snapshot(), self.node_share)

    def describe(self) -> list[Any]:
        return []  # families vary with the readings a GPU gives: nothing to check at registration

    def exposition(self) -> bytes:
        """What a scrape of `/metrics` returns (the Prometheus text format)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve `/metrics` (read-only) from a daemon thread; returns the port bound (`port=0` takes a free one).

        Raises:
            OSError: the port is taken or the address is not this machine's.
        """
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        return int(self._server.server_port)

    def write_textfile(self, path: Path) -> None:
        """Write the metrics for node_exporter's textfile collector (atomically: a temporary file, then a rename)."""
        from prometheus_client import write_to_textfile

        write_to_textfile(str(path), self.registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5.0)
            self._server = self._thread = None

    @staticmethod
    def target_host(addr: str, host: str) -> str:
        """The host name Prometheus should scrape for a server bound to `addr`: the machine's name for a wildcard
        address, else the address itself."""
        if addr in ("", "0.0.0.0", "::"):
            return host or socket.getfqdn()
        return f"[{addr}]" if ":" in addr else addr


def write_file_sd(directory: Path, stem: str, target: str) -> Path:
    """`<directory>/<stem>.target.json`, a Prometheus `file_sd` target list holding `target` (`host:port`), written
    atomically; returns its path. Its only label is the schema marker `__lightning_accel_schema` (`TARGET_SCHEMA`),
    which Prometheus drops after relabeling: the series carry their own labels, and a target label would rename them
    (`exported_host`). The `.target.json` ending keeps it apart from a heartbeat of the same stem in one directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem}.target.json"
    write_json_atomic(path, [{"targets": [target], "labels": {"__lightning_accel_schema": TARGET_SCHEMA}}])
    return path
