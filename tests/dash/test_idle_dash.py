"""accel-dash flags idle-held cards: a running job's card (dated back through its heartbeat's history) and a card
that another process holds, in the page data, `--json` and `--once`."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from lightning_accel.dash.cli import main
from lightning_accel.dash.state import DashState, page_json, text_report
from lightning_accel.telemetry.heartbeat import SCHEMA, heartbeat_path, write_json_atomic
from lightning_accel.telemetry.idle_held import IdleHeldTracker


def publish(runs: Path, sm: list[float], step_s: float = 10.0, user: str = "ada", age_s: float = 1.0) -> float:
    """A running job on host `here` whose card's SM activity was `sm` (one point per `step_s`, the last `age_s` ago
    by the file's time); written with a clock 1000 s off the reader's, as another host's may be. Returns now."""
    now = time.time()
    skew = -1000.0
    updated = now - age_s + skew
    times = [updated - step_s * (len(sm) - 1 - i) for i in range(len(sm))]
    data: dict[str, Any] = {
        "schema": SCHEMA,
        "run_id": "r1",
        "name": "gpt",
        "host": "here",
        "user": user,
        "pid": 11,
        "command": "accel-train",
        "node_rank": 0,
        "num_nodes": 1,
        "rank": 0,
        "started": times[0],
        "updated": updated,
        "interval_s": 2.0,
        "status": "running",
        "reason": "",
        "slurm_job_id": None,
        "metrics_url": None,
        "ranks": [{"rank": 0, "local_rank": 0, "device": "cuda:0", "uuid": "GPU-1"}],
        "gpus": [
            {
                "index": 0,
                "uuid": "GPU-1",
                "name": "H100",
                "latest": {"sm_activity_pct": sm[-1], "memory_used_mib": 30000.0},
                "energy_j": None,
                "history": {"sm_activity_pct": sm},
            }
        ],
        "step": 10,
        "max_steps": None,
        "samples": 320,
        "samples_per_s": 1.0,
        "eta_s": None,
        "alerts": [],
        "history": {"t": times, "samples_per_s": [1.0] * len(sm)},
    }
    runs.mkdir(parents=True, exist_ok=True)
    path = heartbeat_path(runs, "r1", "here", 0)
    write_json_atomic(path, data)
    os.utime(path, (now - age_s, now - age_s))
    return now


