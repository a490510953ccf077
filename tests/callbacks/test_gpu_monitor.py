"""GPUMonitor in real fits on CPU with a scripted fake NVML: logged windows, alerts, report, failures, resume, DDP."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import itertools
import json
import os
import pickle
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _gpu_monitor_cases as cases
import lightning.pytorch as pl
import pytest
from _fake_nvml import FakeClock, FakeGPU, FakeNVML, install
from _tiny import TinyRegression
from _wait import wait_until
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from omegaconf import OmegaConf

import lightning_accel.telemetry.nvml as nvml_module
from lightning_accel.callbacks.gpu_monitor import GPUMonitor
from lightning_accel.errors import LightningAccelWarning
from lightning_accel.telemetry.readings import METRICS

CONF = Path(__file__).parents[2] / "conf" / "callbacks" / "gpu_monitor.yaml"
LOG_STEPS = [4, 9, 14, 19, 24, 29]  # log_every_n_steps=5 over 3 epochs of 10 batches
T = list(itertools.accumulate(cases.dt(s) for s in range(30)))  # the fake time of the reading after batch s


def _gpu0_util(t: float) -> float:
    return min(100.0, 20.0 * t)


def _gpu1_util(t: float) -> float:
    return 95.0 if t < 9 else 20.0


def _script() -> list[FakeGPU]:
    """GPU 0 heats up (thermal throttling from t=6 s); GPU 1 fills its memory and then starves (from t=9 s)."""
    return [
        FakeGPU(
            "GPU-aaaaaaaa-0000",
            utilization=_gpu0_util,
            power_mw=lambda t: 300_000 + 10_000 * t,
            throttle_mask=lambda t: 0x20 if t >= 6 else 0,
            energy_mj=lambda t: 5e9 + 350_000 * t,
        ),
        FakeGPU(
            "GPU-bbbbbbbb-0000",
            name="NVIDIA A100-SXM4-80GB",
            utilization=_gpu1_util,
            architecture=8,
            memory_used_mib=lambda t: 60_000 + 2_000 * t,
            unsupported={"nvmlDeviceGetPcieThroughput"},
        ),
    ]


def _expected(f: Callable[[float], float], window: int) -> tuple[float, float, float]:
    """Mean (each reading weighted by the time since the previous one), min and max of f over a logging window."""
    samples = range(5 * window, 5 * window + 5)
    values = [f(T[s]) for s in samples]
    weights = [cases.dt(s) for s in samples]
    mean = sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)
    return mean, min(values), max(values)


class Run:
    """One fit with the fake NVML installed and time scripted by the Driver."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path,
        fake: FakeNVML | None = None,
        clock: FakeClock | None = None,
    ) -> None:
        self.clock = clock or FakeClock()
        self.fake = fake if fake is not None else FakeNVML(_script(), clock=self.clock)
        self.fake.clock = self.clock
        install(monkeypatch, self.fake)
        monkeypatch.setattr(GPUMonitor, "_clock", staticmethod(self.clock))
        monkeypatch.setattr(GPUMonitor, "_threaded", False)
        self.tmp_path = tmp_path

    def fit(
        self,
        monitor: GPUMonitor,
        max_epochs: int = 3,
        first_sample: int = 0,
        ckpt_path: str | None = None,
        extra: tuple[pl.Callback, ...] = (),
    ) -> tuple[pl.Trainer, cases.RecordingLogger, list[str]]:
        driver = cases.Driver(self.clock, monitor)
        driver.samples = first_sample
        recorder = cases.RecordingLogger()
        trainer = pl.Trainer(
            accelerator="cpu",
            max_epochs=max_epochs,
            log_every_n_steps=5,
            callbacks=[driver, monitor, *extra],
            logger=[CSVLogger(self.tmp_path / "logs"), recorder],
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=bool(extra),
            default_root_dir=self.tmp_path,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(TinyRegression(), cases.loader(), ckpt_path=ckpt_path)
        return trainer, recorder, [str(w.message) for w in caught if issubclass(w.category, LightningAccelWarning)]


def _monitor(**kwargs: Any) -> GPUMonitor:
    return GPUMonitor(**{"device_indices": [0, 1], "warmup_steps": 10, "print_report": False, **kwargs})


def _ours(recorder: cases.RecordingLogger) -> dict[int, dict[str, float]]:
    """Our metrics by step (our keys only; Lightning logs nothing else here)."""
    steps: dict[int, dict[str, float]] = {}
    for step, metrics in recorder.records:
        for key, value in metrics.items():
            if key.split("/")[0] in ("gpu", "gpus", "ranks", "gpu_monitor"):
                steps.setdefault(step, {})[key] = value
    return steps


@dataclasses.dataclass(frozen=True)
class Scripted:
    """What the fit of `_script()` left: the tests below each check one aspect of it."""

    monitor: GPUMonitor
    trainer: pl.Trainer
    logged: dict[int, dict[str, float]]  # our metrics by step
    warned: list[str]  # our warnings' messages
    printed: str  # stdout of the fit
    run_dir: Path  # the CSV logger's directory

    def report(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "gpu_report.json").read_text())


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Scripted:
    """One fit of 3 epochs over `_script()`'s GPUs, shared by the tests of what it logs, warns and reports."""
    tmp_path = tmp_path_factory.mktemp("scripted")
    with pytest.MonkeyPatch.context() as monkeypatch, contextlib.redirect_stdout(io.StringIO()) as out:
        monitor = _monitor(print_report=True)
        trainer, recorder, warned = Run(monkeypatch, tmp_path).fit(monitor)
    return Scripted(monitor, trainer, _ours(recorder), warned, out.getvalue(), Path(trainer.loggers[0].log_dir))


