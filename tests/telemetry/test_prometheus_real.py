"""A real Prometheus scrapes it: Debian's `prometheus` on 127.0.0.1 with `file_sd` pointed at the targets directory
while a real 2-rank CPU DDP job (a fake NVML of two GPUs with GPM on its node) trains with `prometheus_port=0`.

Through Prometheus's HTTP API: every metric of `PROMETHEUS_METRICS` arrives with its documented labels (and no
`exported_*` clash with Prometheus's own `job`/`instance`); `rate(accel_gpu_energy_joules_total)` gives back the fake's
power; `promtool check metrics` passes on the exporter's output; every PromQL expression of the shipped Grafana
dashboard returns data, and its DCGM panels join a (fake) dcgm-exporter's cards to the run on host and UUID; the
target disappears once the job ends.

Without prometheus/promtool it skips, saying what to install; under `ACCEL_REQUIRE_TOOLS=1` (CI) it fails instead.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from _fake_train import POWER_W
from _jobs import DDP2, job, log_of
from _tools import tool
from _wait import wait_until

from lightning_accel.telemetry.heartbeat import read_heartbeats
from lightning_accel.telemetry.prometheus import PROMETHEUS_METRICS

DASHBOARD = Path(__file__).parents[2] / "examples" / "monitoring" / "grafana" / "dashboards" / "lightning-accel.json"
RATE_WINDOW = "20s"
UUID_A0 = "GPU-a0aaaaaa-0000-0000-0000-000000000000"  # _fake_train's first card of job letter `a`


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def _fake_dcgm_exporter(host: str) -> Iterator[int]:
    """dcgm-exporter's exposition of this host's first fake card (its label names: `UUID`, `Hostname`)."""
    body = (
        "# HELP DCGM_FI_PROF_SM_ACTIVE Ratio of cycles an SM has at least 1 warp assigned.\n"
        "# TYPE DCGM_FI_PROF_SM_ACTIVE gauge\n"
        f'DCGM_FI_PROF_SM_ACTIVE{{gpu="0",UUID="{UUID_A0}",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",'
        f'Hostname="{host}"}} 0.425\n'
    ).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


IDLE_FOR = "10s"  # the shipped AccelGpuIdleHeld waits 5 minutes; this copy of rules.yml waits 10 s


def _rules(tmp_path: Path) -> Path:
    """examples/monitoring/rules.yml with the idle-held alert's `for` at IDLE_FOR, every other rule as shipped."""
    shipped = (DASHBOARD.parents[2] / "rules.yml").read_text()
    head, tail = shipped.split("- alert: AccelGpuIdleHeld", 1)
    assert "for: 5m" in tail.split("- alert:", 1)[0]
    rules = tmp_path / "rules.yml"
    rules.write_text(head + "- alert: AccelGpuIdleHeld" + tail.replace("for: 5m", f"for: {IDLE_FOR}", 1))
    return rules


@contextmanager
def _prometheus(tmp_path: Path, targets: Path, dcgm_port: int) -> Iterator[str]:
    binary = tool("prometheus")
    port = _free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        json.dumps(
            {  # YAML is a superset of JSON
                "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(_rules(tmp_path))],
                "scrape_configs": [
                    {
                        "job_name": "lightning_accel",
                        "file_sd_configs": [{"files": [f"{targets}/*.json"], "refresh_interval": "1s"}],
                    },
                    {"job_name": "dcgm", "static_configs": [{"targets": [f"127.0.0.1:{dcgm_port}"]}]},
                ],
            }
        )
    )
    log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: _ready(url, proc),
            timeout_s=60,
            what="Prometheus to be ready",
            detail=lambda: (tmp_path / "prometheus.log").read_text()[-2000:],
        )
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _ready(url: str, proc: subprocess.Popen[bytes]) -> bool:
    assert proc.poll() is None, f"prometheus exited {proc.returncode}"
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _api(url: str, path: str, **params: str) -> Any:
    query = urllib.parse.urlencode(params)
    with urllib.request.urlopen(f"{url}/api/v1/{path}?{query}", timeout=20) as response:
        payload = json.loads(response.read())
    assert payload["status"] == "success", payload
    return payload["data"]