def test_a_jobs_card_idle_through_its_history_is_flagged_with_its_owner_and_duration(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    now = publish(runs, [90.0, 80.0, 1.0, 0.0, 2.0, 1.0, 0.0])  # idle for the last 5 points: 40 s + 1 s of age
    state = DashState(runs, host="here", idle=IdleHeldTracker(5.0, 30.0, 15.0)).build(now)
    (idle,) = state["idle_held"]
    assert (idle["owner"], idle["holder"], idle["host"], idle["job"]) == ("ada", "gpt r1", "here", "r1")
    assert abs(idle["for_s"] - 41.0) < 0.5 and abs(idle["idle_gpu_hours"] - 41.0 / 3600) < 1e-3
    assert json.loads(page_json(state))["idle_held"][0]["uuid"] == "GPU-1"
    report = text_report(state)
    assert "idle-held cards" in report and "gpt r1" in report and "0m41s" in report

    busy = publish(runs, [1.0, 0.0, 0.0, 0.0, 0.0, 60.0])  # working again
    assert DashState(runs, host="here", idle=IdleHeldTracker(5.0, 30.0, 15.0)).build(busy)["idle_held"] == []
    short = publish(runs, [90.0, 0.0, 0.0])  # idle 21 s: under the 30 s threshold
    assert DashState(runs, host="here", idle=IdleHeldTracker(5.0, 30.0, 15.0)).build(short)["idle_held"] == []


def test_a_card_another_process_holds_is_flagged_across_builds_and_a_free_card_never(tmp_path: Path) -> None:
    def cards() -> list[dict[str, Any]]:
        return [
            {
                "index": 3,
                "uuid": "GPU-3",
                "name": "A100",
                "mig": False,
                "latest": {"utilization_pct": 0.0},
                "processes": [{"pid": 77, "user": "bob", "name": "jupyter", "memory_mib": 1200.0}],
            },
            {
                "index": 4,
                "uuid": "GPU-4",
                "name": "A100",
                "mig": False,
                "latest": {"utilization_pct": 0.0},
                "processes": [],
            },
        ]

    state = DashState(tmp_path, host_cards=cards, host="here", idle=IdleHeldTracker(5.0, 20.0, 15.0))
    t0 = time.time()
    assert [state.build(t0 + dt)["idle_held"] for dt in (0.0, 10.0)] == [[], []]
    (idle,) = state.build(t0 + 20.0)["idle_held"]
    assert (idle["owner"], idle["holder"], idle["index"], idle["signal"]) == (
        "bob",
        "pid 77 jupyter",
        3,
        "util (fallback)",
    )
    assert idle["for_s"] == 20.0 and idle["job"] is None


def test_json_and_once_carry_the_options(tmp_path: Path, capsys) -> None:
    runs = tmp_path / "runs"
    publish(runs, [0.0] * 8)
    assert main(["--runs-dir", str(runs), "--json", "--no-host-gpus", "--idle-pct", "3", "--idle-after", "30"]) == 0
    page = json.loads(capsys.readouterr().out)
    assert (page["idle_threshold_pct"], page["idle_after_s"]) == (3.0, 30.0)
    assert [c["owner"] for c in page["idle_held"]] == ["ada"]
    assert main(["--runs-dir", str(runs), "--once", "--no-host-gpus", "--idle-after", "600"]) == 0
    assert "idle-held" not in capsys.readouterr().out  # 71 s idle: under 10 minutes


def test_the_page_records_this_hosts_usage_held_and_idle_held(tmp_path: Path) -> None:
    from lightning_accel.dash.usage_feed import UsageFeed
    from lightning_accel.dash.usage_store import UsageStore
    from lightning_accel.dash.usage_view import UsageReader

    runs, db = tmp_path / "runs", tmp_path / "usage-here.sqlite"
    now = publish(runs, [0.0] * 8)  # idle-held for 71 s: flagged at a 30 s threshold
    with UsageStore(db) as store:
        state = DashState(runs, host="here", idle=IdleHeldTracker(5.0, 30.0, 15.0), usage=UsageFeed(store, "here"))
        state.build(now)  # the first build starts the watch: nothing counted yet
        state.build(now + 10.0)
        state.build(now + 100.0)  # 90 s unwatched: not counted
    (row,) = UsageReader([db]).rows()
    assert (row.host, row.user, row.job, row.gpu_index) == ("here", "ada", "r1", 0)
    assert row.held_s == 10.0 and row.idle_held_s == 10.0
    other = tmp_path / "usage-else.sqlite"
    with UsageStore(other) as store:
        state = DashState(runs, host="elsewhere", usage=UsageFeed(store, "elsewhere"))
        state.build(now)
        state.build(now + 5.0)
    assert not other.exists() or UsageReader([other]).rows() == []  # another host's job: its own machine records it


def test_the_usage_page_merges_every_hosts_database_over_30_days(tmp_path: Path) -> None:
    from lightning_accel.dash.usage_schema import UsageObservation
    from lightning_accel.dash.usage_store import UsageStore

    now = time.time()
    for host, user, idle in (("h1", "ada", True), ("h2", "bob", False)):
        with UsageStore(tmp_path / f"usage-{host}.sqlite") as store:
            observation = UsageObservation(
                host=host,
                user=user,
                job=f"{user}-job",
                gpu_index=0,
                gpu_uuid="GPU-0",
                interval_s=3600.0,
                held_s=3600.0,
                idle=idle,
                energy_j=3.6e6,
            )
            assert store.record([observation], now)
    state = DashState(tmp_path / "runs", host="here")
    state.usage_sources = [tmp_path]
    page = json.loads(state.usage_json(now=now))
    assert len(page["days"]) == 30 and sum(page["held_gpu_hours"]["ada"]) + sum(page["held_gpu_hours"]["bob"]) == 2.0
    assert sum(page["idle_gpu_hours"]["ada"]) == 1.0 and sum(page["idle_gpu_hours"]["bob"]) == 0.0
    assert [job["key"] for job in page["top_idle_jobs"]][0] == ["ada", "ada-job"]


def test_the_watch_builds_the_page_with_no_browser_asking(tmp_path: Path) -> None:
    class Alerts:  # a Notifier's one method the page calls
        def __init__(self) -> None:
            self.seen: list[float] = []

        def observe(self, now: float, alerts: list[dict[str, Any]]) -> None:
            self.seen.append(now)
            if len(self.seen) == 2:
                raise RuntimeError("a notifier that breaks once")

    alerts = Alerts()
    state = DashState(tmp_path / "runs", host="here", min_age_s=0.0, notifier=alerts)  # type: ignore[arg-type]
    stop = state.watch(0.05)
    deadline = time.monotonic() + 10.0
    while len(alerts.seen) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    stop()  # returns once the thread has ended: the caller may close the store and the card reader after it
    assert not [t for t in threading.enumerate() if t.name == "accel-dash-watch"]
    assert len(alerts.seen) >= 4 and alerts.seen == sorted(alerts.seen)  # went on past the build that raised
    stopped = len(alerts.seen)
    time.sleep(0.2)
    assert len(alerts.seen) == stopped