def test_a_window_at_every_log_step_and_the_summary_at_the_end(scripted: Scripted) -> None:
    assert scripted.trainer.global_step == 30
    assert sorted(scripted.logged) == [*LOG_STEPS, 30]  # 30: the summary at the end


def test_every_window_logs_every_reading_and_its_stats(scripted: Scripted) -> None:
    per_gpu = {k.split("/", 2)[2] for k in scripted.logged[14] if k.startswith("gpu/0/")}
    expected_keys = {m.name for m in METRICS} | {
        f"{m.name}/{s}" for m in METRICS for s in ("min", "max") if s in m.stats
    }
    assert per_gpu == expected_keys
    for step in LOG_STEPS:
        assert {k for k in scripted.logged[step] if k.startswith("gpu/0/")} == {f"gpu/0/{k}" for k in per_gpu}, step


@pytest.mark.parametrize("window", range(len(LOG_STEPS)))
def test_window_values_follow_the_script(scripted: Scripted, window: int) -> None:
    got = scripted.logged[LOG_STEPS[window]]
    util0, util1 = _expected(_gpu0_util, window), _expected(_gpu1_util, window)
    assert (
        got["gpu/0/utilization_pct"],
        got["gpu/0/utilization_pct/min"],
        got["gpu/0/utilization_pct/max"],
    ) == pytest.approx(util0, abs=1e-9)
    assert got["gpu/1/utilization_pct"] == pytest.approx(util1[0], abs=1e-9)
    assert got["gpu/0/power_w"] == pytest.approx(_expected(lambda t: 300 + 10 * t, window)[0], abs=1e-9)
    used = _expected(lambda t: 60_000 + 2_000 * t, window)
    assert (got["gpu/1/memory_used_mib"], got["gpu/1/memory_used_mib/max"]) == pytest.approx(used[::2], abs=1e-6)
    assert got["gpu/1/memory_used_pct/max"] == pytest.approx(100 * used[2] / 81_559, abs=1e-9)
    thermal = _expected(lambda t: float(t >= 6), window)[0]
    assert got["gpu/0/throttle_thermal_frac"] == got["gpu/0/throttle_any_frac"] == pytest.approx(thermal)
    assert got["gpu/0/energy_wh"] == pytest.approx(350 * T[5 * window + 4] / 3600)
    assert got["gpus/utilization_pct/max"] == pytest.approx(max(util0[0], util1[0]), abs=1e-9)


def test_readings_a_gpu_cannot_give_are_left_out(scripted: Scripted) -> None:
    for step in LOG_STEPS:
        got = scripted.logged[step]
        assert got["gpu/0/tensor_activity_pct"] == 50.0 and "gpu/1/tensor_activity_pct" not in got, step  # GPM: Hopper
        assert "gpu/1/pcie_rx_mb_s" not in got and got["gpu/0/pcie_rx_mb_s"] == 1.0, step  # NotSupported: dropped


