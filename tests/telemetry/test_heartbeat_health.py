"""Card health in the heartbeat: the publisher polls the HealthReader on its own thread; a scripted XID 79 shows in
the GPU's `health` entry, fires one `health` alert, survives the reader's check and reaches Prometheus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _fake_nvml import FakeClock, FakeGPU, FakeNVML, install

from lightning_accel.telemetry.health import HealthReader
from lightning_accel.telemetry.heartbeat import read_heartbeats
from lightning_accel.telemetry.heartbeat_alerts import HeartbeatAlerts, HeartbeatAlertSettings
from lightning_accel.telemetry.nvml import resolve_devices
from lightning_accel.telemetry.prometheus import metric_families
from lightning_accel.telemetry.publisher import JobInfo, PublishSettings, RunPublisher

UUID = "GPU-aaaaaaaa-1111-2222-3333-444455556666"


def test_an_xid_79_reaches_the_heartbeat_its_alert_the_reader_and_prometheus(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clock = FakeClock()
    install(monkeypatch, FakeNVML([FakeGPU(UUID, xids=[(100.0, 79)])], clock=clock))
    publisher = RunPublisher(
        PublishSettings(runs_dir=tmp_path, interval_s=2.0),
        JobInfo(
            run_id="r",
            name="n",
            host="h",
            user="u",
            pid=1,
            command="c",
            gpus=[{"index": 0, "uuid": UUID, "name": "H100"}],
        ),
        checks=HeartbeatAlerts(HeartbeatAlertSettings()),
        health=HealthReader(resolve_devices([0]), clock=clock),
        clock=lambda: 1000.0 + clock.t,
    )
    clock.t = 50.0
    publisher.start(threaded=False)
    assert publisher.heartbeat is not None
    assert publisher.heartbeat["gpus"][0]["health"]["problems"] == [] and publisher.heartbeat["alerts"] == []
    for t in (100.0, 102.0, 104.0):
        clock.t = t
        publisher.publish()
    beat = publisher.heartbeat
    assert beat["gpus"][0]["health"]["xid"] == 79
    assert [(a["name"], a["step"]) for a in beat["alerts"]] == [("health", 0)]  # once for the episode
    assert beat["alerts"][0]["message"].startswith("GPU 0: XID 79 (GPU has fallen off the bus)")

    (job,), notes = read_heartbeats(tmp_path)
    assert notes == [] and job.heartbeat["gpus"][0]["health"]["xid"] == 79  # the reader keeps the entry
    families = {family.name: family for family in metric_families(job.heartbeat)}
    (sample,) = families["accel_gpu_xid_last"].samples
    assert sample.value == 79 and sample.labels["uuid"] == UUID
    from lightning_accel.dash.state import DashState, text_report

    report = text_report(DashState(tmp_path, host="h").build())
    assert "health: XID 79 (GPU has fallen off the bus)" in report  # accel-dash --once
    publisher.finish("finished")
    assert json.loads((next(tmp_path.glob("*.json"))).read_text())["status"] == "finished"


def test_a_health_entry_of_the_wrong_shape_is_named() -> None:
    from lightning_accel.telemetry.heartbeat import HeartbeatError, _health

    assert _health({"xid": 79, "lost": False, "error": "", "problems": ["x"]}, "g") == {
        "xid": 79,
        "lost": False,
        "error": "",
        "problems": ["x"],
    }
    with pytest.raises(HeartbeatError, match="g.xid"):
        _health({"xid": [1]}, "g")
    with pytest.raises(HeartbeatError, match="g"):
        _health([1], "g")
