"""The usage kept: the daily rollup's arithmetic (across UTC midnight), two hosts' databases merged, retention and the
size cap, a read-only, locked and corrupt database (warned, the view goes on), `accel-dash usage --csv`, and a writer
SIGKILLed mid-write (the file intact, at most the last interval missing)."""

from __future__ import annotations

import csv
import io
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import date, datetime, timedelta, timezone
from pathlib import Path

import pytest

import lightning_accel
from lightning_accel.dash import usage_store
from lightning_accel.dash.cli import main
from lightning_accel.dash.usage_schema import (
    UsageObservation,
    classify_error,
    default_usage_path,
    filesystem_type,
)
from lightning_accel.dash.usage_store import UsageStore
from lightning_accel.dash.usage_view import CSV_COLUMNS, UsageReader
from lightning_accel.errors import ConfigError, UsageCorruptWarning, UsageStoreWarning

MIDNIGHT = datetime(2025, 3, 2, tzinfo=timezone.utc).timestamp()
DAY = 86400.0


def obs(
    host: str = "a",
    user: str = "ada",
    job: str = "r1",
    gpu: int = 0,
    held_s: float = 60.0,
    interval_s: float = 60.0,
    idle: bool = False,
    energy_j: float = 0.0,
    samples: int = 0,
    steps: int = 0,
) -> UsageObservation:
    return UsageObservation(
        host=host,
        user=user,
        job=job,
        gpu_index=gpu,
        gpu_uuid=f"GPU-{host}-{gpu}",
        interval_s=interval_s,
        held_s=held_s,
        idle=idle,
        energy_j=energy_j,
        samples=samples,
        steps=steps,
    )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[UsageStore]:
    with UsageStore(tmp_path / "usage-a.sqlite") as writer:
        yield writer


def test_an_interval_across_utc_midnight_is_split_by_its_time_on_each_day(store: UsageStore) -> None:
    # 60 s ending 15 s after midnight: 45 s on March 1st, 15 s on March 2nd
    assert store.record([obs(idle=True, energy_j=6000.0, samples=10, steps=3)], MIDNIGHT + 15)
    assert store.record([obs(held_s=30.0, energy_j=600.0, samples=4, steps=1)], MIDNIGHT + 75)  # all on March 2nd
    rows = {row.day: row for row in UsageReader([store.path]).rows()}
    assert set(rows) == {"2025-03-01", "2025-03-02"}
    first, second = rows["2025-03-01"], rows["2025-03-02"]
    assert (first.held_s, first.idle_held_s, first.energy_j) == pytest.approx((45.0, 45.0, 4500.0))
    assert (second.held_s, second.idle_held_s, second.energy_j) == pytest.approx((45.0, 15.0, 2100.0))
    assert (first.samples + second.samples, first.steps + second.steps) == (14, 4)  # whole numbers, none lost
    assert (first.samples, first.steps) == (8, 2)


def test_several_jobs_and_gpus_of_one_interval_are_rows_of_their_own(store: UsageStore) -> None:
    now = MIDNIGHT + 3600
    store.record([obs(gpu=0), obs(gpu=1, idle=True), obs(job="r2", user="bob", gpu=2, held_s=20.0)], now)
    store.record([obs(gpu=0), obs(gpu=1, idle=True)], now + 60)
    totals = {total.key: total for total in UsageReader([store.path]).totals("job")}
    assert totals[("ada", "r1")].held_s == pytest.approx(240.0)
    assert totals[("ada", "r1")].idle_held_s == pytest.approx(120.0)
    assert totals[("bob", "r2")].held_s == pytest.approx(20.0)
    assert len(UsageReader([store.path]).rows()) == 3


def test_an_observation_that_cannot_be_refuses_itself() -> None:
    with pytest.raises(ConfigError, match=r"`held_s=61.0` exceeds `interval_s=60.0`"):
        obs(held_s=61.0)
    with pytest.raises(ConfigError, match=r"`energy_j=-1.0`"):
        obs(energy_j=-1.0)
    with pytest.raises(ConfigError, match=r"`interval_s=0.0` must be > 0"):
        obs(held_s=0.0, interval_s=0.0)


