"""The heartbeat publisher over a scripted sampler: what a heartbeat holds, finished and failed, failures that warn
once and never raise, and the Prometheus pieces it starts and removes (/metrics, file_sd target, textfile)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
from _fake_nvml import FakeClock, FakeGPU, FakeNVML, install

from lightning_accel.telemetry.heartbeat import read_heartbeat
from lightning_accel.telemetry.nvml import resolve_devices
from lightning_accel.telemetry.publisher import JobInfo, PublishSettings, RunPublisher
from lightning_accel.telemetry.readings import DeviceReader
from lightning_accel.telemetry.sampler import NVMLSampler

WALL = 1_700_000_000.0


def job(**changes: object) -> JobInfo:
    values = {
        "run_id": "r1",
        "name": "tiny",
        "host": "node-a",
        "user": "ada",
        "pid": 7,
        "command": "accel-train",
        "ranks": [
            {"rank": 0, "local_rank": 0, "device": "cuda:0", "uuid": "GPU-a"},
            {"rank": 1, "local_rank": 1, "device": "cuda:1", "uuid": "GPU-b"},
        ],
        "gpus": [{"index": 0, "uuid": "GPU-a", "name": "H100"}, {"index": 1, "uuid": "GPU-b", "name": "A100"}],
        "max_steps": 100,
    }
    values.update(changes)
    return JobInfo(**values)  # type: ignore[arg-type]


def scripted(monkeypatch: pytest.MonkeyPatch, clock: FakeClock) -> NVMLSampler:
    gpus = [
        FakeGPU("GPU-a", power_mw=lambda t: 200_000 + 10_000 * t, energy_mj=lambda t: 300_000.0 * t),
        FakeGPU("GPU-b", architecture=8, utilization=55.0),
    ]  # an A100: no GPM
    install(monkeypatch, FakeNVML(gpus, clock=clock))
    readers = [DeviceReader(d) for d in resolve_devices([0, 1])]
    return NVMLSampler(readers, clock=clock, views=1)


def test_a_heartbeat_holds_the_window_the_progress_and_the_history(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clock, wall = FakeClock(), FakeClock(WALL)
    sampler = scripted(monkeypatch, clock)
    sampler.start(threaded=False)
    publisher = RunPublisher(PublishSettings(runs_dir=tmp_path / "runs"), job(), sampler, clock=wall)
    publisher.start(threaded=False)
    first = read_heartbeat(tmp_path / "runs" / "r1.node-a.0.json")
    assert (first["status"], first["step"], first["samples_per_s"], first["gpus"][0]["latest"]) == (
        "running",
        0,
        None,
        {},
    )
    for second in range(1, 11):  # 10 s of readings, 32 samples per step, 2 steps a second
        clock.t, wall.t = float(second), WALL + second
        sampler.sample_once()
        publisher.progress.step, publisher.progress.samples = 2 * second, 64 * second
    publisher.publish()
    beat = read_heartbeat(publisher.path)
    gpu_a, gpu_b = beat["gpus"]
    assert gpu_a["latest"]["power_w"] == pytest.approx(200 + 10 * (1 + 10) / 2)  # time-weighted mean of 1..10 s
    assert gpu_a["latest"]["sm_activity_pct"] == 80.0 and "sm_activity_pct" not in gpu_b["latest"]  # GPM: Hopper
    assert gpu_a["energy_j"] == pytest.approx(300.0 * 10) and gpu_b["latest"]["utilization_pct"] == 55.0
    assert (beat["step"], beat["samples"], beat["samples_per_s"], beat["eta_s"]) == (20, 640, 64.0, 40.0)
    assert beat["ranks"][1] == {"rank": 1, "local_rank": 1, "device": "cuda:1", "uuid": "GPU-b"}
    assert beat["history"]["t"] == [WALL + 10] and gpu_a["history"]["power_w"] == [gpu_a["latest"]["power_w"]]
    assert "sm_activity_pct" not in gpu_b["history"] and gpu_b["history"]["utilization_pct"] == [55.0]
    assert beat["updated"] == WALL + 10 and beat["started"] == WALL
    publisher.finish("finished")
    publisher.finish("failed", "ignored: the first call decides")
    final = read_heartbeat(publisher.path)
    assert (final["status"], final["reason"], final["eta_s"]) == ("finished", "", None)


def test_an_unwritable_runs_dir_warns_once_and_publishing_goes_on(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")  # root ignores permissions, not this
    warned: list[str] = []
    publisher = RunPublisher(
        PublishSettings(runs_dir=blocker / "runs", prometheus_port=0), job(gpus=[], ranks=[]), warn=warned.append
    )
    publisher.start(threaded=False)
    publisher.progress.step = 5
    publisher.publish()
    assert len(warned) == 1 and "cannot be created" in warned[0] and str(blocker / "runs") in warned[0]
    assert publisher.heartbeat is not None and publisher.heartbeat["step"] == 5  # still built, for /metrics
    with urllib.request.urlopen(publisher.metrics_url, timeout=10) as response:
        assert b"accel_train_global_step" in response.read()
    publisher.finish("finished")
    assert len(warned) == 1


def test_a_warn_that_raises_never_reaches_the_caller(tmp_path: Path) -> None:
    def strict(message: str) -> None:
        raise RuntimeError(message)  # as `warnings.simplefilter("error")` would

    blocker = tmp_path / "file"
    blocker.write_text("x")
    publisher = RunPublisher(PublishSettings(runs_dir=blocker / "runs"), job(), warn=strict)
    publisher.start(threaded=False)
    publisher.finish("failed", "boom")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_metrics_target_and_textfile_live_while_the_job_runs(tmp_path: Path) -> None:
    settings = PublishSettings(
        runs_dir=tmp_path / "runs",
        prometheus_port=0,
        file_sd_dir=tmp_path / "targets",
        textfile_dir=tmp_path / "textfile",
    )
    publisher = RunPublisher(settings, job(run_id="../../escape"))
    publisher.start(threaded=False)
    [target] = list((tmp_path / "targets").iterdir())
    assert target.name == "_._.._escape.node-a.0.target.json"  # inside the directory, whatever the run id
    port = int(publisher.metrics_url.rsplit(":", 1)[1].split("/")[0])
    assert json.loads(target.read_text()) == [
        {"targets": [f"127.0.0.1:{port}"], "labels": {"__lightning_accel_schema": "lightning_accel.target/1"}}
    ]
    with urllib.request.urlopen(publisher.metrics_url, timeout=10) as response:
        served = response.read().decode()
    assert 'accel_run_info{host="node-a",name="tiny",rank="0",run_id="../../escape",user="ada"} 1.0' in served
    [textfile] = list((tmp_path / "textfile").iterdir())
    assert textfile.name == "accel__._.._escape.node-a.0.prom" and "accel_train_global_step" in textfile.read_text()
    assert read_heartbeat(publisher.path)["metrics_url"] == publisher.metrics_url
    publisher.finish("finished")
    assert list((tmp_path / "targets").iterdir()) == [] and list((tmp_path / "textfile").iterdir()) == []
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_a_taken_port_warns_naming_the_setting(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        warned: list[str] = []
        settings = PublishSettings(runs_dir=tmp_path, prometheus_port=port, file_sd_dir=tmp_path / "targets")
        publisher = RunPublisher(settings, job(), warn=warned.append)
        publisher.start(threaded=False)
        publisher.finish("finished")
    assert len(warned) == 1 and f"127.0.0.1:{port}" in warned[0] and "`prometheus_port`" in warned[0]
    assert publisher.metrics_url is None and not (tmp_path / "targets").exists()
    assert read_heartbeat(publisher.path)["status"] == "finished"


def test_the_thread_publishes_until_finished(tmp_path: Path) -> None:
    from _wait import wait_until

    publisher = RunPublisher(PublishSettings(runs_dir=tmp_path, interval_s=0.2), job(gpus=[], ranks=[]))
    publisher.start()
    first = publisher.heartbeat["updated"]
    publisher.progress.step = 3
    wait_until(lambda: read_heartbeat(publisher.path)["step"] == 3, timeout_s=10, what="a heartbeat from the thread")
    assert read_heartbeat(publisher.path)["updated"] > first
    publisher.finish("failed", "stopped by SIGTERM at step 3")
    assert publisher._thread is None
    final = read_heartbeat(publisher.path)
    assert (final["status"], final["reason"]) == ("failed", "stopped by SIGTERM at step 3")


def test_a_process_that_exits_without_finishing_marks_its_heartbeat_failed(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        from pathlib import Path
        from lightning_accel.telemetry.publisher import JobInfo, PublishSettings, RunPublisher
        job = JobInfo(run_id="exit", name="n", host="h", user="u", pid=1, command="c")
        RunPublisher(PublishSettings(runs_dir=Path({str(tmp_path)!r})), job).start()
        raise SystemExit(3)  # as an uncaught error outside the fit would
    """)
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 3, done.stderr
    beat = read_heartbeat(tmp_path / "exit.h.0.json")
    assert (beat["status"], beat["reason"]) == ("failed", "the process exited before the fit ended")


def test_a_publisher_never_started_writes_nothing(tmp_path: Path) -> None:
    """A fit that fails before training (in the sanity check, say) ends its publisher without a heartbeat."""
    warned: list[str] = []
    publisher = RunPublisher(PublishSettings(runs_dir=tmp_path / "runs"), job(), warn=warned.append)
    publisher.finish("failed", "ValueError at step 0: bad batch")
    assert not (tmp_path / "runs").exists() and warned == [] and publisher.heartbeat is None