def _query(url: str, expr: str) -> list[dict[str, Any]]:
    return _api(url, "query", query=expr)["result"]


def _all(expr: str) -> str:
    """`expr` with the dashboard's variables set to "All", Grafana's rate interval to RATE_WINDOW, its range to 5
    minutes and its interval to the scrape's 1 s."""
    expr = re.sub(r"\$(host|gpu|run)\b", ".*", expr).replace("$__rate_interval", RATE_WINDOW)
    return expr.replace("$__range", "5m").replace("$__interval_ms", "1000").replace("$__interval", "1s")


def _dashboard() -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """The shipped dashboard's panel expressions, (title, PromQL), and its query variables, (name, label, match)."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [
        (panel["title"], _all(target["expr"])) for panel in dashboard["panels"] for target in panel.get("targets", [])
    ]
    variables = []
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match, label = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]["query"]).groups()
            variables.append((variable["name"], label, _all(match)))
    return exprs, variables


@pytest.mark.slow
def test_a_real_prometheus_scrapes_a_training_job(tmp_path: Path) -> None:
    promtool = tool("promtool")
    targets, runs = tmp_path / "targets", tmp_path / "runs"
    host = socket.gethostname()
    overrides = [
        *DDP2,
        "callbacks.gpu_monitor.prometheus_port=0",
        "callbacks.gpu_monitor.readings=null",
        f"callbacks.gpu_monitor.prometheus_file_sd_dir={targets}",
        "data.read_delay_ms=4",
        "+trainer.max_time=00:00:01:00",
        "callbacks.gpu_monitor.run_name=prom-job",
    ]
    with _fake_dcgm_exporter(host) as dcgm_port, _prometheus(tmp_path, targets, dcgm_port) as prom:
        idle = tmp_path / "idle"
        env = {"ACCEL_FAKE_XID": "13@3", "ACCEL_FAKE_IDLE_FILE": str(idle)}
        with job(tmp_path / "ddp", runs, "a", overrides, env=env) as ddp:
            # the job's node writes its target; Prometheus finds it and scrapes it
            wait_until(
                lambda: _query(prom, 'up{job="lightning_accel"} == 1'),
                timeout_s=180,
                what="Prometheus to scrape the job",
                detail=lambda: log_of(tmp_path / "ddp"),
            )
            [job_read] = wait_until(lambda: read_heartbeats(runs)[0], timeout_s=30, what="the heartbeat")
            beat = job_read.heartbeat
            assert beat["ranks"] == [
                {"rank": 0, "local_rank": 0, "device": "cpu", "uuid": None},
                {"rank": 1, "local_rank": 1, "device": "cpu", "uuid": None},
            ]
            with urllib.request.urlopen(beat["metrics_url"], timeout=10) as response:
                exposition = response.read()
            done = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, timeout=60)
            assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout + done.stderr
            assert not re.search(rb'[{,](job|instance)="', exposition)  # never our labels

            # scrapes over a whole RATE_WINDOW, of the step and of every card's energy counter (a series younger than
            # the window has its rate scaled down: the cards' series start with the sampler's first reading, after
            # the step's, and a CI run once read both cards' rates 10% low from that)
            def _old_enough() -> bool:
                steps = _query(prom, f"count_over_time(accel_train_global_step[{RATE_WINDOW}])")
                cards = _query(prom, f"count_over_time(accel_gpu_energy_joules_total[{RATE_WINDOW}])")
                counts = [float(r["value"][1]) for r in steps + cards]
                return len(steps) >= 1 and len(cards) >= len(POWER_W) and min(counts) >= 19

            wait_until(_old_enough, timeout_s=60, what=f"series as old as {RATE_WINDOW}", interval_s=0.5)

            # every documented metric, with its documented labels
            series = _api(prom, "series", **{"match[]": '{__name__=~"accel_.+"}'})
            names = {s["__name__"] for s in series}
            # the fake cards are Hopper: retired pages are read before Ampere only (tests/telemetry/test_health.py)
            expected = {m.name for m in PROMETHEUS_METRICS} - {
                "accel_gpu_retired_pages",
                "accel_gpu_retired_pages_pending",
            }
            assert names == expected, names ^ expected
            (xid,) = _query(
                prom, "accel_gpu_xid_last"
            )  # the scripted XID 13 on the first card, through the health reader
            assert float(xid["value"][1]) == 13 and xid["metric"]["gpu"] == "0", xid
            documented = {m.name: set(m.labels) for m in PROMETHEUS_METRICS}
            for labels in series:
                own = set(labels) - {"__name__", "job", "instance"}
                assert own == documented[labels["__name__"]], labels
                assert (labels["host"], labels["run_id"], labels["job"]) == (host, beat["run_id"], "lightning_accel")

            # the energy counter's rate is the fake's power
            rates = {
                r["metric"]["uuid"]: float(r["value"][1])
                for r in _query(prom, f"rate(accel_gpu_energy_joules_total[{RATE_WINDOW}])")
            }
            for index, power_w in enumerate(POWER_W):
                [rate] = [value for uuid, value in rates.items() if uuid.startswith(f"GPU-a{index}")]
                assert abs(rate - power_w) < 0.1 * power_w, rates

            # every expression of the shipped dashboard returns data, and every variable has values
            exprs, variables = _dashboard()
            assert len(exprs) >= 14 and [name for name, _, _ in variables] == ["host", "gpu", "run"]
            assert [(title, expr) for title, expr in exprs if not _query(prom, expr)] == []
            for name, label, match in variables:
                assert _api(prom, f"label/{label}/values", **{"match[]": match}), name

            # DCGM's card joins our run on host and UUID; the card DCGM does not list shows ours
            sm_panel = next(expr for title, expr in exprs if title.startswith("SM active"))
            joined = {r["metric"]["uuid"]: r for r in _query(prom, sm_panel)}
            dcgm, ours = joined[UUID_A0], next(r for u, r in joined.items() if u.startswith("GPU-a1"))
            assert float(dcgm["value"][1]) == 0.425 and dcgm["metric"]["run_id"] == beat["run_id"]
            assert dcgm["metric"]["gpu"] == "0" and dcgm["metric"]["host"] == host
            assert ours["metric"]["__name__"] == "accel_gpu_sm_active_ratio"

            # the job's cards go idle while it holds their memory: the idle-held alert fires (read through the
            # HTTP API), on each card, with the run's labels; its recording rules give the usage row its data
            assert not [a for a in _api(prom, "alerts")["alerts"] if a["labels"]["alertname"] == "AccelGpuIdleHeld"]
            idle.touch()
            idle_at = time.monotonic()
            firing = wait_until(
                lambda: [
                    a
                    for a in _api(prom, "alerts")["alerts"]
                    if a["labels"]["alertname"] == "AccelGpuIdleHeld" and a["state"] == "firing"
                ],
                timeout_s=60,
                what="the idle-held alert to fire",
            )
            print(
                f"AccelGpuIdleHeld fired {time.monotonic() - idle_at:.1f} s after the cards went idle (for: {IDLE_FOR})"
            )
            assert {a["labels"]["run_id"] for a in firing} == {beat["run_id"]}
            assert {a["labels"]["uuid"][:6] for a in firing} <= {"GPU-a0", "GPU-a1"}
            idle.unlink()

            # the job ends: its target goes, and Prometheus drops it
            ddp.wait(timeout=180)
            assert ddp.returncode == 0, log_of(tmp_path / "ddp")
        assert list(targets.iterdir()) == []
        wait_until(
            lambda: not [t for t in _api(prom, "targets")["activeTargets"] if t["labels"]["job"] == "lightning_accel"],
            timeout_s=30,
            what="Prometheus to drop the ended job's target",
        )
