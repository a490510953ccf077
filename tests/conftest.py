"""Shared fixtures: composing the packaged config tree and running `accel-train` in a subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from _env import DISTRIBUTED_ENV
from _hung import run_with_stacks
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from lightning_accel.launch import register_resolvers

CONF_MODULE = "lightning_accel.conf"

_DISTRIBUTED_ENV = DISTRIBUTED_ENV


def _session_env_dir(tmp_path_factory: pytest.TempPathFactory, variable: str, name: str) -> Iterator[Path]:
    """`variable` names a directory of the session while it runs (subprocesses inherit it), then is as it was."""
    before = os.environ.get(variable)
    os.environ[variable] = str(tmp_path_factory.mktemp(name))
    yield Path(os.environ[variable])
    if before is None:
        os.environ.pop(variable, None)
    else:
        os.environ[variable] = before


@pytest.fixture(autouse=True, scope="session")
def _usage_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Usage databases accel-dash records while a test serves its page go into a directory of the session, not the
    user's `~/.local/state/lightning_accel`."""
    yield from _session_env_dir(tmp_path_factory, "ACCEL_USAGE_DIR", "accel-usage")


@pytest.fixture(autouse=True, scope="session")
def _runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Heartbeats of the tests' fits (GPUMonitor publishes by default, and accel-train's default callbacks hold one)
    go into a directory of the session, not the user's `~/.cache/lightning_accel/runs`."""
    yield from _session_env_dir(tmp_path_factory, "ACCEL_RUNS_DIR", "accel-runs")


@pytest.fixture(autouse=True)
def _restore_environment(_runs_dir: Path) -> Iterator[None]:
    """Every test ends with the environment it started with."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


@pytest.fixture(autouse=True)
def _restore_signal_handlers() -> Iterator[None]:
    """Every test ends with pytest's own SIGINT/SIGTERM handlers: an in-process `train.main()` installs accel-train's
    (kept to the process's end, as a command that owns its process), which would turn pytest's Ctrl-C or a CI
    timeout's SIGTERM into a `SignalExit` inside whatever test runs next."""
    before = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    yield
    for number, handler in before.items():
        if signal.getsignal(number) is not handler and handler is not None:
            signal.signal(number, handler)


@pytest.fixture(autouse=True)
def _restore_float32_matmul_precision() -> Iterator[None]:
    """Every test ends with torch's float32 matmul precision as it found it: an in-process run (`train.run`,
    `compose.apply_precision`) sets it for the process, as accel-train does for its own, and a later test on the same
    xdist worker (tests/callbacks/test_matmul_precision.py starts from `highest`) would start from `high`."""
    torch = sys.modules.get("torch")
    before = torch.get_float32_matmul_precision() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_float32_matmul_precision() != (before or "highest"):
        torch.set_float32_matmul_precision(before or "highest")


@pytest.fixture
def compose_train(tmp_path: Path) -> Iterator:
    """compose_train(overrides) -> the resolved-ready `train` config, with HydraConfig set to a run in tmp_path."""
    GlobalHydra.instance().clear()
    register_resolvers()  # `${accel_job_name:}` & co, as accel-train registers them before composing
    with initialize_config_module(config_module=CONF_MODULE, version_base="1.3"):

        def _compose(overrides: Sequence[str] = ()) -> DictConfig:
            cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
            with open_dict(cfg):
                cfg.hydra.runtime.output_dir = str(tmp_path)
                cfg.hydra.job.num = 0
            HydraConfig.instance().set_config(cfg)
            return cfg

        yield _compose
    GlobalHydra.instance().clear()


def _run_cli(
    args: Sequence[str],
    cwd: Path,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    module: str = "lightning_accel.train",
) -> subprocess.CompletedProcess[str]:
    """Run `python -m <module> ARGS` (what `accel-train` runs) in `cwd`, capturing output.

    Past `timeout` every process of the run (child ranks and DataLoader workers too) prints its Python stacks
    (faulthandler, on SIGABRT) and the test fails with them: a hang says where it hung.
    """
    inherited = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_ENV}
    full_env = {
        **inherited,
        "PYTHONUNBUFFERED": "1",
        "ACCEL_LOG_DIR": str(cwd / "outputs"),
        "XDG_CACHE_HOME": str(cwd / "cache"),
        **(env or {}),
    }  # the tuner's cache: not the user's
    command = [sys.executable, "-m", module, *args]
    try:
        return run_with_stacks(command, env=full_env, timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired as err:
        stdout, stderr = (text if isinstance(text, str) else "" for text in (err.output, err.stderr))
        pytest.fail(
            f"{' '.join(command[2:])} still ran after {timeout:.0f} s; its stacks:\n{stderr[-12000:]}\n"
            f"stdout:\n{stdout[-3000:]}",
            pytrace=False,
        )


@pytest.fixture
def run_cli():
    """run_cli(args, cwd, timeout=300, env=None, module="lightning_accel.train") -> CompletedProcess."""
    return _run_cli


@dataclass(frozen=True)
class DdpSmokeRun:
    """`accel-train trainer=smoke strategy=ddp trainer.devices=2` on the CPU, run once for the session (under
    pytest-xdist, once on the worker its readers share)."""

    result: subprocess.CompletedProcess[str]
    cwd: Path  # its runs are under cwd/outputs/runs


@pytest.fixture(scope="session")
def ddp_smoke_run(tmp_path_factory: pytest.TempPathFactory) -> DdpSmokeRun:
    """One 2-rank CPU DDP smoke run, read by the tests of what such a run writes (tests/test_train.py: one run
    directory for both ranks; tests/test_threads.py: the planned threads and wait policy on both ranks): libgomp prints
    its settings (`OMP_DISPLAY_ENV=VERBOSE`), and the run starts without a thread plan or OpenMP setting of its own."""
    from lightning_accel.system.threads import PLANNED_ENV

    cwd = tmp_path_factory.mktemp("ddp_smoke")
    unset = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "MKL_NUM_THREADS", PLANNED_ENV)
    saved = {key: os.environ.pop(key) for key in unset if key in os.environ}
    try:
        result = _run_cli(
            ["trainer=smoke", "trainer.accelerator=cpu", "data.max_chars=200000", "strategy=ddp", "trainer.devices=2"],
            cwd=cwd,
            env={"OMP_DISPLAY_ENV": "VERBOSE"},
        )
    finally:
        os.environ.update(saved)
    return DdpSmokeRun(result, cwd)


@pytest.fixture
def busy_process() -> Iterator[int]:
    """A CPU-bound process that is not ours (tests/_busy.py), for as long as the test runs; yields its pid."""
    from _busy import busy

    with busy(1) as pids:
        yield pids[0]
