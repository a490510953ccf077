"""GPUMonitor publishing in real fits on CPU: the heartbeat of a CPU job and of a job with a scripted fake NVML,
finished and failed, an unwritable runs directory that warns once while training goes on, /metrics while it trains."""

from __future__ import annotations

import signal
import socket
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import _gpu_monitor_cases as cases
import lightning.pytorch as pl
import pytest
from _fake_nvml import FakeClock, FakeGPU, FakeNVML, install
from _tiny import TinyRegression

from lightning_accel.callbacks.gpu_monitor import GPUMonitor
from lightning_accel.callbacks.stop_on_signal import SignalExit
from lightning_accel.errors import LightningAccelWarning
from lightning_accel.telemetry.heartbeat import read_heartbeat, read_heartbeats


def fit(
    monitor: GPUMonitor,
    tmp_path: Path,
    model: pl.LightningModule | None = None,
    max_steps: int = 12,
    extra: tuple[pl.Callback, ...] = (),
) -> tuple[pl.Trainer, list[str], BaseException | None]:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        log_every_n_steps=5,
        callbacks=[*extra, monitor],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path / "run",
    )
    raised = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model or TinyRegression(), cases.loader(batches=20))
        except BaseException as err:  # SignalExit is a SystemExit
            raised = err
    return trainer, [str(w.message) for w in caught if issubclass(w.category, LightningAccelWarning)], raised


def only_heartbeat(runs: Path) -> dict[str, Any]:
    [path] = list(runs.iterdir())
    return read_heartbeat(path)


def test_a_cpu_job_publishes_without_cards_and_without_a_warning(tmp_path: Path) -> None:
    monitor = GPUMonitor(log_metrics=False, runs_dir=tmp_path / "runs", run_name="cpu job")
    trainer, warned, _ = fit(monitor, tmp_path)
    beat = only_heartbeat(tmp_path / "runs")
    assert warned == [] and trainer.global_step == 12 and monitor.sampler is None
    assert (beat["status"], beat["name"], beat["gpus"], beat["step"], beat["max_steps"]) == (
        "finished",
        "cpu job",
        [],
        12,
        12,
    )
    assert beat["samples"] == 12 * 2 and beat["ranks"] == [{"rank": 0, "local_rank": 0, "device": "cpu", "uuid": None}]
    assert monitor.heartbeat_file == tmp_path / "runs" / f"{beat['run_id']}.{beat['host']}.0.json"
    assert monitor._publisher is None  # nothing left running


def test_the_logging_monitor_on_cpu_says_the_heartbeat_still_publishes(tmp_path: Path) -> None:
    _, warned, _ = fit(GPUMonitor(runs_dir=tmp_path / "runs", print_report=False), tmp_path)
    assert len(warned) == 1 and "(its heartbeat still publishes the job)" in warned[0]
    _, warned, _ = fit(GPUMonitor(publish=False, print_report=False), tmp_path)
    assert len(warned) == 1 and "still publishes" not in warned[0]


