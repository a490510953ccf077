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
    path = heartbeat_path(runs, run_id, host, 0)
    write_json_atomic(path, data)
    os.utime(path, (now - age_s, now - age_s))  # readers go by the file's time, not by `updated`


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
    (runs / "broken.here.0.json").write_text("{")
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
        "skipped broken.here.0.json: it is not valid JSON (truncated or corrupt: Expecting property "
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


# --- bad runs directories, a flood of junk, Ctrl-C -------------------------------------------------------------------


def _dash(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "lightning_accel.dash", "--no-host-gpus", "--json", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=clean_env(**(env or {})))


def test_a_runs_dir_that_is_missing_or_a_file_is_an_error_naming_it(tmp_path: Path) -> None:
    typo = tmp_path / "runz"
    done = _dash(["--runs-dir", str(typo)])
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"accel-dash: error: the runs directory {typo} (`--runs-dir`) does not exist")
    (tmp_path / "file").write_text("x")
    done = _dash(["--runs-dir", str(tmp_path / "file")])
    assert done.returncode == 2 and "(`--runs-dir`) is not a directory" in done.stderr
    done = _dash([], env={"ACCEL_RUNS_DIR": str(typo)})
    assert done.returncode == 2 and f"{typo} (`$ACCEL_RUNS_DIR`) does not exist" in done.stderr


def test_the_default_runs_dir_before_any_job_published_is_a_note_not_an_error(tmp_path: Path) -> None:
    done = _dash([], env={"XDG_CACHE_HOME": str(tmp_path), "ACCEL_RUNS_DIR": ""})
    assert done.returncode == 0, done.stderr
    missing = tmp_path / "lightning_accel" / "runs"
    assert json.loads(done.stdout)["notes"] == [
        f"the runs directory {missing} does not exist (yet): no job has published into it"
    ]


def test_a_flood_of_junk_files_gives_one_note_with_a_count_and_a_bounded_page(tmp_path: Path) -> None:
    """20,000 junk files made 20,000 notes (3.1 MB) on every refresh; now 5,000 junk `.json` files and 200 broken
    files named like heartbeats give the good job, a few notes, and a page of a few kilobytes."""
    runs = tmp_path / "runs"
    publish(runs, "good", "here")
    for i in range(5000):
        (runs / f"junk-{i:05d}.json").write_text('{"not": "a heartbeat"}')
    for i in range(200):
        (runs / f"broken-{i:03d}.here.0.json").write_text("{")
    state = DashState(runs, host="here")
    payload = state.get()
    assert len(payload) < 20_000, len(payload)
    page = json.loads(payload)
    assert [job["heartbeat"]["run_id"] for job in page["hosts"][0]["jobs"]] == ["good"]
    notes = page["notes"]
    assert len(notes) == 22  # 20 broken files one by one, one count of the rest, one count of the junk
    assert notes[-2] == "skipped 180 more files named like heartbeats (not shown one by one)"
    assert (
        notes[-1].startswith("ignored 5,000 .json files not named like a heartbeat") and "junk-00000.json" in notes[-1]
    )


def test_the_page_holds_a_bounded_number_of_jobs_running_first(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    for i in range(4):
        publish(runs, f"ended-{i}", "here", status="finished")
    publish(runs, "live", "here")
    page = page_dict(DashState(runs, host="here", max_jobs=3).build())
    assert [job["heartbeat"]["run_id"] for job in page["hosts"][0]["jobs"]][0] == "live"
    assert len(page["hosts"][0]["jobs"]) == 3 and page["notes"] == [
        "2 more jobs are not shown: a page holds at most 3 jobs and 16 MiB of heartbeats (running jobs come first)"
    ]
    page = page_dict(DashState(runs, host="here", max_bytes=1000).build())  # one heartbeat here is about 900 bytes
    assert [job["heartbeat"]["run_id"] for job in page["hosts"][0]["jobs"]] == ["live"]
    assert page["notes"][0].startswith("4 more jobs are not shown")


def test_ctrl_c_stops_the_page_with_130_and_no_traceback(tmp_path: Path) -> None:
    import signal

    with dash_server(["--runs-dir", str(tmp_path), "--no-host-gpus"]) as (url, proc):
        assert _get(url + "/api/state")[0] == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    assert "Traceback" not in proc.stderr_text and "KeyboardInterrupt" not in proc.stderr_text
    assert "accel-dash: interrupted (Ctrl-C)" in proc.stderr_text


def test_the_usage_page_and_its_data_are_served(served: Any) -> None:
    url, _ = served
    status, headers, body = _get(url + "/usage")
    assert (
        status == 200
        and b'src="/static/usage.js"' in body
        and "script-src 'self'" in headers["content-security-policy"]
    )
    status, _, body = _get(url + "/api/usage")
    page = json.loads(body)
    assert status == 200 and len(page["days"]) == 30
    assert set(page) >= {"held_gpu_hours", "idle_gpu_hours", "top_idle_jobs", "databases", "notes"}
    assert _get(url + "/static/usage.js")[0] == 200