def test_two_hosts_databases_merge_per_user_day_and_job(tmp_path: Path) -> None:
    now = MIDNIGHT + 7200
    with UsageStore(tmp_path / "usage-a.sqlite") as a, UsageStore(tmp_path / "usage-b.sqlite") as b:
        # one two-node job (r1) on both hosts, idle on b; bob only on b
        a.record([obs(host="a", gpu=0), obs(host="a", gpu=1)], now)
        b.record([obs(host="b", gpu=0, idle=True), obs(host="b", user="bob", job="r9", gpu=1, idle=True)], now)
        b.record([obs(host="b", gpu=0, held_s=60.0)], now - DAY)  # the day before
    page = UsageReader([tmp_path]).page()
    assert page.days == ["2025-03-01", "2025-03-02"]
    assert page.held_gpu_hours["ada"] == pytest.approx([60 / 3600, 180 / 3600])
    assert page.idle_gpu_hours["ada"] == pytest.approx([0.0, 60 / 3600])
    assert page.held_gpu_hours["bob"] == pytest.approx([0.0, 60 / 3600])
    assert [job.key for job in page.top_idle_jobs] == [("ada", "r1"), ("bob", "r9")]
    assert page.top_idle_jobs[0].hosts == {"a", "b"}
    assert len(page.databases) == 2 and page.notes == []
    by_host = {total.key: total.held_s for total in UsageReader([tmp_path]).totals("host")}
    assert by_host == pytest.approx({("a",): 120.0, ("b",): 180.0})
    assert UsageReader([tmp_path]).page(top=1).top_idle_jobs[0].key == ("ada", "r1")


def test_the_page_fills_days_without_usage_with_zeros(store: UsageStore) -> None:
    store.record([obs()], MIDNIGHT + 60)
    page = UsageReader([store.path]).page(since=date(2025, 2, 28), until=date(2025, 3, 3))
    assert page.days == ["2025-02-28", "2025-03-01", "2025-03-02", "2025-03-03"]
    assert page.held_gpu_hours["ada"] == pytest.approx([0.0, 0.0, 60 / 3600, 0.0])


def db_bytes(path: Path) -> int:
    """The database's size in pages (what the WAL holds included)."""
    with sqlite3.connect(path) as connection:
        return int(
            connection.execute("PRAGMA page_count").fetchone()[0] * connection.execute("PRAGMA page_size").fetchone()[0]
        )


def days_kept(path: Path) -> list[str]:
    with sqlite3.connect(path) as connection:
        return [day for (day,) in connection.execute("SELECT DISTINCT day FROM usage_daily ORDER BY day")]


def test_retention_drops_the_days_older_than_90(tmp_path: Path) -> None:
    today = MIDNIGHT + 12 * 3600
    with UsageStore(tmp_path / "usage-a.sqlite", retention_days=1000) as keeps_all:
        for back in (95, 91, 90, 89, 1):
            keeps_all.record([obs()], today - back * DAY)
    assert len(days_kept(keeps_all.path)) == 5
    with UsageStore(keeps_all.path) as store:
        report = store.prune(today)
    assert report is not None and report.days_by_age == 2 and report.days_by_size == 0
    first = (date(2025, 3, 2) - timedelta(days=90)).isoformat()
    assert days_kept(store.path)[0] == first and len(days_kept(store.path)) == 3


def test_retention_runs_with_record_on_a_new_day(tmp_path: Path) -> None:
    with UsageStore(tmp_path / "usage-a.sqlite", retention_days=7) as writer:
        writer.record([obs()], MIDNIGHT - 10 * DAY)
        writer.record([obs()], MIDNIGHT + 60)  # a new UTC day: record prunes
    assert days_kept(writer.path) == ["2025-03-02"]


