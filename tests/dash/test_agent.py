"""`accel-dash agent`: two agents with different host names write into one runs directory; the page lists both
hosts' cards with their processes (a process that is no Lightning job of ours included), and trusts no agent file."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest
from _fake_nvml import FakeGPU, FakeNVML, install

import lightning_accel.dash.agent as agent_module
from lightning_accel.dash.agent import AGENT_DIR, agent_file, read_agents, run_agent
from lightning_accel.dash.cli import main
from lightning_accel.dash.state import DashState, text_report
from lightning_accel.errors import AgentWarning
from lightning_accel.telemetry.idle_held import IdleHeldTracker


def agent(monkeypatch: pytest.MonkeyPatch, runs: Path, host: str, letter: str, *extra: str) -> None:
    gpus = [
        FakeGPU(f"GPU-{letter}0{letter * 6}-0000-0000-0000-000000000000", utilization=0.0, processes=[os.getpid()]),
        FakeGPU(f"GPU-{letter}1{letter * 6}-0000-0000-0000-000000000001", utilization=90.0),
    ]
    install(monkeypatch, FakeNVML(gpus))
    assert main(["agent", "--runs-dir", str(runs), "--hostname", host, "--rounds", "1", *extra]) == 0


def test_two_agents_put_both_hosts_cards_on_one_page(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    agent(monkeypatch, runs, "node-a", "a", "--no-usage")
    agent(monkeypatch, runs, "node-b", "b", "--no-usage")
    assert sorted(p.name for p in (runs / AGENT_DIR).iterdir()) == ["node-a.json", "node-b.json"]
    state = DashState(runs, host="viewer", idle=IdleHeldTracker(5.0, 1.0)).build()
    hosts = {h["host"]: h for h in state["hosts"]}
    assert set(hosts) == {"viewer", "node-a", "node-b"} and hosts["viewer"]["cards"] == []
    for name, letter in (("node-a", "a"), ("node-b", "b")):
        cards = hosts[name]["cards"]
        assert [c["uuid"][:6] for c in cards] == [f"GPU-{letter}0", f"GPU-{letter}1"]
        (process,) = cards[0]["processes"]  # not a Lightning job: no heartbeat of ours names it
        assert process["pid"] == os.getpid() and process["name"] and process["user"]
        assert cards[1]["processes"] == []
    assert state["notes"] == []
    report = text_report(state)
    assert "cards on node-a that no job of ours holds" in report and "cards on node-b" in report
    later = DashState(runs, host="viewer", idle=IdleHeldTracker(5.0, 1.0))
    later.build(time.time())
    idle = later.build(time.time() + 2.0)["idle_held"]  # the other process's idle card, on each host
    assert sorted((c["host"], c["uuid"][:6]) for c in idle) == [("node-a", "GPU-a0"), ("node-b", "GPU-b0")]


def test_a_silent_or_broken_agent_file_is_a_note_and_the_rest_shows(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    agent(monkeypatch, runs, "node-a", "a", "--no-usage")
    agent(monkeypatch, runs, "node-b", "b", "--no-usage")
    old = time.time() - 600
    os.utime(agent_file(runs, "node-b"), (old, old))
    (runs / AGENT_DIR / "junk.json").write_text(json.dumps({"schema": "lightning_accel.agent/1", "cards": "many"}))
    os.symlink(agent_file(runs, "node-a"), runs / AGENT_DIR / "link.json")
    (runs / AGENT_DIR / "deep.json").write_text("[" * 200_000)  # past the parser's depth: RecursionError
    agents, notes = read_agents(runs, time.time(), 30.0)
    assert list(agents) == ["node-a"]
    assert notes[0].startswith("skipped agent file deep.json: is not valid JSON (")
    assert notes[1:] == [
        "skipped agent file junk.json: `cards` is not a list of at most 256 cards",
        "skipped agent file link.json: is not a regular file of at most 1024 KiB",
        "the agent of node-b has been silent for 600 s: its cards are not shown",
    ]
    assert [h["host"] for h in DashState(runs, host="viewer").build()["hosts"]] == ["viewer", "node-a"]


def test_a_round_that_fails_after_the_first_is_warned_and_the_agent_goes_on(tmp_path: Path) -> None:
    runs, rounds = tmp_path / "runs", []

    def record(cards: list[dict[str, object]]) -> None:
        rounds.append(len(rounds))
        if len(rounds) == 2:
            raise RuntimeError("the database went away")

    real = agent_module.publish_agent
    calls = []

    def publish(*args: object) -> Path:
        calls.append(len(calls))
        if len(calls) in (3, 4):  # two rounds whose write fails, past the first
            raise OSError(errno.EIO, "Input/output error")
        return real(*args)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch, pytest.warns(AgentWarning) as caught:
        patch.setattr(agent_module, "publish_agent", publish)
        run_agent(runs, "node-a", lambda: [], lambda: None, 0.01, on_round=record, rounds=5)
    assert rounds == [0, 1, 2, 3, 4] and len(calls) == 5  # every round ran
    assert [str(w.message) for w in caught] == [
        "accel-dash agent: the round's usage record failed (RuntimeError: the database went away)",
        "accel-dash agent: the agent file cannot be written (Input/output error); trying again next round",
    ]  # once per kind
    with pytest.MonkeyPatch.context() as patch, pytest.raises(OSError):  # the first round's failure is the caller's
        patch.setattr(agent_module, "publish_agent", lambda *a: (_ for _ in ()).throw(OSError(errno.EACCES, "no")))
        run_agent(runs, "node-a", lambda: [], lambda: None, 0.01, rounds=2)


def test_the_agent_records_its_hosts_usage_and_the_page_leaves_it_to_the_agent(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from lightning_accel.dash.usage_feed import UsageFeed
    from lightning_accel.dash.usage_store import UsageStore
    from lightning_accel.dash.usage_view import UsageReader

    runs, db = tmp_path / "runs", tmp_path / "usage-node-a.sqlite"
    uuid = "GPU-a0aaaaaa-0000-0000-0000-000000000000"
    gpus = [FakeGPU(uuid, utilization=0.0, architecture=8, processes=[os.getpid()])]  # Ampere: no GPM, utilisation
    install(monkeypatch, FakeNVML(gpus, clock=time.monotonic))  # readings a real interval apart
    assert (
        main(
            [
                "agent",
                "--runs-dir",
                str(runs),
                "--hostname",
                "node-a",
                "--rounds",
                "3",
                "--interval",
                "0.5",
                "--usage-db",
                str(db),
                "--idle-after",
                "0.4",
            ]
        )
        == 0
    )
    (row,) = UsageReader([db]).rows()
    assert row.host == "node-a" and row.job == f"pid {os.getpid()}" and 0.8 < row.held_s < 1.5  # two intervals
    assert 0.4 < row.idle_held_s <= row.held_s  # its own threshold: idle-held from the second interval on
    page_db = tmp_path / "usage-page.sqlite"
    with UsageStore(page_db) as store:  # a page on node-a while its agent runs: no second writer
        state = DashState(runs, host="node-a", host_cards=lambda: [], usage=UsageFeed(store, "node-a"))
        state.build()
        state.build(time.time() + 1)
    assert not page_db.exists() or UsageReader([page_db]).rows() == []
