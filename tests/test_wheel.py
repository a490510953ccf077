"""The wheel alone: installed into a fresh venv, with no checkout beside it, accel-train composes and trains."""

from __future__ import annotations

import json
import site
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{args}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow  # ~30 s: a fresh venv; tests/test_packaging.py builds the wheel by default
def test_wheel_in_fresh_venv_runs_accel_train(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(REPO)],
        cwd=tmp_path,
    )
    wheel = next(dist.glob("lightning_accel-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for shipped in (
        "lightning_accel/conf/train.yaml",
        "lightning_accel/conf/preset/ddp.yaml",
        "lightning_accel/examples/gpt.py",
        "hydra_plugins/lightning_accel_searchpath/searchpath.py",
        "lightning_accel/dash/static/index.html",
        "lightning_accel/dash/static/dash.js",
        "lightning_accel/dash/static/uPlot.iife.min.js",
        "lightning_accel/dash/static/uPlot.LICENSE",
        "lightning_accel/examples/monitoring/prometheus.yml",
        "lightning_accel/examples/monitoring/grafana/dashboards/lightning-accel.json",
        "lightning_accel/examples/monitoring/grafana/provisioning/dashboards/lightning-accel.yml",
    ):
        assert shipped in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "[hydra.plugins]" in zipfile.ZipFile(wheel).read(entry_points).decode()

    # A fresh venv that sees this interpreter's dependencies (torch, lightning, ...) but not the checkout.
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    purelib = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path
        ).stdout.strip()
    )
    deps = [p for p in {*site.getsitepackages(), sysconfig.get_paths()["purelib"]} if Path(p).is_dir()]
    (purelib / "_deps_of_the_test_env.pth").write_text("\n".join(deps) + "\n")
    _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
        cwd=tmp_path,
    )

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run(
        [
            str(python),
            "-c",
            "import lightning_accel.conf as c, hydra_plugins.lightning_accel_searchpath as p;"
            "print(c.__file__); print(p.__file__)",
        ],
        cwd=elsewhere,
    ).stdout.split()
    assert all(Path(w).is_relative_to(env_dir) for w in where), where

    accel_train = str(env_dir / "bin" / "accel-train")
    job = _run([accel_train, "--cfg", "job", "preset=ddp"], cwd=elsewhere).stdout
    assert "DDPStrategy" in job and "lightning_accel.examples.GPTLanguageModel" in job

    run_dir = elsewhere / "run"
    _run(
        [
            accel_train,
            "trainer=smoke",
            "trainer.accelerator=cpu",
            "data.max_chars=100000",
            f"hydra.run.dir={run_dir}",
            f"callbacks.gpu_monitor.runs_dir={elsewhere / 'runs'}",
        ],
        cwd=elsewhere,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["metrics"]["test/bpc"] > 0 and Path(summary["best_checkpoint"]).is_file()
    # the run published its heartbeat (the default callbacks), and the wheel's accel-dash reads it
    accel_dash = str(env_dir / "bin" / "accel-dash")
    page = _run([accel_dash, "--json", "--no-host-gpus", "--runs-dir", str(elsewhere / "runs")], cwd=elsewhere).stdout
    [job] = json.loads(page)["hosts"][0]["jobs"]
    assert (job["status"], job["heartbeat"]["name"], job["heartbeat"]["gpus"]) == ("finished", run_dir.name, [])
