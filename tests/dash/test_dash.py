"""accel-dash without a browser: the page data (jobs by host, this host's free cards), --once and --json, and the real
server: read-only endpoints, the security headers, a taken port, a non-loopback address, the missing extra."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from _dash_server import dash_server
from _env import clean_env
from _fake_nvml import FakeClock, FakeGPU, FakeNVML, install

from lightning_accel.dash.cli import main
from lightning_accel.dash.state import SCHEMA as SCHEMA_PAGE
from lightning_accel.dash.state import DashState, page_dict, page_json, text_report
from lightning_accel.telemetry.heartbeat import SCHEMA, heartbeat_path, write_json_atomic
from lightning_accel.telemetry.host_gpus import HostGPUs

HOSTILE = "<img src=x onerror=alert(1)>"


def publish(
    runs: Path,
    run_id: str,
    host: str,
    status: str = "running",
    age_s: float = 1.0,
    uuids: tuple[str, ...] = ("GPU-1",),
    name: str = "job",
) -> None:
    now = time.time()
    data = {
        "schema": SCHEMA,
        "run_id": run_id,
        "name": name,
        "host": host,
        "user": "ada",
        "pid": 11,
        "command": "accel-train",
        "node_rank": 0,
        "num_nodes": 1,
        "rank": 0,
        "started": now - 60,
        "updated": now - age_s,
        "interval_s": 2.0,
        "status": status,
        "reason": "",
        "slurm_job_id": None,
        "metrics_url": None,
        "ranks": [{"rank": 0, "local_rank": 0, "device": "cuda:0", "uuid": uuids[0]}],
        "gpus": [
            {
                "index": i,
                "uuid": u,
                "name": "H100",
                "latest": {
                    "sm_activity_pct": 70.0,
                    "power_w": 300.0,
                    "power_limit_w": 700.0,
                    "temperature_c": 60.0,
                    "memory_used_mib": 2048.0,
                    "memory_total_mib": 81559.0,
                    "throttle_thermal_frac": 0.5,
                },
                "energy_j": 3600.0,
                "history": {"power_w": [290.0, 300.0]},
            }
            for i, u in enumerate(uuids)
        ],
        "step": 10,
        "max_steps": 100,
        "samples": 320,
        "samples_per_s": 32.0,
        "eta_s": 75.0,
        "alerts": [],
        "history": {"t": [now - 10, now], "samples_per_s": [31.0, 32.0]},
    }
    runs.mkdir(parents=True, exist_ok=True)
    write_json_atomic(heartbeat_path(runs, run_id, host, 0), data)


def host_card(uuid: str, index: int = 0, processes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": uuid,
        "name": "A100",
        "mig": False,
        "latest": {"utilization_pct": 30.0},
        "processes": processes or [],
    }


def test_jobs_are_grouped_by_host_and_free_cards_leave_out_the_held_ones(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    publish(runs, "b-live", "here", uuids=("GPU-1",))
    publish(runs, "a-silent", "here", age_s=100, uuids=("GPU-2",))  # stale: its card is still held
    publish(runs, "done", "here", status="finished", age_s=5, uuids=("GPU-3",))  # ended: its card is free again
    publish(runs, "far", "zeta", uuids=("GPU-1",))  # another machine's GPU-1 is another card
    publish(runs, "near", "alpha")
    (runs / "broken.json").write_text("{")
    cards = [host_card(f"GPU-{i}", i) for i in (1, 2, 3, 4)]
    state = DashState(runs, host_cards=lambda: cards, host="here").build()
    assert [h["host"] for h in state["hosts"]] == ["here", "alpha", "zeta"]
    here = state["hosts"][0]
    assert [(j.heartbeat["run_id"], j.status) for j in here["jobs"]] == [
        ("b-live", "running"),
        ("a-silent", "stale"),
        ("done", "finished"),
    ]
    assert [c["uuid"] for c in here["cards"]] == ["GPU-3", "GPU-4"] and state["hosts"][1]["cards"] == []
    assert state["notes"] == [
        "skipped broken.json: it is not valid JSON (truncated or corrupt: Expecting property "
        "name enclosed in double quotes: line 1 column 2 (char 1))"
    ]
    assert json.loads(page_json(state)) == json.loads(json.dumps(page_dict(state), allow_nan=False))  # strict JSON
    assert json.loads(page_json(state))["hosts"][0]["jobs"][1]["status"] == "stale"


def test_the_state_is_reused_for_requests_close_together(tmp_path: Path) -> None:
    calls = []
    state = DashState(tmp_path, host_cards=lambda: calls.append(1) or [], min_age_s=60)
    assert state.get() is state.get() and len(calls) == 1 and json.loads(state.get())["schema"] == SCHEMA_PAGE


def test_host_gpus_show_processes_and_their_users(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    clock = FakeClock()
    gpus = [FakeGPU("GPU-x", processes=[os.getpid()]), FakeGPU("GPU-y", architecture=8)]
    fake = install(monkeypatch, FakeNVML(gpus, clock=clock))
    cards = HostGPUs()
    first = cards.read()
    clock.advance(2.0)
    second = cards.read()
    cards.close()
    assert [c["uuid"] for c in first] == ["GPU-x", "GPU-y"]
    [process] = first[0]["processes"]
    me = psutil.Process()
    assert (process["pid"], process["user"], process["name"]) == (os.getpid(), me.username(), me.name())
    assert "sm_activity_pct" not in first[0]["latest"]  # GPM needs two samples
    assert second[0]["latest"]["sm_activity_pct"] == 80.0
    assert "sm_activity_pct" not in second[1]["latest"] and second[1]["latest"]["utilization_pct"] == 90.0
    assert fake.inits == fake.shutdowns == 1


def test_host_gpus_without_nvml_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeNVML([], init_error=12))
    cards = HostGPUs()
    assert cards.read() == [] and "NVML is not available" in cards.problem
    cards.close()


def test_once_and_json_show_strings_as_they_are_without_markup_or_escapes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    publish(runs, "r1", "here", name=HOSTILE + " [bold red]loud[/] \x1b[2Jcleared")
    assert main(["--runs-dir", str(runs), "--json", "--no-host-gpus"]) == 0
    state = json.loads(capsys.readouterr().out)
    assert state["hosts"][-1]["jobs"][0]["heartbeat"]["name"] == HOSTILE + " [bold red]loud[/] \x1b[2Jcleared"
    assert main(["--runs-dir", str(runs), "--once", "--no-host-gpus"]) == 0
    out = capsys.readouterr().out
    assert HOSTILE in out and "[bold red]loud[/]" in out  # shown as text, not taken as rich markup
    assert "\x1b" not in out and "?[2Jcleared" in out  # a terminal escape is not passed to the terminal
    assert "SM active 70%" in out and "300/700 W" in out and "throttled: thermal" in out and "running" in out


def test_text_report_of_an_empty_runs_dir() -> None:
    text = text_report(DashState(Path("/nonexistent/runs"), host="here").build())
    assert "host here" in text and "no job of ours" in text


def _get(url: str, method: str = "GET", headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    runs = tmp_path_factory.mktemp("runs")
    publish(runs, "r1", "elsewhere", name=HOSTILE)
    (runs / "torn.elsewhere.0.json").write_text('{"schema": "lightning_accel.heartbeat/1", "run_id": ')
    (runs / "link.elsewhere.0.json").symlink_to(runs / "r1.elsewhere.0.json")
    with dash_server(["--runs-dir", str(runs)], module="_fake_dash", env={"ACCEL_FAKE_GPUS": "a"}) as (url, proc):
        yield url, proc


def test_the_server_serves_the_page_its_data_and_nothing_else(served: Any) -> None:
    url, _ = served
    status, headers, body = _get(url + "/")
    assert status == 200 and b'src="/static/dash.js"' in body and not re.search(rb"https?://|=\"//", body)
    csp = headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
    assert headers["x-content-type-options"] == "nosniff" and headers["x-frame-options"] == "DENY"
    status, headers, body = _get(url + "/api/state")
    state = json.loads(body)
    assert status == 200 and state["hosts"][1]["jobs"][0]["heartbeat"]["name"] == HOSTILE
    assert [len(host["jobs"]) for host in state["hosts"]] == [0, 1]  # the bad files skipped, the good one served
    assert [note.split(":")[0] for note in state["notes"]] == [
        "skipped link.elsewhere.0.json",
        "skipped torn.elsewhere.0.json",
    ]
    cards = state["hosts"][0]["cards"]
    assert [c["uuid"][:6] for c in cards] == ["GPU-a0", "GPU-a1", "GPU-zz"]  # no job of ours runs here
    assert cards[2]["processes"][0]["user"] not in ("", "?")
    for path in ("/static/uPlot.iife.min.js", "/static/uPlot.min.css", "/static/dash.css", "/static/uPlot.LICENSE"):
        assert _get(url + path)[0] == 200, path


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
@pytest.mark.parametrize("path", ["/", "/api/state", "/static/dash.js"])
def test_every_endpoint_is_read_only(served: Any, method: str, path: str) -> None:
    status, _, _ = _get(served[0] + path, method=method)
    assert status == 405


def test_only_this_machine_names_are_served_on_loopback_and_nothing_escapes_static(served: Any) -> None:
    url, _ = served
    assert _get(url + "/api/state", headers={"Host": "attacker.example"})[0] == 400  # DNS rebinding
    assert _get(url + "/api/state", headers={"Host": "localhost:1"})[0] == 200
    assert _get(url + "/static/../cli.py")[0] == 404 and _get(url + "/static/%2e%2e/cli.py")[0] == 404


def test_a_taken_port_is_a_clear_error_naming_the_port_option(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "lightning_accel.dash",
                "--port",
                str(port),
                "--runs-dir",
                str(tmp_path),
                "--no-host-gpus",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(),
        )
    assert done.returncode == 2
    assert done.stderr.startswith(f"accel-dash: error: port {port} on 127.0.0.1 is taken")
    assert "pass another `--port`" in done.stderr and "Traceback" not in done.stderr


def test_an_address_not_of_this_machine_names_the_host_option(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_accel.dash",
            "--host",
            "192.0.2.1",
            "--runs-dir",
            str(tmp_path),
            "--no-host-gpus",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert done.returncode == 2 and "cannot serve on `--host 192.0.2.1`" in done.stderr


def test_binding_beyond_loopback_is_explicit_and_says_what_it_exposes(tmp_path: Path) -> None:
    with dash_server(["--host", "0.0.0.0", "--runs-dir", str(tmp_path), "--no-host-gpus"]) as (url, proc):
        port = url.rsplit(":", 1)[1]
        status, _, _ = _get(f"http://127.0.0.1:{port}/api/state", headers={"Host": "node-a.example:1"})
        assert status == 200  # served to other machines' names too
    notice = proc.stderr_text
    assert "serving on 0.0.0.0, not only this machine" in notice and "command line" in notice


def test_the_page_needs_the_dash_extra_and_says_which(tmp_path: Path) -> None:
    script = (
        "import sys; sys.modules['starlette'] = None; from lightning_accel.dash.cli import main; "
        f"sys.exit(main(['--runs-dir', {str(tmp_path)!r}, '--no-host-gpus']))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=clean_env())
    assert done.returncode == 2 and "pip install 'lightning_accel[dash]'" in done.stderr
    once = [sys.executable, "-c", script.replace("'--no-host-gpus'", "'--no-host-gpus', '--once'")]
    assert subprocess.run(once, capture_output=True, timeout=60, env=clean_env()).returncode == 0


def test_the_page_script_never_writes_html() -> None:
    script = (Path(__file__).parents[2] / "lightning_accel" / "dash" / "static" / "dash.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in script, sink
    assert not re.search(r"https?://|[\"'`]//", script)  # nothing from elsewhere, not even protocol-relative


def test_accel_dash_starts_without_torch_lightning_or_hydra() -> None:
    """A login node without GPUs runs it: importing the command and the app loads none of the training stack."""
    script = (
        "import sys, lightning_accel.dash.cli, lightning_accel.dash.server, lightning_accel.telemetry.host_gpus; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'lightning', 'hydra', 'omegaconf'}))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=clean_env())
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_a_missing_tool_skips_with_a_reason_and_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    from _tools import REQUIRE_ENV, tool

    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no-such-browser is missing .not on PATH.; install it with"):
        tool("no-such-browser")
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=f"{REQUIRE_ENV}=1 requires it"):
        tool("no-such-browser")
    assert tool("python3")  # found: its path
