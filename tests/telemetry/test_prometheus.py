"""The accel_* exposition of a heartbeat: names and units by Prometheus conventions, the documented labels on every
series (never `job` or `instance`), readings a card lacks left out, and promtool's lint where promtool is installed."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lightning_accel.telemetry.health import CardHealth
from lightning_accel.telemetry.prometheus import GPU_LABELS, PROMETHEUS_METRICS, RUN_LABELS, Exporter

ALL_READINGS = {
    "sm_activity_pct": 80.0,
    "tensor_activity_pct": 50.0,
    "sm_occupancy_pct": 30.0,
    "dram_bw_util_pct": 60.0,
    "utilization_pct": 99.0,
    "memory_utilization_pct": 40.0,
    "memory_used_mib": 1024.0,
    "memory_total_mib": 81559.0,
    "power_w": 400.0,
    "power_limit_w": 700.0,
    "temperature_c": 61.0,
    "sm_clock_mhz": 1980.0,
    "memory_clock_mhz": 2619.0,
    "throttle_thermal_frac": 0.25,
    "throttle_power_frac": 0.0,
    "throttle_hw_slowdown_frac": 0.0,
    "throttle_any_frac": 0.25,
    "pcie_rx_mb_s": 2.0,
    "pcie_tx_mb_s": 1.0,
}

HEALTH = CardHealth(
    0,
    "GPU-a",
    xid=79,
    xid_time=1.7e9 + 60,
    xid_age_s=5.0,
    ecc_corrected_volatile=3,
    ecc_uncorrected_volatile=1,
    ecc_corrected_aggregate=40,
    ecc_uncorrected_aggregate=2,
    remapped_rows_corrected=5,
    remapped_rows_uncorrected=1,
    row_remap_pending=True,
    row_remap_failure=False,
    retired_pages_single_bit=4,  # not on the same card as remapped rows in life; here for the full table
    retired_pages_double_bit=0,
    retired_pages_pending=False,
).to_json()


def heartbeat(**changes: Any) -> dict[str, Any]:
    data = {
        "run_id": "r1",
        "name": 'say "hi"\n',
        "host": "node-a",
        "user": "ada",
        "rank": 2,
        "started": 1.7e9,
        "step": 120,
        "samples": 4000,
        "eta_s": 30.0,
        "slurm_job_id": None,
        "ranks": [
            {"rank": 2, "local_rank": 0, "device": "cuda:0", "uuid": "GPU-a"},
            {"rank": 3, "local_rank": 1, "device": "cuda:1", "uuid": "GPU-b"},
        ],
        "gpus": [
            {
                "index": 0,
                "uuid": "GPU-a",
                "name": "NVIDIA H100",
                "latest": ALL_READINGS,
                "energy_j": 5000.0,
                "health": HEALTH,
            },
            {"index": 1, "uuid": "GPU-b", "name": "NVIDIA A100", "latest": {"utilization_pct": 50.0}, "energy_j": None},
        ],
    }
    data.update(changes)
    return data


def scrape(data: dict[str, Any] | None, node_share: float = 1.0) -> dict[str, list[Any]]:
    text = Exporter(lambda: data, node_share).exposition().decode()
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def test_every_documented_metric_with_its_labels_and_base_units() -> None:
    samples = scrape(heartbeat(), node_share=0.5)
    assert set(samples) == {metric.name for metric in PROMETHEUS_METRICS}
    for metric in PROMETHEUS_METRICS:
        for sample in samples[metric.name]:
            assert set(sample.labels) == set(metric.labels), (metric.name, sample.labels)
            assert not {"job", "instance"} & set(sample.labels)
    gpu0 = {
        s.name: s.value
        for name, found in samples.items()
        for s in found
        if s.labels.get("uuid") == "GPU-a" and s.labels.get("reason") in (None, "thermal")
    }
    assert gpu0["accel_gpu_sm_active_ratio"] == 0.8 and gpu0["accel_gpu_utilization_ratio"] == 0.99
    assert gpu0["accel_gpu_memory_used_bytes"] == 2**30 and gpu0["accel_gpu_sm_clock_hertz"] == 1.98e9
    assert gpu0["accel_gpu_power_watts"] == 400.0 and gpu0["accel_gpu_energy_joules_total"] == 5000.0
    assert gpu0["accel_gpu_throttle_ratio"] == 0.25 and gpu0["accel_gpu_pcie_rx_bytes_per_second"] == 2e6
    assert all(0 <= s.value <= 1 for name, found in samples.items() if name.endswith("_ratio") for s in found)
    [run] = samples["accel_train_samples_total"]
    assert (run.value, run.labels) == (2000.0, {"host": "node-a", "rank": "2", "run_id": "r1"})  # this node's half
    [info] = samples["accel_run_info"]
    assert info.labels["name"] == 'say "hi"\n' and info.labels["user"] == "ada"  # escaped by the client, read back
    ranks = {s.labels["uuid"]: s.labels["rank"] for s in samples["accel_gpu_info"]}
    assert ranks == {"GPU-a": "2", "GPU-b": "3"}  # the rank on each card


def test_health_series_with_their_labels() -> None:
    samples = scrape(heartbeat(slurm_job_id="9"))
    [xid] = samples["accel_gpu_xid_last"]
    assert (xid.value, xid.labels["uuid"], xid.labels["gpu"], xid.labels["slurm_job_id"]) == (79.0, "GPU-a", "0", "9")
    assert [s.value for s in samples["accel_gpu_xid_last_time_seconds"]] == [1.7e9 + 60]
    ecc = {(s.labels["kind"], s.labels["counter"]): s.value for s in samples["accel_gpu_ecc_errors_total"]}
    assert ecc == {
        ("corrected", "volatile"): 3.0,
        ("uncorrected", "volatile"): 1.0,
        ("corrected", "aggregate"): 40.0,
        ("uncorrected", "aggregate"): 2.0,
    }
    rows = {s.labels["kind"]: s.value for s in samples["accel_gpu_remapped_rows"]}
    assert rows == {"corrected": 5.0, "uncorrected": 1.0}
    assert [s.value for s in samples["accel_gpu_row_remap_pending"]] == [1.0]
    assert [s.value for s in samples["accel_gpu_row_remap_failure"]] == [0.0]
    assert {s.labels["cause"]: s.value for s in samples["accel_gpu_retired_pages"]} == {
        "single_bit": 4.0,
        "double_bit": 0.0,
    }
    assert [(s.labels["uuid"], s.value) for s in samples["accel_gpu_lost"]] == [("GPU-a", 0.0)]  # GPU-b: no health


def test_health_readings_a_card_lacks_are_left_out() -> None:
    lost = CardHealth(1, "GPU-b", lost=True).to_json()
    gpus = [{"index": 1, "uuid": "GPU-b", "name": "NVIDIA A100", "latest": {}, "energy_j": None, "health": lost}]
    samples = scrape(heartbeat(gpus=gpus))
    assert [s.value for s in samples["accel_gpu_lost"]] == [1.0]
    health = {name for name in samples if name.startswith(("accel_gpu_xid", "accel_gpu_ecc", "accel_gpu_re"))}
    assert health == set()  # no XID, no ECC, no rows or pages: absent, not 0


def test_readings_a_card_lacks_are_left_out_not_zero() -> None:
    samples = scrape(heartbeat())
    assert [s.labels["uuid"] for s in samples["accel_gpu_sm_active_ratio"]] == ["GPU-a"]  # the A100 has no GPM
    assert [s.labels["uuid"] for s in samples["accel_gpu_energy_joules_total"]] == ["GPU-a"]
    assert {s.labels["uuid"] for s in samples["accel_gpu_utilization_ratio"]} == {"GPU-a", "GPU-b"}
    assert "accel_train_eta_seconds" not in scrape(heartbeat(eta_s=None))
    assert scrape(None) == {}  # before the first heartbeat: an empty scrape, not an error


def test_the_slurm_job_id_joins_every_series_under_slurm() -> None:
    samples = scrape(heartbeat(slurm_job_id="4242", gpus=[]))
    assert samples and all(s.labels["slurm_job_id"] == "4242" for found in samples.values() for s in found)
    assert set(RUN_LABELS) < set(GPU_LABELS) and "gpu_info" not in samples


def test_a_cpu_job_without_cards_exports_its_progress_only() -> None:
    samples = scrape(heartbeat(gpus=[], ranks=[{"rank": 0, "local_rank": 0, "device": "cpu", "uuid": None}]))
    assert {name.split("_")[1] for name in samples} == {"run", "train"}


def test_promtool_accepts_the_exposition() -> None:
    from _tools import tool

    promtool = tool("promtool")
    text = Exporter(lambda: heartbeat(slurm_job_id="7")).exposition()
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
    said = (done.stdout + done.stderr).decode()
    assert done.returncode == 0 and not said.strip(), f"promtool's lint: {said}"


@pytest.mark.parametrize("addr", ["0.0.0.0", "::", ""])
def test_a_wildcard_address_is_scraped_by_the_host_name(addr: str) -> None:
    assert Exporter.target_host(addr, "node-a") == "node-a"
    assert Exporter.target_host("10.0.0.5", "node-a") == "10.0.0.5" and Exporter.target_host("::1", "x") == "[::1]"


def test_the_documented_table_is_the_exported_one() -> None:
    """examples/monitoring/README.md lists every metric with its type, unit and labels, as exported."""
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "examples" / "monitoring" / "README.md").read_text()
    rows = [line.split(" | ") for line in readme.splitlines() if line.startswith("| `accel_")]
    documented = {}
    for name, kind, unit, labels, *_ in rows:
        base, _, extra = labels.partition(" + ")
        extras = tuple(label.strip(" `") for label in extra.split(",") if label.strip())
        documented[name.strip("| `")] = (kind, unit, (*{"GPU": GPU_LABELS, "run": RUN_LABELS}[base], *extras))
    assert documented == {m.name: (m.kind, m.unit, m.labels) for m in PROMETHEUS_METRICS}
