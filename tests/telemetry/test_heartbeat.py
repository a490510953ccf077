"""Heartbeat files: safe names, atomic writes, and readers that skip what they cannot trust (with a note) and keep
reading the rest; staleness, the keep window, the history, pruning."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_accel.telemetry.heartbeat import (
    MAX_BYTES,
    SCHEMA,
    HeartbeatError,
    History,
    check_heartbeat,
    default_runs_dir,
    heartbeat_path,
    lead_signal,
    prune_heartbeats,
    read_heartbeat,
    read_heartbeats,
    status_of,
    write_json_atomic,
)

NOW = time.time()


def heartbeat(run_id: str = "run-1", **changes: Any) -> dict[str, Any]:
    """A valid heartbeat of one node with one GPU, updated at NOW."""
    data = {
        "schema": SCHEMA,
        "run_id": run_id,
        "name": "gpt small",
        "host": "node-a",
        "user": "ada",
        "pid": 4242,
        "command": "accel-train preset=ddp",
        "node_rank": 0,
        "num_nodes": 1,
        "rank": 0,
        "started": NOW - 100,
        "updated": NOW,
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
                "name": "NVIDIA H100",
                "energy_j": 3000.0,
                "latest": {"power_w": 300.0, "sm_activity_pct": 71.5},
                "history": {"power_w": [290.0, None, 300.0]},
            }
        ],
        "step": 120,
        "max_steps": 1000,
        "samples": 3840,
        "samples_per_s": 310.5,
        "eta_s": 88.0,
        "alerts": [{"name": "throttling", "step": 100, "message": "hot"}],
        "history": {"t": [NOW - 20, NOW - 10, NOW], "samples_per_s": [300.0, 305.0, None]},
    }
    data.update(changes)
    return data


def write(directory: Path, data: Any, name: str | None = None) -> Path:
    """`data` as a heartbeat file, last changed when its `updated` says (readers go by the file's time)."""
    path = directory / (name or f"{data['run_id']}.node-a.0.json")
    path.write_text(json.dumps(data))
    if isinstance(data, dict) and isinstance(data.get("updated"), float):
        os.utime(path, (data["updated"], data["updated"]))
    return path


def test_default_runs_dir_follows_the_environment(tmp_path: Path) -> None:
    assert default_runs_dir({"ACCEL_RUNS_DIR": str(tmp_path / "team"), "XDG_CACHE_HOME": "/x"}) == tmp_path / "team"
    assert default_runs_dir({"XDG_CACHE_HOME": "/cache"}) == Path("/cache/lightning_accel/runs")
    assert default_runs_dir({}) == Path(os.path.expanduser("~")) / ".cache" / "lightning_accel" / "runs"


@pytest.mark.parametrize("run_id", ["../../etc/passwd", "/etc/passwd", "..", ".hidden", "a/../../b", "x\x00y", ""])
def test_a_run_id_cannot_escape_the_runs_dir(tmp_path: Path, run_id: str) -> None:
    path = heartbeat_path(tmp_path / "runs", run_id, "host/../x", 3)
    assert path.parent == tmp_path / "runs" and not path.name.startswith(".") and path.name.endswith(".3.json")
    path.parent.mkdir()
    write_json_atomic(path, {"ok": 1})
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [path.name]  # nothing written anywhere else
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


def test_write_is_atomic_and_replaces_a_planted_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    path = tmp_path / "runs" / "r.h.0.json"
    path.parent.mkdir()
    path.symlink_to(victim)
    write_json_atomic(path, heartbeat())
    assert victim.read_text() == "keep me" and not path.is_symlink()  # the link was replaced, not followed
    assert read_heartbeat(path)["run_id"] == "run-1"
    assert [p.name for p in path.parent.iterdir()] == ["r.h.0.json"]  # no temporary file left
    with pytest.raises(ValueError):
        write_json_atomic(path, {"x": float("nan")})  # NaN is not JSON: refused, the old file stays
    assert read_heartbeat(path)["run_id"] == "run-1"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"pid": "4242"}, "`pid` of type str, where an integer belongs"),
        ({"step": True}, "`step` of type bool"),
        ({"name": 7}, "`name` of type int, where a string belongs"),
        ({"gpus": [{"index": 0}]}, "lacks `gpus[0].uuid`"),
        ({"ranks": "0,1"}, "`ranks` of type str, where a list belongs"),
        ({"status": "exploded"}, "`status` 'exploded'"),
        ({"schema": "other/9"}, "schema 'other/9'"),
        ({"samples_per_s": "fast"}, "`samples_per_s` of type str, where a number or null belongs"),
        ({"history": {"t": [1.0, "x"], "samples_per_s": [1.0, 2.0]}}, "`history.t[1]` of type str"),
        ({"alerts": [{"name": "x", "step": 1, "message": None}]}, "`alerts[0].message` of type NoneType"),
    ],
)
def test_wrong_types_are_named(change: dict[str, Any], message: str) -> None:
    with pytest.raises(HeartbeatError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_heartbeat(heartbeat(**change))


def test_checked_heartbeats_keep_their_values_and_drop_unknown_keys() -> None:
    data = heartbeat(extra="ignored", name="x" * 5000)
    checked = check_heartbeat(copy.deepcopy(data))
    assert "extra" not in checked and len(checked["name"]) == 2000
    assert checked["gpus"] == data["gpus"] and checked["history"] == data["history"]


def test_bad_files_are_skipped_with_a_note_and_the_rest_still_read(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    write(runs, heartbeat("good"))
    (runs / "corrupt.h.0.json").write_text("{not json")
    (runs / "truncated.h.0.json").write_text(json.dumps(heartbeat("t"))[:300])
    (runs / "oversized.h.0.json").write_text(json.dumps(heartbeat("big", command="x" * (MAX_BYTES + 10))))
    (runs / "wrongtype.h.0.json").write_text(json.dumps(heartbeat("w", pid="1")))
    (runs / "array.h.0.json").write_text("[1, 2]")
    (runs / "nan.h.0.json").write_text(json.dumps(heartbeat("n")).replace("310.5", "NaN"))
    (runs / "inf.h.0.json").write_text(json.dumps(heartbeat("i")).replace("310.5", "1e999"))
    (runs / "deep.h.0.json").write_text("[" * 100_000 + "]" * 100_000)
    secret = tmp_path / "secret.json"
    write(tmp_path, heartbeat("secret"), "secret.json")
    (runs / "link.h.0.json").symlink_to(secret)
    (runs / "fifo.h.0.json").mkdir()  # not a regular file
    (runs / ".tmp-in-progress.json").write_text("{")  # a writer's temporary file: not a heartbeat, no note
    (runs / "README.txt").write_text("not a heartbeat")
    jobs, notes = read_heartbeats(runs, now=NOW)
    assert [job.heartbeat["run_id"] for job in jobs] == ["good"]
    reasons = {note.split(":")[0].removeprefix("skipped "): note for note in notes}
    assert set(reasons) == {
        f"{n}.h.0.json"
        for n in ("corrupt", "truncated", "oversized", "wrongtype", "array", "nan", "inf", "deep", "link", "fifo")
    }
    assert "is a symlink" in reasons["link.h.0.json"] and "is not valid JSON" in reasons["corrupt.h.0.json"]
    assert "over the limit" in reasons["oversized.h.0.json"] and "`pid` of type str" in reasons["wrongtype.h.0.json"]
    assert "not a finite number" in reasons["inf.h.0.json"] and "NaN" in reasons["nan.h.0.json"]
    assert "not a regular file" in reasons["fifo.h.0.json"]


def test_status_stale_after_the_timeout_and_never_for_ended_jobs() -> None:
    running = heartbeat()
    assert status_of(running, 31.0, stale_after_s=30) == "stale"
    assert status_of(running, 31.0, stale_after_s=40) == "running"
    assert status_of(heartbeat(interval_s=20.0), 31.0, 30) == "running"  # 3 of its own intervals
    assert status_of(heartbeat(status="finished"), 10_000.0, 30) == "finished"


@pytest.mark.parametrize("clock_off_s", [1e6, -1e6, 3600.0])
def test_staleness_goes_by_the_files_time_not_the_writers_clock(tmp_path: Path, clock_off_s: float) -> None:
    """A host whose clock is off by days (either way) or an hour: its heartbeat's `updated` says nothing about when
    the file last changed; a dead job (file untouched for 10 minutes) is stale and a live one is running."""
    runs = tmp_path / "runs"
    runs.mkdir()
    for run_id, changed in (("dead", NOW - 600), ("live", NOW - 1)):
        path = write(runs, heartbeat(run_id, updated=NOW + clock_off_s, started=NOW + clock_off_s - 100))
        os.utime(path, (changed, changed))
    jobs, notes = read_heartbeats(runs, now=NOW, stale_after_s=30, keep_s=3600)
    assert {job.heartbeat["run_id"]: job.status for job in jobs} == {"dead": "stale", "live": "running"}
    assert {job.heartbeat["run_id"]: round(job.age_s) for job in jobs} == {"dead": 600, "live": 1} and notes == []
    assert json.loads(jobs[0].as_json())["age_s"] == round(jobs[0].age_s, 1)


def test_a_file_time_in_the_future_counts_from_when_the_reader_first_saw_it(tmp_path: Path) -> None:
    """`touch -d tomorrow` on a dead job's heartbeat does not keep it running until tomorrow: its age counts from the
    reader's first sight of that version of the file."""
    path = write(tmp_path, heartbeat("future"))
    os.utime(path, (NOW + 86400, NOW + 86400))
    cache: dict = {}
    [job] = read_heartbeats(tmp_path, now=NOW, cache=cache)[0]
    assert (job.status, job.age_s) == ("running", 0.0)
    [job] = read_heartbeats(tmp_path, now=NOW + 100, stale_after_s=30, cache=cache)[0]
    assert (job.status, job.age_s) == ("stale", 100.0)


def test_ended_and_stale_jobs_are_listed_for_the_keep_window(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    write(runs, heartbeat("live"))
    write(runs, heartbeat("recent", status="finished", updated=NOW - 50))
    write(runs, heartbeat("old", status="failed", updated=NOW - 5000))
    write(runs, heartbeat("silent", updated=NOW - 100))
    write(runs, heartbeat("long-silent", updated=NOW - 5000))
    jobs, notes = read_heartbeats(runs, now=NOW, stale_after_s=30, keep_s=3600)
    assert {job.heartbeat["run_id"]: job.status for job in jobs} == {
        "live": "running",
        "recent": "finished",
        "silent": "stale",
    }
    assert {job.heartbeat["status"] for job in jobs} == {"running", "finished"}  # what the jobs wrote
    assert notes == []


def test_the_cache_reparses_only_changed_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_accel.telemetry.heartbeat as module

    runs = tmp_path / "runs"
    runs.mkdir()
    path = write(runs, heartbeat("a"))
    write(runs, heartbeat("b"))
    parsed = []
    real = module.load_heartbeat
    monkeypatch.setattr(module, "load_heartbeat", lambda p, *a: parsed.append(p.name) or real(p, *a))
    cache: dict = {}
    read_heartbeats(runs, now=NOW, cache=cache)
    write_json_atomic(path, heartbeat("a", step=121))
    jobs, _ = read_heartbeats(runs, now=NOW, cache=cache)
    assert parsed == ["a.node-a.0.json", "b.node-a.0.json", "a.node-a.0.json"]
    assert {job.heartbeat["run_id"]: job.heartbeat["step"] for job in jobs} == {"a": 121, "b": 120}
    path.unlink()
    read_heartbeats(runs, now=NOW, cache=cache)
    assert list(cache) == [str(runs / "b.node-a.0.json")]


def test_an_unreadable_or_missing_runs_dir(tmp_path: Path) -> None:
    assert read_heartbeats(tmp_path / "none", now=NOW) == (
        [],
        [f"the runs directory {tmp_path / 'none'} does not exist (yet): no job has published into it"],
    )
    (tmp_path / "file").write_text("x")
    jobs, notes = read_heartbeats(tmp_path / "file", now=NOW)
    assert jobs == [] and "cannot be read" in notes[0]


def _aged(*paths: Path, days: float = 10) -> None:
    for path in paths:
        os.utime(path, (NOW - days * 86400, NOW - days * 86400), follow_symlinks=False)


def look_alikes(directory: Path) -> dict[str, bytes]:
    """Files a user may keep beside heartbeats, each like one in a way (suffix, hidden name, name pattern, schema), all
    aged ten days: a prune must leave every one as it was."""
    beat = json.dumps(heartbeat("lookalike")).encode()
    files = {
        "results.json": b'{"accuracy": 0.91}',
        "config.json": b'{"lr": 0.0003}',
        "draft.tmp": b"half a thought",
        ".draft.tmp": b"hidden draft",
        ".notes.backup01.tmp": b"eight characters after a dot",
        f".results.json.{'abcd1234'}.tmp": b"an earlier version's temporary name, or a user's",
        ".results.json.accel-abcd1234.tmp": b"our temporary name for a file that is not a heartbeat",
        "run.host.0.json": b'{"step": 1}',  # named like a heartbeat, no schema
        "copy.node-a.0.json": beat,  # a heartbeat's content under a name it does not give: a user's copy
        "notes.node-a.0.json": b"[not json",
    }
    for name, data in files.items():
        (directory / name).write_bytes(data)
    _aged(*(directory / name for name in files))
    return files


def test_prune_removes_only_this_users_old_heartbeats_and_their_temporaries(tmp_path: Path) -> None:
    old = heartbeat_path(tmp_path, "old", "node-a", 0)
    write_json_atomic(old, heartbeat("old"))
    older = write(tmp_path, {"schema": SCHEMA, "run_id": "v0", "host": "node-a", "node_rank": 0})  # another shape
    leftover = tmp_path / f".{old.name}.accel-x1y2z3w4.tmp"  # a write killed midway
    leftover.write_text('{"schema": ')
    new = heartbeat_path(tmp_path, "new", "node-a", 0)
    write_json_atomic(new, heartbeat("new"))
    link = tmp_path / "link.node-a.0.json"
    link.symlink_to(old)
    _aged(old, older, leftover, link)
    planted = look_alikes(tmp_path)
    assert prune_heartbeats(tmp_path, 7 * 86400, now=NOW) == 3
    assert not old.exists() and not older.exists() and not leftover.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*planted, new.name, link.name])
    assert {name: (tmp_path / name).read_bytes() for name in planted} == planted  # intact, every byte


def test_a_real_run_prunes_old_heartbeats_and_leaves_look_alikes(tmp_path: Path) -> None:
    """A real publisher (a training run's) starts in a runs directory of ten-day-old files: it removes the old
    heartbeat and nothing else."""
    from lightning_accel.telemetry.publisher import JobInfo, PublishSettings, RunPublisher

    old = heartbeat_path(tmp_path, "old", "node-a", 0)
    write_json_atomic(old, heartbeat("old"))
    _aged(old)
    planted = look_alikes(tmp_path)
    job = JobInfo(run_id="now", name="tiny", host="node-a", user="ada", pid=os.getpid(), command="pytest")
    publisher = RunPublisher(PublishSettings(runs_dir=tmp_path, interval_s=0.05), job)
    publisher.start()
    time.sleep(0.3)
    publisher.finish("finished")
    assert not old.exists() and read_heartbeat(tmp_path / "now.node-a.0.json")["status"] == "finished"
    assert {name: (tmp_path / name).read_bytes() for name in planted} == planted
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*planted, "now.node-a.0.json"])