def test_the_size_cap_prunes_the_oldest_days_first(tmp_path: Path) -> None:
    cap = 128 * 1024
    with UsageStore(tmp_path / "usage-a.sqlite") as uncapped:
        for back in range(30, -1, -1):
            batch = [obs(job=f"job-{back}-{n}-" + "x" * 40, gpu=n % 8) for n in range(100)]
            uncapped.record(batch, MIDNIGHT + 60 - back * DAY)
    assert db_bytes(uncapped.path) > 1.5 * cap
    with UsageStore(uncapped.path, max_bytes=cap) as writer:
        report = writer.prune(MIDNIGHT + 120)
    assert report is not None and report.days_by_size > 0 and report.vacuumed
    assert report.file_bytes <= cap and db_bytes(writer.path) <= cap and writer.path.stat().st_size <= cap
    kept = days_kept(writer.path)
    assert kept[-1] == "2025-03-02" and len(kept) == 31 - report.days_by_size  # the newest days, contiguous
    assert kept[0] == (date(2025, 3, 2) - timedelta(days=len(kept) - 1)).isoformat()


def test_a_read_only_database_warns_and_the_writer_keeps_the_interval(
    store: UsageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.record([obs()], MIDNIGHT + 60)
    store.close()
    connect = sqlite3.connect
    with monkeypatch.context() as patch:  # a read-only file even for root: SQLite's own read-only open
        patch.setattr(
            usage_store.sqlite3, "connect", lambda path, **kw: connect(f"{Path(path).as_uri()}?mode=ro", uri=True, **kw)
        )
        with pytest.warns(UsageStoreWarning, match="readonly database.*keeps this interval"):
            assert not store.record([obs()], MIDNIGHT + 120)
        assert store.pending == 1
        store.close()
    assert store.record([obs()], MIDNIGHT + 180) and store.pending == 0
    assert UsageReader([store.path]).rows()[0].held_s == pytest.approx(180.0)  # the kept interval too


def test_pending_intervals_are_bounded(tmp_path: Path) -> None:
    path = tmp_path / "usage-a.sqlite"
    with UsageStore(path, busy_timeout_s=0.05, max_pending=2) as writer:
        writer.record([obs()], MIDNIGHT + 60)
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # another writer holds the lock
        with pytest.warns(UsageStoreWarning, match="database is locked"):
            for step in (2, 3):
                assert not writer.record([obs()], MIDNIGHT + 60 * step)
        assert writer.pending == 2
        with pytest.warns(UsageStoreWarning) as caught:
            assert not writer.record([obs()], MIDNIGHT + 240)
        assert "the oldest 1 (0.02 GPU-hours held) are dropped" in str(caught[-1].message)
        assert writer.pending == 2
        holder.execute("ROLLBACK")
        holder.close()
        assert writer.record([obs()], MIDNIGHT + 300) and writer.pending == 0
    assert UsageReader([path]).rows()[0].held_s == pytest.approx(4 * 60.0)  # the first, 2 kept and the last


def test_a_locked_database_warns_and_the_view_goes_on(tmp_path: Path) -> None:
    for host in ("a", "b"):
        with UsageStore(tmp_path / f"usage-{host}.sqlite") as writer:
            writer.record([obs(host=host, user=f"user-{host}")], MIDNIGHT + 60)
    holder = sqlite3.connect(tmp_path / "usage-b.sqlite", isolation_level=None)
    holder.execute("PRAGMA locking_mode = EXCLUSIVE")
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("DELETE FROM meta")
    holder.execute("COMMIT")  # an exclusive lock kept after the write: nobody else reads
    try:
        reader = UsageReader([tmp_path], busy_timeout_s=0.05)
        with pytest.warns(UsageStoreWarning, match="usage-b.sqlite is left out: locked"):
            page = reader.page()
    finally:
        holder.close()
    assert set(page.held_gpu_hours) == {"user-a"}
    assert len(page.notes) == 1 and "locked" in page.notes[0]
    assert [Path(p).name for p in page.databases] == ["usage-a.sqlite"]


def test_a_corrupt_database_warns_by_name_and_the_view_goes_on(tmp_path: Path) -> None:
    with UsageStore(tmp_path / "usage-a.sqlite") as writer:
        writer.record([obs()], MIDNIGHT + 60)
    (tmp_path / "usage-bad.sqlite").write_bytes(b"not sqlite at all " * 512)
    with pytest.warns(UsageCorruptWarning, match="usage-bad.sqlite is left out: corrupt"):
        page = UsageReader([tmp_path]).page()
    assert page.held_gpu_hours["ada"] == pytest.approx([60 / 3600])
    with UsageStore(tmp_path / "usage-bad.sqlite") as writer, pytest.warns(UsageCorruptWarning, match="Move the file"):
        assert not writer.record([obs()], MIDNIGHT + 60)


def test_errors_are_told_apart() -> None:
    assert classify_error(sqlite3.OperationalError("database is locked")) == "locked"
    assert classify_error(sqlite3.OperationalError("attempt to write a readonly database")) == "read-only"
    assert classify_error(sqlite3.DatabaseError("database disk image is malformed")) == "corrupt"
    assert classify_error(sqlite3.OperationalError("no such table: usage_daily")) == "other"


def test_the_default_path_is_local_state_and_a_network_filesystem_is_seen(tmp_path: Path) -> None:
    assert default_usage_path("node/1", {"XDG_STATE_HOME": "/st"}) == Path("/st/lightning_accel/usage-node_1.sqlite")
    assert default_usage_path("n", {"HOME": "/h"}).name == "usage-n.sqlite"
    assert default_usage_path("n", {"ACCEL_USAGE_DIR": "/u"}) == Path("/u/usage-n.sqlite")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        f"22 1 0:21 / / rw - ext4 /dev/sda1 rw\n40 22 0:40 / {tmp_path}/shared rw - nfs4 server:/export rw\n"
    )
    (tmp_path / "shared").mkdir()
    assert filesystem_type(tmp_path / "shared", mountinfo) == "nfs4"
    assert filesystem_type(tmp_path, mountinfo) == "ext4"


