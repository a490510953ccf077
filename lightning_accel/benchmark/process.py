"""Run one stage's command in a fresh process of its own session under an interference probe, stop it and its
children, and read its measurement or why it failed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from lightning_accel.benchmark.results import StageRun
from lightning_accel.system.interference import InterferenceProbe

__all__ = ["DISTRIBUTED_ENV", "Launcher", "failure_reason", "launch", "run_once", "terminate_as_interrupt"]

# Variables an in-process distributed run leaves behind; a child that inherits LOCAL_RANK waits for ranks forever.
DISTRIBUTED_ENV = (
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "PL_GLOBAL_SEED",
)

Launcher = Callable[[list[str], Path, "float | None"], "subprocess.CompletedProcess[str]"]


def launch(command: list[str], stage_dir: Path, timeout: float | None) -> subprocess.CompletedProcess[str]:
    """Run a stage's command in a fresh process (a session of its own, so a timeout or Ctrl-C ends its DDP ranks and
    DataLoader workers too); its output goes to stage_dir/stdout.log and stderr.log."""
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    stage_dir.mkdir(parents=True, exist_ok=True)
    with (stage_dir / "stdout.log").open("w") as out, (stage_dir / "stderr.log").open("w") as err:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout)
            note = ""
            _kill_group(process.pid)  # what the stage left behind (a rank or a worker) must not load the next one
        except subprocess.TimeoutExpired:
            _end_session(process)
            returncode, note = 124, f"the stage ran past --stage-timeout={timeout:g} s and was stopped"
        except BaseException:  # Ctrl-C: the stage's session does not get the terminal's SIGINT, so end it here
            _end_session(process)
            raise
    stderr = (stage_dir / "stderr.log").read_text() + (f"\n{note}" if note else "")
    return subprocess.CompletedProcess(command, returncode, (stage_dir / "stdout.log").read_text(), stderr)


@contextmanager
def terminate_as_interrupt() -> Iterator[list[int]]:
    """SIGTERM handled as Ctrl-C while the block runs: the running stage's session is ended (`launch`), the runs
    that finished are written, and the caller exits 128 + N. Yields the signals received (empty: none)."""
    received: list[int] = []

    def handler(signum: int, frame: object) -> None:
        received.append(signum)
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def _kill_group(pgid: int) -> None:
    """SIGKILL every process left in a stage's process group (none, normally)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _end_session(process: subprocess.Popen[str]) -> None:
    """SIGTERM the stage's whole process group, give the leader 10 s, then SIGKILL the whole group."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    try:
        process.wait(timeout=10.0)
    except subprocess.TimeoutExpired:
        pass
    _kill_group(process.pid)  # the leader may be gone while ranks or workers of its group live on
    try:
        process.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass


def failure_reason(stderr: str, returncode: int) -> str:
    noise = ("HYDRA_FULL_ERROR", "full_key:", "object_type=", "reference_type=")
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and not line.strip().startswith(noise)]
    lines = [line for line in lines if "HYDRA_FULL_ERROR" not in line]
    if lines and "--stage-timeout" in lines[-1]:
        return lines[-1]
    for marker in ("accel-train: error:", "Error:", "Error", "error"):
        found = [line for line in lines if marker in line]
        if found:
            reason = found[-1].replace("accel-train: error: ", "")
            return f"exit {returncode}: {reason[:300]}"
    return f"exit {returncode}: {lines[-1][:300] if lines else 'no output'}"


def run_once(
    command: list[str],
    run_dir: Path,
    *,
    round_index: int,
    seed: int | None,
    timeout: float | None,
    launcher: Launcher = launch,
    probe: InterferenceProbe | None = None,
) -> StageRun:
    """Run one stage's command once, under `probe`, and read its measurement; a failure is a `failed` run.

    A `stage.json` left in `run_dir` by an earlier bench is removed first: a run that writes none fails instead of
    reporting the old one.
    """
    run = StageRun(round=round_index, seed=seed)
    (run_dir / "stage.json").unlink(missing_ok=True)
    started = time.perf_counter()
    if probe is not None:
        probe.start()
    try:
        completed = launcher(command, run_dir, timeout)
    except Exception as err:  # the launcher itself broke: the ladder goes on
        run.status, run.reason = "failed", f"{type(err).__name__}: {err}"
        return run
    finally:
        if probe is not None:
            result = probe.stop()
            run.interference, run.flagged = result.as_dict(), result.flagged
    run.process_s = time.perf_counter() - started
    measurement = run_dir / "stage.json"
    if completed.returncode != 0:
        run.status, run.reason = "failed", failure_reason(completed.stderr or "", completed.returncode)
    elif not measurement.is_file():
        run.status, run.reason = "failed", "the stage finished but wrote no measurement (stage.json)"
    else:
        try:
            run.measurement = json.loads(measurement.read_text())
        except (OSError, ValueError) as err:
            run.status, run.reason = "failed", f"its measurement {measurement} is unreadable ({err})"
    return run