def test_one_process_logs_its_overhead_and_no_rank_keys(scripted: Scripted) -> None:
    for step in LOG_STEPS:
        got = scripted.logged[step]
        assert 0 <= got["gpu_monitor/overhead_pct"] < 100, step
        assert not any(k.startswith("ranks/") for k in got), step


def test_each_alert_once_at_the_step_the_script_implies(scripted: Scripted) -> None:
    # windows before warmup_steps=10 are not checked: GPU 0 is idle at first
    alerts = {
        k.rsplit("/", 1)[1]: s for s, got in scripted.logged.items() for k in got if k.startswith("gpu_monitor/alert/")
    }
    assert alerts == {"throttling": 19, "memory_headroom": 24, "low_utilization": 29}


def test_each_alert_warns_once_and_says_what_it_saw(scripted: Scripted) -> None:
    warned = scripted.warned
    assert len(warned) == 3 and [w.split(":")[0] for w in warned] == [f"GPUMonitor at step {s}" for s in (19, 24, 29)]
    assert "`gpu/0` ran with reduced clocks 100% of the last 1.8 s (thermal 100%" in warned[0]
    assert "`gpu/1` peaked at 96.9% of its memory" in warned[1] and "`gpu/1` was busy 20%" in warned[2]


def test_the_report_is_written_beside_the_logs_and_printed(scripted: Scripted) -> None:
    files = scripted.monitor.report_files
    assert [p.name for p in files] == ["gpu_report.json", "gpu_report.md", "gpu_report.png"]
    assert all(p.parent == scripted.run_dir and p.stat().st_size > 0 for p in files)
    assert "| gpu/1 | NVIDIA A100-SXM4-80GB |" in (scripted.run_dir / "gpu_report.md").read_text()
    assert "GPUMonitor report" in scripted.printed
    csv_header = (scripted.run_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "gpu/0/utilization_pct" in csv_header and len(csv_header) == len(set(csv_header))  # every logger


def test_the_report_totals_follow_the_script(scripted: Scripted) -> None:
    report = scripted.report()
    gpu0, gpu1 = report["gpus"]
    assert (gpu0["gpu"], gpu0["name"], gpu1["name"]) == ("gpu/0", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB")
    assert gpu0["utilization_mean_pct"] == pytest.approx(sum(_gpu0_util(T[s]) * cases.dt(s) for s in range(30)) / T[-1])
    assert gpu0["utilization_peak_pct"] == 100.0 and gpu0["temperature_max_c"] == 60.0
    assert gpu0["energy_wh"] == pytest.approx(350 * T[-1] / 3600) and gpu0["seconds"] == pytest.approx(T[-1])
    assert gpu0["throttled_pct"] == pytest.approx(100 * (T[-1] - T[14]) / T[-1])
    assert gpu1["memory_peak_gib"] == pytest.approx((60_000 + 2_000 * T[-1]) / 1024)
    assert [a["name"] for a in report["alerts"]] == ["throttling", "memory_headroom", "low_utilization"]
    assert report["fit_seconds"] == pytest.approx(T[-1]) and report["monitor_overhead_s"] > 0
    assert scripted.logged[30]["gpu_monitor/summary/gpu/0/energy_wh"] == pytest.approx(gpu0["energy_wh"])


@pytest.mark.parametrize(
    ("visible", "expected"),
    [(None, [10, 20]), ("3,1", [40, 20]), ("GPU-cccc,GPU-aaaa", [30, 10]), ("GPU-dddddddd-0000,0", [40, 10])],
)
def test_cuda_visible_devices_pick_the_gpus(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, visible: str | None, expected: list[float]
) -> None:
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    gpus = [FakeGPU(f"GPU-{c * 8}-0000", utilization=10.0 * (i + 1)) for i, c in enumerate("abcd")]
    monitor = _monitor(report_dir=tmp_path / "report")
    _, recorder, _ = Run(monkeypatch, tmp_path, FakeNVML(gpus)).fit(monitor, max_epochs=1)
    got = _ours(recorder)[4]
    assert [got["gpu/0/utilization_pct"], got["gpu/1/utilization_pct"]] == expected
    uuids = [row["uuid"] for row in json.loads((tmp_path / "report" / "gpu_report.json").read_text())["gpus"]]
    assert uuids == [f"GPU-{'abcd'[int(u / 10) - 1] * 8}-0000" for u in expected]


@pytest.mark.parametrize("broken", ["no_module", "no_library", "bad_index"])
def test_without_nvml_it_warns_once_and_does_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, broken: str
) -> None:
    run = Run(monkeypatch, tmp_path, FakeNVML(_script(), init_error=12 if broken == "no_library" else None))
    if broken == "no_module":
        monkeypatch.setattr(nvml_module, "pynvml", None)
    monitor = _monitor(device_indices=[0, 5] if broken == "bad_index" else [0, 1], report_dir=tmp_path / "report")
    trainer, recorder, warned = run.fit(monitor)
    assert trainer.global_step == 30 and monitor.sampler is None
    assert _ours(recorder) == {} and not (tmp_path / "report").exists()
    message = {
        "no_module": "nvidia-ml-py (module `pynvml`) is not installed",
        "no_library": "NVML is not available (NVMLError_LibraryNotFound: NVML Shared Library Not Found)",
        "bad_index": "`device_indices` entry 5 names no GPU",
    }[broken]
    assert len(warned) == 1 and warned[0].startswith(f"GPUMonitor is off on this node: {message}")
    assert run.fake.inits == run.fake.shutdowns  # NVML released again


def test_a_cpu_trainer_without_device_indices_does_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    run = Run(monkeypatch, tmp_path)
    trainer, recorder, warned = run.fit(_monitor(device_indices=None), max_epochs=1)
    assert trainer.global_step == 10 and _ours(recorder) == {}
    assert len(warned) == 1 and "uses no CUDA device" in warned[0]
    assert sum(run.fake.calls.values()) == 0  # NVML not even initialised


def test_an_nvml_failure_mid_run_does_not_stop_the_fit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    run = Run(monkeypatch, tmp_path, FakeNVML(_script(), fail_at=5.0))  # the reading after batch 12 (t=5 s) fails
    monitor = _monitor(report_dir=tmp_path / "report")
    trainer, recorder, warned = run.fit(monitor)
    assert trainer.global_step == 30
    logged = _ours(recorder)
    assert [s for s in LOG_STEPS if "gpu/0/utilization_pct" in logged.get(s, {})] == [4, 9, 14]
    kept = (_gpu0_util(T[10]) * cases.dt(10) + _gpu0_util(T[11]) * cases.dt(11)) / (cases.dt(10) + cases.dt(11))
    assert logged[14]["gpu/0/utilization_pct"] == pytest.approx(kept)  # the window's 2 readings before the failure
    assert len(warned) == 1 and "NVML failed mid-run (NVMLError_GpuIsLost: GPU is lost)" in warned[0]
    report = json.loads((tmp_path / "report" / "gpu_report.json").read_text())
    assert report["gpus"][0]["seconds"] == pytest.approx(T[11])  # the report keeps what was read
    assert run.fake.shutdowns == run.fake.inits == 1


def test_resuming_continues_the_report(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    whole = _monitor(report_dir=tmp_path / "whole")
    Run(monkeypatch, tmp_path / "a").fit(whole)
    clock = FakeClock()
    run = Run(monkeypatch, tmp_path / "b", clock=clock)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
    first, _, warned_first = run.fit(_monitor(report_dir=tmp_path / "b"), max_epochs=2, extra=(checkpoint,))
    resumed_monitor = _monitor(report_dir=tmp_path / "b")
    _, recorder, warned = run.fit(
        resumed_monitor,
        max_epochs=3,
        first_sample=20,
        extra=(checkpoint,),
        ckpt_path=str(tmp_path / "ckpt" / "epoch=1-step=20.ckpt"),
    )
    assert [w.split(":")[0] for w in warned_first + warned] == [f"GPUMonitor at step {s}" for s in (19, 24, 29)]
    assert sorted(_ours(recorder)) == [24, 29, 30]
    a, b = whole.report.to_dict(), resumed_monitor.report.to_dict()
    skip = {"seconds"}
    assert [{k: v for k, v in g.items() if k not in skip} for g in b["gpus"]] == [
        {k: pytest.approx(v) for k, v in g.items() if k not in skip} for g in a["gpus"]
    ]
    assert [(x["name"], x["step"]) for x in b["alerts"]] == [(x["name"], x["step"]) for x in a["alerts"]]
    assert b["fit_seconds"] == pytest.approx(a["fit_seconds"]) and b["last_step"] == 30
    assert [p["t"] for p in resumed_monitor.report.history] == pytest.approx([p["t"] for p in whole.report.history])


class _StepsAfterAReading(TinyRegression):
    """Each training step first waits for a reading by the monitor's sampler thread taken after the step began."""

    def __init__(self, monitor: GPUMonitor) -> None:
        super().__init__()
        self.monitor = monitor

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        sampler = self.monitor.sampler
        assert sampler is not None, "GPUMonitor's sampler is not running"
        seen = sampler.samples
        wait_until(lambda: sampler.samples > seen, timeout_s=30, what=f"a reading by the sampler (step {batch_idx})")
        return super().training_step(batch, batch_idx)


def test_the_real_thread_samples_during_a_fit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import time

    fake = install(monkeypatch, FakeNVML(_script(), clock=time.monotonic))
    recorder = cases.RecordingLogger()
    monitor = GPUMonitor(device_indices=[0, 1], interval_s=0.01, report_dir=tmp_path, print_report=False, plot=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=20,
        log_every_n_steps=5,
        callbacks=[monitor],
        logger=[recorder],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(_StepsAfterAReading(monitor), cases.loader(batches=20))
    logged = _ours(recorder)
    assert [s for s in (4, 9, 14, 19) if "gpu/1/utilization_pct" in logged.get(s, {})] == [4, 9, 14, 19]
    assert fake.calls["nvmlDeviceGetUtilizationRates"] >= 2 * 20 and monitor.sampler is None  # stopped at the end


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval_s": 0}, "interval_s=0"),
        ({"interval_s": True}, "interval_s=True"),
        ({"device_indices": 0}, "device_indices=0"),
        ({"device_indices": [0, -1]}, r"device_indices=\[0, -1\]"),
        ({"readings": ["power", "fans"]}, r"unknown \['fans'\]"),
        ({"readings": "power"}, "readings='power'"),
        ({"low_utilization_pct": -5}, "low_utilization_pct=-5"),
        ({"max_rank_skew_pct": "high"}, "max_rank_skew_pct='high'"),
        ({"warmup_steps": 1.5}, "warmup_steps=1.5"),
        ({"report_name": "a/b"}, "report_name='a/b'"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPUMonitor(**kwargs)


def test_picklable_two_fits_and_state_round_trip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monitor = _monitor(report_dir=tmp_path / "report", readings=["utilization", "energy"])
    pickle.loads(pickle.dumps(monitor))
    run = Run(monkeypatch, tmp_path)
    run.fit(monitor, max_epochs=1)
    first = monitor.report.to_dict()
    _, recorder, _ = run.fit(monitor, max_epochs=1)  # a new fit is a new run: its own report
    second = monitor.report.to_dict()
    assert first["last_step"] == second["last_step"] == 10 and len(monitor.report.history) == 2
    assert set(_ours(recorder)[4]) >= {"gpu/0/utilization_pct", "gpu/0/energy_wh"}
    assert not any("power" in key for key in _ours(recorder)[4])  # only the readings asked for
    state = pickle.loads(pickle.dumps(monitor.state_dict()))
    fresh = _monitor()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == monitor.state_dict()
    pickle.loads(pickle.dumps(monitor))


def test_the_yaml_exposes_every_option() -> None:
    import inspect

    from hydra.utils import instantiate

    config = OmegaConf.load(CONF)
    [name] = [key for key in config if key != "defaults"]  # `defaults` names the schema (lightning_accel.schema)
    options = {k: v for k, v in OmegaConf.to_container(config[name]).items() if k != "_target_"}
    signature = inspect.signature(GPUMonitor.__init__)
    assert set(options) == set(signature.parameters) - {"self"}
    assert options.pop("report_dir") == "${paths.output_dir}"  # the run directory under accel-train
    assert options == {k: p.default for k, p in signature.parameters.items() if k in options}  # defaults mirrored
    config[name].report_dir = "run"
    assert isinstance(instantiate(config[name]), GPUMonitor)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(out: Path, topology: str) -> list[subprocess.Popen[str]]:
    script = Path(cases.__file__)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(script.parent), str(script.parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    base = [sys.executable, "-m", "torch.distributed.run"]
    if topology == "node":
        commands = [[*base, "--standalone", "--nproc-per-node=2", str(script), str(out), topology]]
    else:  # two "nodes" of one process each on this machine
        port = _free_port()
        commands = [
            [
                *base,
                "--nnodes=2",
                "--nproc-per-node=1",
                f"--node-rank={k}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                str(script),
                str(out),
                topology,
            ]
            for k in (0, 1)
        ]
    return [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in commands]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Both topologies at once (4 processes)."""
    outs = {topology: tmp_path_factory.mktemp(topology) for topology in ("node", "nodes")}
    procs = {topology: _torchrun(out, topology) for topology, out in outs.items()}
    results = {}
    for topology, launched in procs.items():
        outputs = [p.communicate(timeout=300)[0] for p in launched]
        assert all(p.returncode == 0 for p in launched), "\n".join(o[-4000:] for o in outputs)
        results[topology] = [json.loads((outs[topology] / f"rank{rank}.json").read_text()) for rank in (0, 1)]
        results[topology][0]["report"] = json.loads((outs[topology] / "report" / "gpu_report.json").read_text())
    return results


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["node", "nodes"])
def test_ddp_one_sampler_per_node_and_no_duplicate_keys(
    ddp_runs: dict[str, list[dict[str, Any]]], topology: str
) -> None:
    rank0, rank1 = ddp_runs[topology]
    assert rank0["global_step"] == rank1["global_step"] == 15
    if topology == "node":  # one node: only local rank 0 samples; rank 1 never touches NVML
        assert (rank0["sampled"], rank1["sampled"], rank0["nvml_inits"], rank1["nvml_inits"]) == (True, False, 1, 0)
        assert rank1["nvml_calls"] == 0 and not rank0["own_group"]  # gloo already: the default group gathers
        gpus = {"gpu/0": 10.0, "gpu/1": 30.0}
    else:  # two nodes: each node's local rank 0 samples its own GPU; rank zero logs both
        assert (rank0["local_rank"], rank1["local_rank"], rank0["sampled"], rank1["sampled"]) == (0, 0, True, True)
        gpus = {"node0/gpu/0": 10.0, "node1/gpu/0": 50.0}  # node 1's fake says 50: its values reached rank zero
        assert rank0["own_group"] and rank1["own_group"]  # the gather ran over a gloo group of its own
    report = rank0["report"]  # names and UUIDs of every node's GPUs reached rank zero
    assert [(g["gpu"], g["uuid"], g["utilization_mean_pct"]) for g in report["gpus"]] == [
        (gpu, f"GPU-{gpu[4] if topology == 'nodes' else 0}{gpu[-1]}aaaaaa", value) for gpu, value in gpus.items()
    ]
    assert [r["rank"] for r in report["ranks"]] == [0, 1] and report["alerts"][0]["name"] == "rank_skew"
    ours = functools.partial(
        filter, lambda k: k.split("/")[0] in ("gpu", "gpus", "ranks", "gpu_monitor", "node0", "node1")
    )
    assert not [k for _, metrics in rank1["records"] for k in ours(metrics)]  # only rank zero logs
    steps = [step for step, metrics in rank0["records"] if any(True for _ in ours(metrics))]
    assert steps == [4, 9, 14, 15] and len(steps) == len(set(steps))  # one log call per step
    for _, metrics in rank0["records"][:3]:
        prefixes = {k.rsplit("/", 1)[0] for k in metrics if k.endswith("/utilization_pct")}
        assert prefixes == set(gpus) and all(metrics[f"{g}/utilization_pct"] == v for g, v in gpus.items())
        assert metrics["ranks/slowest"] == 1.0 and metrics["ranks/skew_pct"] > 20  # rank 1 waits for its data
    [alert] = [step for step, metrics in rank0["records"] if "gpu_monitor/alert/rank_skew" in metrics]
    assert alert == 9 and len(rank0["warnings"]) == 1 and "Rank 1 is the straggler" in rank0["warnings"][0]