def test_history_down_samples_to_its_step_and_span() -> None:
    history = History(span_s=60.0, step_s=10.0)
    for second in range(0, 100, 2):  # a window every 2 s for 100 s
        history.add(float(second), {"power_w": float(second), "sm": None if second < 50 else 1.0})
    assert history.t[0] >= 100 - 2 - 60 - 10 and len(history.t) <= 7
    assert history.t[-1] == 98.0  # the newest point moves with the newest window
    assert history.series("power_w")[-1] == pytest.approx((90 + 92 + 94 + 96 + 98) / 5)
    assert history.series("sm")[0] is None and history.series("sm")[-1] == 1.0  # a series that began late
    assert history.series("missing") == [None] * len(history.t)
    early = History(step_s=10.0)
    early.add(1.0, {"a": 1.0})
    early.add(12.0, {"b": 2.0})
    assert early.series("a") == [1.0, None] and early.series("b") == [None, 2.0]


def test_lead_signal_prefers_sm_activity_and_labels_the_fallback() -> None:
    assert lead_signal({"sm_activity_pct": 40.0, "utilization_pct": 100.0}) == ("SM active", 40.0)
    assert lead_signal({"utilization_pct": 100.0}) == ("util (fallback)", 100.0)
    assert lead_signal({}) == ("util (fallback)", None)


def test_a_job_passes_its_text_on_as_read_unless_checking_changed_it(tmp_path: Path) -> None:
    clean = write(tmp_path, heartbeat("clean"))
    cut = write(tmp_path, heartbeat("cut", name="x" * 3000, unknown=[1, 2]))
    jobs = {job.heartbeat["run_id"]: job for job in read_heartbeats(tmp_path, now=NOW)[0]}
    assert jobs["clean"].text == clean.read_text()  # nothing parsed and printed again
    assert json.loads(jobs["cut"].text) == jobs["cut"].heartbeat != json.loads(cut.read_text())
    assert len(jobs["cut"].heartbeat["name"]) == 2000 and "unknown" not in jobs["cut"].text
    assert json.loads(jobs["clean"].as_json()) == {
        "file": "clean.node-a.0.json",
        "status": "running",
        "age_s": 0.0,
        "heartbeat": jobs["clean"].heartbeat,
    }