def run_csv(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[list[str]]:
    assert main(["usage", "--csv", *argv]) == 0
    return list(csv.reader(io.StringIO(capsys.readouterr().out)))


def test_the_csv_command_writes_the_columns_and_the_rows_of_the_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with UsageStore(tmp_path / "usage-a.sqlite") as a, UsageStore(tmp_path / "usage-b.sqlite") as b:
        a.record([obs(idle=True, energy_j=3.6e6, samples=100, steps=5)], MIDNIGHT + 60)
        b.record([obs(host="b", user="bob", job="r2", gpu=3, held_s=36.0)], MIDNIGHT + 60 + DAY)
    rows = run_csv(["--db", str(tmp_path / "usage-a.sqlite"), "--db", str(tmp_path / "usage-b.sqlite")], capsys)
    assert tuple(rows[0]) == CSV_COLUMNS
    assert rows[1] == ["2025-03-02", "a", "ada", "r1", "GPU-a-0", "0", "0.0167", "0.0167", "1.000000", "100", "5"]
    assert rows[2] == ["2025-03-03", "b", "bob", "r2", "GPU-b-3", "3", "0.0100", "0.0000", "0.000000", "0", "0"]
    assert [row[0] for row in run_csv(["--db", str(tmp_path), "--since", "2025-03-03"], capsys)[1:]] == ["2025-03-03"]
    assert len(run_csv(["--db", str(tmp_path), "--until", "2025-03-01"], capsys)) == 1  # the header only


def test_the_csv_command_names_a_bad_date_and_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["usage", "--csv", "--db", str(tmp_path), "--since", "2025-02-30"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --since: '2025-02-30' is not a date; pass a UTC day as YYYY-MM-DD" in err
    with pytest.raises(SystemExit):
        main(["usage", "--csv", "--db", str(tmp_path), "--since", "2025-03-02", "--until", "2025-03-01"])
    assert "`--since 2025-03-02` is after `--until 2025-03-01`" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["usage", "--csv", "--db", str(tmp_path / "nope.sqlite")])
    assert "`--db " in capsys.readouterr().err


def test_the_totals_table_and_the_warning_of_a_corrupt_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with UsageStore(tmp_path / "usage-a.sqlite") as writer:
        writer.record([obs(held_s=36.0, interval_s=36.0)], MIDNIGHT + 60)
    (tmp_path / "usage-bad.sqlite").write_bytes(b"\0" * 4096)
    assert main(["usage", "--db", str(tmp_path), "--by", "user"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[1].split() == ["ada", "a", "0.01", "0.00", "0.00", "0", "0"]
    assert "warning: the usage database" in err and "usage-bad.sqlite" in err


CHILD = """
import sys
from lightning_accel.dash.usage_store import UsageStore
from lightning_accel.dash.usage_schema import UsageObservation

store = UsageStore(sys.argv[1])
gpus = [
    UsageObservation(host="a", user="ada", job="r1", gpu_index=i, interval_s=1.0, held_s=1.0, samples=1, steps=1)
    for i in range(8)
]
n = 0
while True:
    n += 1
    assert store.record(gpus, 1740873600.0 + n)
    print(n, flush=True)
"""


def test_a_writer_killed_mid_write_leaves_the_file_intact_and_at_most_the_last_interval_missing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "usage-a.sqlite"
    env = {**os.environ, "PYTHONPATH": str(Path(lightning_accel.__file__).parents[1])}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, text=True, env=env, bufsize=1
    )
    assert child.stdout is not None
    acked, deadline = 0, time.monotonic() + 30
    while acked < 200 and time.monotonic() < deadline:
        acked = int(child.stdout.readline() or 0) or acked
    os.kill(child.pid, signal.SIGKILL)  # in its loop: most likely inside a transaction
    rest = child.stdout.read().split()
    child.wait()
    acked = int(rest[-1]) if rest else acked
    assert child.returncode == -signal.SIGKILL and acked >= 200
    with sqlite3.connect(path) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        held = connection.execute("SELECT held_s, samples FROM usage_daily").fetchall()
    assert len(held) == 8 and len(set(held)) == 1  # each interval whole: every GPU's row alike
    assert held[0][1] in (acked, acked + 1)  # the interval it was killed in may have committed before its print


def test_a_jobs_steps_are_its_own_not_the_sum_over_its_gpus_and_nodes(tmp_path: Path) -> None:
    now = MIDNIGHT + 600
    with UsageStore(tmp_path / "usage-a.sqlite") as a, UsageStore(tmp_path / "usage-b.sqlite") as b:
        for store, host in ((a, "a"), (b, "b")):  # one two-node job of 2 GPUs a node: 10 steps, 16 samples a GPU
            store.record([obs(host=host, gpu=gpu, steps=10, samples=16) for gpu in (0, 1)], now)
        a.record([obs(host="a", job="r2", gpu=2, steps=5)], now)
    jobs = {total.key: total for total in UsageReader([tmp_path]).totals("job")}
    assert (jobs[("ada", "r1")].steps, jobs[("ada", "r1")].samples) == (10, 64)
    assert jobs[("ada", "r1")].held_s == pytest.approx(4 * 60.0)
    assert [(total.steps, total.samples) for total in UsageReader([tmp_path]).totals("user")] == [(15, 64)]
    hosts = {total.key: total.steps for total in UsageReader([tmp_path]).totals("host")}
    assert hosts == {("a",): 15, ("b",): 10}
    assert {row.steps for row in UsageReader([tmp_path]).rows() if row.job == "r1"} == {10}  # each GPU's own view


def test_a_database_whose_directory_cannot_be_made_warns_and_keeps_a_bounded_few(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    store = UsageStore(tmp_path / "a-file" / "usage-a.sqlite", max_pending=5)
    with pytest.warns(UsageStoreWarning, match=r"cannot be opened: .*\(EEXIST\).*keeps this interval"):
        for step in range(1, 21):
            assert not store.record([obs()], MIDNIGHT + 60 * step)
    assert store.pending == 5  # the oldest dropped, as for a locked database
    store.close()


def test_a_two_node_jobs_samples_are_counted_once_over_both_hosts_databases(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from lightning_accel.dash.usage_feed import UsageFeed

    def page(host: str, node_rank: int, samples: int, step: int) -> list[dict[str, object]]:
        beat = {  # each node's heartbeat counts the samples of the whole job (every data-parallel rank)
            "run_id": "r1",
            "name": "gpt",
            "user": "ada",
            "num_nodes": 2,
            "node_rank": node_rank,
            "samples": samples,
            "step": step,
            "gpus": [{"index": i, "uuid": f"GPU-{host}{i}", "energy_j": None} for i in range(2)],
        }
        return [{"host": host, "jobs": [SimpleNamespace(status="running", heartbeat=beat)], "cards": []}]

    for host, node_rank in (("a", 0), ("b", 1)):
        with UsageStore(tmp_path / f"usage-{host}.sqlite") as store:
            feed = UsageFeed(store, host)
            for t, samples, step in ((0, 0, 0), (2, 101, 4), (4, 203, 8)):
                feed.observe(MIDNIGHT + t, page(host, node_rank, samples, step), [])
    (job,) = UsageReader([tmp_path]).totals("job")
    assert (job.samples, job.steps) == (203, 8)  # not 406: each node took its half (102 + 101, the odd one on node 0)
    assert job.held_s == pytest.approx(4 * 4.0)  # 2 hosts x 2 GPUs x 4 s


def test_the_writer_may_be_called_from_one_thread_then_another_and_closed_from_a_third(tmp_path: Path) -> None:
    import threading

    store = UsageStore(tmp_path / "usage-a.sqlite")  # a page: its watch thread and its request handlers take turns
    results: list[bool] = []
    for step in (1, 2):
        thread = threading.Thread(target=lambda s=step: results.append(store.record([obs()], MIDNIGHT + 60 * s)))
        thread.start()
        thread.join()
    assert results == [True, True] and store.pending == 0
    store.close()  # from the main thread, as accel-dash does at Ctrl-C
    assert UsageReader([store.path]).rows()[0].held_s == pytest.approx(120.0)


def test_a_job_stale_for_a_while_keeps_its_counters_and_its_samples_are_counted(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from lightning_accel.dash.usage_feed import UsageFeed

    def page(status: str, samples: int) -> list[dict[str, object]]:
        beat = {"run_id": "r1", "name": "gpt", "user": "ada", "num_nodes": 1, "node_rank": 0, "samples": samples}
        beat |= {"step": samples // 10, "gpus": [{"index": 0, "uuid": "GPU-0", "energy_j": None}]}
        return [{"host": "a", "jobs": [SimpleNamespace(status=status, heartbeat=beat)], "cards": []}]

    with UsageStore(tmp_path / "usage-a.sqlite") as store:
        feed = UsageFeed(store, "a")
        for t, status, samples in ((0, "running", 0), (2, "running", 100), (4, "stale", 100), (6, "running", 300)):
            feed.observe(MIDNIGHT + t, page(status, samples), [])
        feed.observe(MIDNIGHT + 8, [{"host": "a", "jobs": [], "cards": []}], [])  # gone from the page: forgotten
        assert feed._progress == {}
    (job,) = UsageReader([tmp_path]).totals("job")
    assert (job.samples, job.steps) == (300, 30)  # the 200 done while it read stale counted when it came back