def test_the_heartbeat_carries_the_cards_and_logging_still_gets_its_own_windows(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clock = FakeClock()
    gpus = [
        FakeGPU("GPU-aaaa", power_mw=lambda t: 100_000 + 20_000 * t, energy_mj=lambda t: 250_000.0 * t),
        FakeGPU("GPU-bbbb", architecture=8, utilization=42.0),
    ]
    install(monkeypatch, FakeNVML(gpus, clock=clock))
    monkeypatch.setattr(GPUMonitor, "_clock", staticmethod(clock))
    monkeypatch.setattr(GPUMonitor, "_threaded", False)
    monitor = GPUMonitor(
        device_indices=[0, 1],
        runs_dir=tmp_path / "runs",
        print_report=False,
        plot=False,
        report_dir=tmp_path / "report",
        warmup_steps=1000,
    )
    recorder = cases.RecordingLogger()
    driver = cases.Driver(clock, monitor)  # one reading after each batch, time moving 0.5, 0.25, 0.5, ...
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=10,
        log_every_n_steps=5,
        callbacks=[driver, monitor],
        logger=[recorder],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(TinyRegression(), cases.loader(batches=20))
    beat = only_heartbeat(tmp_path / "runs")
    gpu_a, gpu_b = beat["gpus"]
    elapsed = sum(cases.dt(s) for s in range(10))
    # the publisher's view took every reading of the fit (its thread is off here), the logging view its own windows
    assert gpu_a["latest"]["power_w"] == pytest.approx(monitor.report.gpus["gpu/0"]["power_w"].mean)
    assert gpu_a["energy_j"] == pytest.approx(250.0 * elapsed) and gpu_b["latest"]["utilization_pct"] == 42.0
    assert "sm_activity_pct" in gpu_a["latest"] and "sm_activity_pct" not in gpu_b["latest"]
    assert [g["uuid"] for g in beat["gpus"]] == ["GPU-aaaa", "GPU-bbbb"] and beat["status"] == "finished"
    assert recorder.at(4)["gpu/0/power_w"] == pytest.approx(
        sum((100 + 20 * t) * w for t, w in _readings(0, 5)) / sum(w for _, w in _readings(0, 5))
    )


def _readings(first: int, count: int) -> list[tuple[float, float]]:
    """(time, weight) of the Driver's readings `first` .. `first + count - 1`."""
    times = [sum(cases.dt(s) for s in range(n + 1)) for n in range(first + count)]
    return [(times[n], cases.dt(n)) for n in range(first, first + count)]


class _Boom(TinyRegression):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == 3:
            raise RuntimeError("the loss went to the moon")
        return super().training_step(batch, batch_idx)


class _Signal(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 5:
            raise SignalExit(signal.SIGTERM)  # what StopOnSignal raises on every rank


@pytest.mark.parametrize("how", ["error", "signal"])
def test_a_crash_or_a_signal_marks_the_job_failed_with_the_reason(tmp_path: Path, how: str) -> None:
    monitor = GPUMonitor(log_metrics=False, runs_dir=tmp_path / "runs")
    model, extra = (_Boom(), ()) if how == "error" else (TinyRegression(), (_Signal(),))
    _, _, raised = fit(monitor, tmp_path, model=model, extra=extra)
    assert raised is not None
    beat = only_heartbeat(tmp_path / "runs")
    reason = {"error": "RuntimeError at step 3: the loss went to the moon", "signal": "stopped by SIGTERM at step 5"}
    assert (beat["status"], beat["reason"]) == ("failed", reason[how])


def test_an_unwritable_runs_dir_warns_once_and_training_goes_on(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the runs directory should be")
    monitor = GPUMonitor(log_metrics=False, runs_dir=blocker / "runs", publish_interval_s=0.2)
    trainer, warned, raised = fit(monitor, tmp_path, model=_SlowSteps(), max_steps=8)
    assert raised is None and trainer.global_step == 8
    assert len(warned) == 1 and warned[0].startswith("GPUMonitor: the runs directory")
    assert "cannot be created" in warned[0] and warned[0].endswith("Training goes on.")


class _SlowSteps(TinyRegression):
    """A step of 50 ms: the publisher's thread has time to try (and fail) a few times."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        import time

        time.sleep(0.05)
        return super().training_step(batch, batch_idx)


class _Scrape(pl.Callback):
    """Scrapes the monitor's /metrics once, mid-fit."""

    def __init__(self, monitor: GPUMonitor) -> None:
        self.monitor, self.text = monitor, ""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 6 and self.monitor.metrics_url:
            with urllib.request.urlopen(self.monitor.metrics_url, timeout=10) as response:
                self.text = response.read().decode()


def test_metrics_and_the_file_sd_target_live_exactly_while_it_trains(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    install(monkeypatch, FakeNVML([FakeGPU("GPU-cccc", power_mw=123_000.0)]))
    monitor = GPUMonitor(
        device_indices=[0],
        log_metrics=False,
        runs_dir=tmp_path / "runs",
        prometheus_port=0,
        prometheus_file_sd_dir=tmp_path / "targets",
        interval_s=0.05,
        publish_interval_s=0.2,
    )
    scrape = _Scrape(monitor)
    seen_targets: list[str] = []

    class _Targets(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            seen_targets.extend(p.name for p in (tmp_path / "targets").iterdir())

    fit(monitor, tmp_path, model=_SlowSteps(), max_steps=12, extra=(scrape, _Targets()))
    assert 'accel_train_global_step{host="' in scrape.text and 'uuid="GPU-cccc"' in scrape.text
    assert seen_targets and list((tmp_path / "targets").iterdir()) == []  # written while training, removed after
    port = int(monitor.metrics_url.rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0  # the server is gone


def test_jobs_found_by_read_heartbeats(tmp_path: Path) -> None:
    for name in ("first", "second"):
        fit(GPUMonitor(log_metrics=False, runs_dir=tmp_path / "runs", run_name=name), tmp_path)
    jobs, notes = read_heartbeats(tmp_path / "runs")
    assert sorted(job.heartbeat["name"] for job in jobs) == ["first", "second"] and notes == []
    assert len({job.heartbeat["run_id"] for job in jobs}) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"publish_interval_s": 0.1}, "publish_interval_s=0.1"),
        ({"publish_interval_s": "2"}, "publish_interval_s='2'"),
        ({"prometheus_port": 70000}, "prometheus_port=70000"),
        ({"prometheus_port": True}, "prometheus_port=True"),
        ({"prometheus_addr": ""}, "prometheus_addr=''"),
        ({"prometheus_file_sd_dir": "/shared/targets"}, "prometheus_port=None` serves none; set `prometheus_port=0"),
    ],
)
def test_bad_publishing_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        GPUMonitor(**kwargs)


def test_the_docstring_names_every_exported_metric_and_the_configs_every_option() -> None:
    import inspect

    from omegaconf import OmegaConf

    from lightning_accel.telemetry.prometheus import PROMETHEUS_METRICS

    doc = GPUMonitor.__doc__ or ""
    assert [m.name for m in PROMETHEUS_METRICS if f"`{m.name}`" not in doc] == []
    conf = Path(__file__).parents[2] / "conf" / "callbacks"
    options = set(inspect.signature(GPUMonitor.__init__).parameters) - {"self"}
    for name in ("monitor.yaml", "gpu_monitor.yaml"):  # every option overridable without a `+`
        node = OmegaConf.to_container(OmegaConf.load(conf / name)["gpu_monitor"])
        assert set(node) - {"_target_"} == options, name


def test_a_fit_prunes_its_old_heartbeats_and_leaves_the_users_files(tmp_path: Path) -> None:
    """A week-old `results.json`, `config.json` or `draft.tmp` in the runs directory was deleted by one training run;
    a real fit now removes its own old heartbeat and nothing else (same suffix, same age, same owner)."""
    import json
    import os
    import time

    from lightning_accel.telemetry.heartbeat import SCHEMA, heartbeat_path, write_json_atomic

    runs = tmp_path / "runs"
    old = heartbeat_path(runs, "old", "node-a", 0)
    write_json_atomic(old, {"schema": SCHEMA, "run_id": "old", "host": "node-a", "node_rank": 0, "status": "finished"})
    planted = {
        "results.json": b'{"accuracy": 0.91}',
        "config.json": b'{"lr": 0.0003}',
        "draft.tmp": b"half a thought",
        ".draft.tmp": b"hidden",
        "run.host.0.json": b'{"step": 1}',
        "copy.node-a.0.json": json.dumps(
            {"schema": SCHEMA, "run_id": "old", "host": "node-a", "node_rank": 0}
        ).encode(),
    }
    week_ago = time.time() - 10 * 86400
    for name, data in planted.items():
        (runs / name).write_bytes(data)
    for path in [old, *(runs / name for name in planted)]:
        os.utime(path, (week_ago, week_ago))
    monitor = GPUMonitor(log_metrics=False, runs_dir=runs, run_name="now")
    _, warned, raised = fit(monitor, tmp_path, max_steps=4)
    assert raised is None and warned == [] and not old.exists()
    assert {name: (runs / name).read_bytes() for name in planted} == planted
    assert sorted(p.name for p in runs.iterdir()) == sorted([*planted, monitor.heartbeat_file.name])
