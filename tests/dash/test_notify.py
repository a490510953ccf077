"""Webhooks: a real HTTP receiver on 127.0.0.1 gets exactly one notification per episode (grace and repeat), one for
an XID 79, none while snoozed; a receiver that is down or slow never blocks the caller, and retries are bounded."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from lightning_accel.dash.notify import Alert, Notifier, Route, _post, load_routes, read_snoozes, snooze
from lightning_accel.errors import ConfigError

IDLE = Alert("idle_held", "idle_held/h1/GPU-1/gpt r1", "ada", "h1", "GPU 1 on h1 held idle by ada's gpt r1 for 5 min")
XID = Alert("health", "health/h1/GPU-2", "ada", "h1", "GPU 2 on h1: XID 79 (GPU has fallen off the bus)")


@contextmanager
def receiver(delay_s: float = 0.0) -> Iterator[tuple[str, list[dict]]]:
    got: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            time.sleep(delay_s)
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", got
    finally:
        server.shutdown()
        server.server_close()


def test_one_notification_per_episode_with_grace_and_repeat(tmp_path: Path) -> None:
    with receiver() as (url, got):
        notifier = Notifier({None: Route(url, "json")}, grace_s=60, repeat_s=3600)
        for t in (0.0, 30.0, 59.0):
            notifier.observe(t, [IDLE])
        assert notifier.wait_idle() and got == []  # still in its grace period
        for t in (61.0, 100.0, 2000.0):
            notifier.observe(t, [IDLE])
        assert notifier.wait_idle() and [(g["kind"], g["repeat"], g["since"]) for g in got] == [("idle_held", 0, 0.0)]
        notifier.observe(3661.0, [IDLE])  # still going an hour after it was sent: once more
        notifier.observe(3700.0, [])  # over
        notifier.observe(3800.0, [IDLE])  # a new episode: its own grace period
        notifier.observe(3859.0, [IDLE])
        assert notifier.wait_idle() and [g["repeat"] for g in got] == [0, 1]
        notifier.observe(3861.0, [IDLE])
        assert notifier.wait_idle() and [(g["repeat"], g["since"]) for g in got][-1] == (0, 3800.0)


def test_an_xid_79_is_sent_at_once_and_once(tmp_path: Path) -> None:
    with receiver() as (url, got):
        notifier = Notifier({"ada": Route(url, "slack", mention="<@U1>")}, grace_s=60)
        for t in (0.0, 2.0, 4.0):
            notifier.observe(t, [XID])
        assert notifier.wait_idle()
        assert got == [{"text": "<@U1> accel-dash: GPU 2 on h1: XID 79 (GPU has fallen off the bus)"}]


def test_a_snoozed_alert_is_not_sent_and_a_user_without_a_route_gets_none(tmp_path: Path) -> None:
    with receiver() as (url, got):
        snoozes = tmp_path / "snooze.json"
        snooze(snoozes, "idle_held/h1/*", 600.0, now=0.0)
        notifier = Notifier({"bob": Route(url, "json")}, grace_s=0, snooze_file=snoozes)
        notifier.observe(10.0, [IDLE, Alert("idle_held", "idle_held/h2/GPU-0/x", "bob", "h2", "m")])
        notifier.observe(20.0, [XID])  # ada has no route and there is no default
        assert notifier.wait_idle() and [g["key"] for g in got] == ["idle_held/h2/GPU-0/x"]
        notifier.observe(700.0, [IDLE])  # the snooze is over, but ada still has no route
        assert notifier.wait_idle() and len(got) == 1


@pytest.mark.parametrize("delay_s", [None, 1.0], ids=["down", "slow"])
def test_a_receiver_down_or_slow_never_blocks_and_retries_are_bounded(delay_s: float | None) -> None:
    attempts: list[float] = []

    def counted(url: str, body: bytes, timeout_s: float) -> None:
        attempts.append(time.monotonic())
        _post(url, body, timeout_s)

    with receiver(delay_s or 0.0) as (url, _):
        if delay_s is None:
            url = url.replace("/hook", "").rsplit(":", 1)[0] + ":9"  # the discard port: nothing listens
        notifier = Notifier(
            {None: Route(url, "json")}, grace_s=0, timeout_s=0.2, retries=2, backoff_s=0.05, post=counted
        )
        started = time.monotonic()
        with pytest.warns(Warning, match="failed 3 times"):
            for t in range(4):
                notifier.observe(float(t), [Alert("job_failed", f"job/{t}", "ada", "h1", "failed")])
            took = time.monotonic() - started
            assert took < 0.1, took  # 4 alerts handed over: nothing waited on the receiver
            assert notifier.wait_idle(timeout_s=60)
    assert len(attempts) == 4 * 3 and notifier.failures == 4  # each tried 3 times, then given up


def test_bad_routing_files_are_named_errors(tmp_path: Path) -> None:
    broken = tmp_path / "routes.yaml"
    broken.write_text("users: {ada: [unclosed\n")
    with pytest.raises(ConfigError, match="routes.yaml is not valid YAML"):
        load_routes(broken)
    broken.write_text("users:\n  ada: {url: ftp://example.org/x}\n")
    with pytest.raises(ConfigError, match=r"`users.ada.url` is 'ftp://example.org/x': a webhook URL must be http"):
        load_routes(broken)
    broken.write_text("default: {url: https://hooks.example/x, format: teams}\n")
    with pytest.raises(ConfigError, match="`default.format` is 'teams'"):
        load_routes(broken)
    good = tmp_path / "good.yaml"
    good.write_text(
        "default: {url: https://hooks.example/x}\nusers:\n  ada: {url: http://h:1/y, format: json, mention: '@ada'}\n"
    )
    assert load_routes(good) == {None: Route("https://hooks.example/x"), "ada": Route("http://h:1/y", "json", "@ada")}
    with pytest.raises(ConfigError, match="cannot be read"):
        load_routes(tmp_path / "missing.yaml")


def test_the_page_posts_an_idle_held_card_once_and_the_commands_name_bad_input(tmp_path: Path, capsys) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_idle_dash import publish

    from lightning_accel.dash.cli import main
    from lightning_accel.dash.state import DashState
    from lightning_accel.telemetry.idle_held import IdleHeldTracker

    runs = tmp_path / "runs"
    now = publish(runs, [0.0] * 8)  # a job's card idle for 71 s
    with receiver() as (url, got):
        notifier = Notifier({None: Route(url, "json")}, grace_s=0)
        state = DashState(runs, host="here", idle=IdleHeldTracker(5.0, 30.0, 15.0), notifier=notifier)
        for dt in (0.0, 2.0, 4.0):
            state.build(now + dt)
        assert notifier.wait_idle()
    assert [(g["kind"], g["user"], g["host"]) for g in got] == [("idle_held", "ada", "here")]
    assert got[0]["key"] == "idle_held/here/GPU-1/gpt r1" and "idle GPU-hours" in got[0]["message"]

    routes = tmp_path / "routes.yaml"
    routes.write_text("default: {url: file:///etc/passwd}\n")
    assert main(["--runs-dir", str(runs), "--no-host-gpus", "--no-usage", "--notify", str(routes)]) == 2
    assert "`--notify`" in capsys.readouterr().err
    snoozes = tmp_path / "snooze.json"
    assert main(["snooze", "idle_held/here/*", "--for", "120", "--file", str(snoozes)]) == 0
    (entry,) = json.loads(snoozes.read_text())
    assert entry["pattern"] == "idle_held/here/*" and entry["until"] > time.time() + 100


def test_each_health_problem_and_each_job_status_is_an_episode_of_its_own() -> None:
    from types import SimpleNamespace

    from lightning_accel.dash.notify import page_alerts

    def page(status: str, problems: list[str]) -> dict:
        gpu = {"index": 0, "uuid": "GPU-0", "name": "H100", "health": {"problems": problems}}
        beat = {"name": "gpt", "run_id": "r1", "user": "ada", "reason": "", "gpus": [gpu]}
        job = SimpleNamespace(status=status, heartbeat=beat, file="r1.h1.0.json")
        return {"idle_held": [], "hosts": [{"host": "h1", "jobs": [job]}]}

    ecc = "2 uncorrected ECC error(s) since the driver loaded"
    before = page_alerts(page("running", [ecc, "a health reading failed: nvmlDeviceGetTotalEccErrors: Unknown"]))
    after = page_alerts(page("running", [ecc, "XID 79 (GPU has fallen off the bus), 3 s ago"]))
    assert [a.key for a in before] == [f"health/h1/GPU-0/{ecc}"]  # a failed reading is the monitoring's, not posted
    assert [a.key for a in after] == [f"health/h1/GPU-0/{ecc}", "health/h1/GPU-0/XID 79 (GPU has fallen off the bus)"]
    later = page_alerts(page("running", ["XID 79 (GPU has fallen off the bus), 63 s ago"]))
    assert later[0].key == after[1].key  # the age is not part of the key: the same episode
    stale, failed = page_alerts(page("stale", [])), page_alerts(page("failed", []))
    assert [a.key for a in stale + failed] == ["job_stale/r1.h1.0.json", "job_failed/r1.h1.0.json"]
    with receiver() as (url, got):  # a stale job that then fails is told twice: stale past the grace, failed at once
        notifier = Notifier({None: Route(url, "json")}, grace_s=60.0)
        for t, alerts in ((0.0, stale), (100.0, stale), (101.0, failed)):
            notifier.observe(t, alerts)
        assert notifier.wait_idle()
    assert [g["kind"] for g in got] == ["job_stale", "job_failed"]


def test_a_broken_snooze_entry_is_left_out_and_the_others_hold(tmp_path: Path) -> None:
    from lightning_accel.dash.notify import read_snoozes

    path = tmp_path / "snooze.json"
    entries = [{"until": "soon", "pattern": "job_*"}, {"until": 500.0}, {"pattern": "idle_held/*", "until": 500.0}]
    path.write_text(json.dumps([*entries, {"pattern": "health/*", "until": float("inf")}, 7]))
    assert read_snoozes(path, 100.0) == ["idle_held/*"]
    with receiver() as (url, got):
        notifier = Notifier({None: Route(url, "json")}, grace_s=0.0, snooze_file=path)
        notifier.observe(100.0, [IDLE, XID])  # the file does not stop every alert: only the snoozed one
        assert notifier.wait_idle()
    assert [g["key"] for g in got] == [XID.key]
    snooze(path, "job_*", 60.0, now=100.0)
    assert json.loads(path.read_text()) == [
        {"pattern": "idle_held/*", "until": 500.0},
        {"pattern": "job_*", "until": 160.0},
    ]


def test_the_page_reads_the_snooze_file_its_option_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_accel.dash.cli as cli

    served = []
    monkeypatch.setattr(cli, "_serve", lambda args, state: served.append(state) or 0)
    routes = tmp_path / "routes.yaml"
    routes.write_text("default: {url: 'http://127.0.0.1:9/hook'}\n")
    snoozes = tmp_path / "team" / "snooze.json"
    argv = ["--runs-dir", str(tmp_path), "--no-host-gpus", "--no-usage", "--notify", str(routes)]
    assert cli.main([*argv, "--snooze-file", str(snoozes)]) == 0
    assert cli.main(["snooze", "job_*", "--file", str(snoozes)]) == 0
    (state,) = served
    assert state.notifier.snooze_file == snoozes and read_snoozes(snoozes, time.time()) == ["job_*"]
